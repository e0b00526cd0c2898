"""``sl.measure.audit``'s arithmetic and wording, on hand-made rows (no ranks): totals, the table, the findings, and
which dims a ``torch.fft`` call transforms. ``tests/multirank/test_audit.py`` audits real models on ranks."""


from shardlab.measure.audit import Audit, format_ops


def module_row(module, forward=None, backward=None, unpatched=(), moves=None, replicated=False, promoted=0, note=""):
    return {"module": module, "forward": forward or {}, "backward": backward or {}, "unpatched": list(unpatched),
            "unpatched moves": moves or {}, "replicated outputs": replicated, "promoted": promoted, "note": note}


ROWS = [
    module_row("blocks.0.Attn", forward={"all_reduce": (2, 6400)}, backward={"all_reduce": (3, 2336)}, promoted=1),
    module_row("blocks.0.Attn.qkv_project", backward={"all_reduce": (1, 1536)}, promoted=1),
    module_row("spectral", forward={"all_gather": (1, 8192)}, unpatched=["torch.fft.rfft2"],
               moves={"torch.fft.rfft2": ["all_gather"]}, replicated=True),
    module_row("(loss)", backward={"all_reduce": (1, 8)}),
]


def test_ops_read_as_calls_and_bytes_in_a_fixed_order():
    assert format_ops({"all_reduce": (2, 12288), "all_gather": (1, 640)}) == (
        "all_gather 1× 640 B; all_reduce 2× 12,288 B")
    assert format_ops({}) == ""


def test_totals_add_every_row_once_per_phase():
    assert Audit(ROWS).totals() == {"forward": {"all_reduce": (2, 6400), "all_gather": (1, 8192)},
                                    "backward": {"all_reduce": (5, 3880)}}
    assert Audit([]).totals() == {"forward": {}, "backward": {}}


def test_each_finding_is_one_line_that_names_its_module():
    audit = Audit(ROWS, error="AssertionError at physicsnemo/domain_parallel/shard_tensor.py:186 (backward)")
    assert audit.findings() == [
        "spectral: torch.fft.rfft2 has no ShardTensor handler, and DTensor's fallback gathered its sharded input "
        "(all_gather).",
        "spectral: sharded input, Replicate output, an all_gather inside: a silent gather (every rank held and "
        "computed the whole tensor).",
        "the backward raised AssertionError at physicsnemo/domain_parallel/shard_tensor.py:186 (backward).",
    ]
    assert not audit.clean
    assert Audit(ROWS[:2] + ROWS[3:]).clean


def test_an_all_to_all_is_a_redistribution_not_a_gather():
    row = module_row("view", unpatched=["aten.view.default"], moves={"aten.view.default": ["all_to_all"]})
    assert Audit([row]).findings() == ["view: aten.view.default has no ShardTensor handler, and DTensor's fallback "
                                       "redistributed its sharded input (all_to_all)."]


def test_the_table_has_a_row_per_module_and_the_total():
    table = Audit(ROWS).table("Transolver on 2 ranks")
    assert table.columns == ["module", "forward", "backward", "promoted", "found"]
    assert [r["module"] for r in table.rows] == ["blocks.0.Attn", "blocks.0.Attn.qkv_project", "spectral", "(loss)",
                                                 "total"]
    assert table.rows[0]["forward"] == "all_reduce 2× 6,400 B" and table.rows[2]["found"] == (
        "unpatched torch.fft.rfft2; silent gather")
    assert table.rows[-1]["backward"] == "all_reduce 5× 3,880 B"
    assert str(table).startswith("# Transolver on 2 ranks")


def test_a_backward_not_traced_to_a_module_says_so_in_its_row():
    row = module_row("Net", backward={"all_reduce": (1, 8)}, note="backward collectives of nodes no module created")
    assert "(backward collectives of nodes no module created)" in Audit([row]).table().rows[0]["backward"]
