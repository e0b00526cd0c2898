"""``python -m shardlab.port``'s bad input, caught before any rank starts: one line each that says what to change,
and nothing written. (An op without a handler needs the ranks: tests/multirank/test_port.py.)"""

import json
import sys
import textwrap

import pytest

from shardlab import port
from shardlab.port import spec


def refused(capsys, argv) -> str:
    assert port.main(argv) == 1
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("port: "), captured.err
    return lines[0]


TARGET = ["--field", "256x256", "--gpus", "4", "--gpu", "80GiB"]


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(textwrap.dedent("""
        import torch

        def broken():
            raise RuntimeError("no weights file at /nowhere")

        def conv():
            return torch.nn.Conv2d(1, 1, 3, padding=1)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("mine", None)


def test_an_import_path_that_does_not_resolve(tmp_path, capsys):
    line = refused(capsys, ["nosuchpackage.models:build", *TARGET, "--out", str(tmp_path / "run")])
    assert "cannot import nosuchpackage.models" in line and "PYTHONPATH" in line
    assert not (tmp_path / "run").exists()


def test_a_factory_that_raises(factories, capsys):
    out = factories / "run"
    line = refused(capsys, ["mine:broken", "--input", "x=1x1xNxN", "--shard", "x:2", *TARGET, "--out", str(out)])
    assert "the factory raised RuntimeError: no weights file at /nowhere" in line
    assert not out.exists()


def test_a_case_the_model_does_not_take(factories, capsys):
    out = factories / "run"
    line = refused(capsys, ["mine:conv", "--input", "y=1x1xNxN", "--shard", "y:2", *TARGET, "--out", str(out)])
    assert "takes (input), not 'y'" in line
    # a split dim that does not follow the size (channels) is refused too
    line = refused(capsys, ["mine:conv", "--input", "input=1x1xNxN", "--shard", "input:1", *TARGET, "--out", str(out)])
    assert "does not follow the field" in line and "split dim 2 or 3" in line
    assert not out.exists()


def test_a_target_that_fits_on_no_layout_says_the_smallest_that_would(tmp_path, capsys):
    out = tmp_path / "run"
    line = refused(capsys, ["U-Net", "--field", "16384x16384", "--gpus", "2", "--gpu", "8GiB", "--out", str(out)])
    assert "fits on no layout of 2 GPUs of 8.0 GiB" in line
    smallest = int(line.split("smallest that would is a domain of ")[1].split()[0])
    assert smallest > 2 and f"--gpus {smallest} or more" in line
    assert not out.exists()


def test_a_write_folder_that_exists_is_never_overwritten(tmp_path, capsys):
    kept = tmp_path / "kept.txt"
    kept.write_text("mine")
    line = refused(capsys, ["U-Net", *TARGET, "--out", str(tmp_path)])
    assert "exists" in line and "never overwrites" in line
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"] and kept.read_text() == "mine"


def test_shapes_are_numbers_and_n(capsys):
    assert spec.parse_shape("1xNx3") == [1, "N", 3]
    with pytest.raises(spec.PortError, match="each a number or N"):
        spec.parse_shape("1xMx3")
    assert spec.shape_of((1, 16, 3), (1, 32, 3), (16, 32), "x") == [1, "N", 3]
    with pytest.raises(spec.PortError, match="neither the size"):
        spec.shape_of((1, 12), (1, 20), (16, 32), "geometry")


def test_the_written_model_needs_no_shardlab():
    """The series' U-Net lives in shardlab: model.py carries its class and the arguments it was built with."""
    source = spec.model_source(spec.named_case("U-Net"), 32)
    assert "shardlab" not in "".join(line for line in source.splitlines() if line.startswith(("import", "from")))
    namespace = {}
    exec(compile(source, "model.py", "exec"), namespace)
    model = namespace["build_model"](32)
    assert type(model).__name__ == "UNet" and len(model.down) == 2 and model.down[0].out_channels == 8


def _failing_parity(spec, ranks, timeout_s):
    """What the job of ranks hands back for a model whose audit is clean and whose parity fails at one size (the job
    itself runs in tests/multirank/test_port.py): the gate is the port's, not the ranks'."""
    return {"ranks": ranks, "domain": spec["domain"], "audit": {"findings": [], "unpatched": [], "bytes": {},
                                                                 "seconds": 0.1},
            "parity": [{"size": size, "split": "even", "output": 3e-4, "gradient": 1e-3, "worst parameter": "w",
                        "parameters": 1, "seconds": 0.1} for size in spec["sizes"]]}


def test_a_run_whose_parity_fails_is_written_only_with_the_flag_named_for_what_it_skips(tmp_path, capsys,
                                                                                        monkeypatch):
    monkeypatch.setattr(port.steps, "on_ranks", _failing_parity)
    argv = ["U-Net", "--field", "1024x1024", "--gpus", "4", "--gpu", "80GiB", "--ranks", "2"]
    line = refused(capsys, [*argv, "--out", str(tmp_path / "refused")])
    assert "parity failed, so no run is written" in line and "--skip-parity-gate" in line
    assert not (tmp_path / "refused").exists()

    out = tmp_path / "written"
    assert port.main([*argv, "--out", str(out), "--skip-parity-gate"]) == 0
    printed = capsys.readouterr().out
    assert "OVER 1e-10" in printed and f"written: {out}" in printed
    config = json.loads((out / "run.json").read_text())
    assert config["port"]["parity_held"] is False and any("OVER" in line for line in config["port"]["parity"])
    readme = (out / "README.md").read_text()
    assert "**parity FAILED**: written with --skip-parity-gate" in readme
