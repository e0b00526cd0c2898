"""Field stores (``sl.data``): written deterministically and whole or not at all, read a range of rows by reading
only the chunks that overlap it (counted by the kernel, not by shardlab), refused with a message that says what to
change. Samples per domain group: torch's ``DistributedSampler`` over the ddp replicas gives every rank of a group the
same samples (the split notebook 12 rebuilds by hand), where one over the whole world splits a domain group's
ShardTensor over different samples. Slabs on real ranks: tests/multirank/test_slab_loading.py."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from shardlab import data, mesh

H, W, ROWS = 512, 512, 64  # one sample: 1 MiB, chunks of 64 rows: 128 KiB


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return data.write_field_store(tmp_path_factory.mktemp("fields") / "f.zarr", 4, H, W, chunk_rows=ROWS, seed=3)


def stored_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_the_same_parameters_write_the_same_bytes_and_the_chunking_does_not_change_the_values(store, tmp_path):
    again = data.write_field_store(tmp_path / "again.zarr", 4, H, W, chunk_rows=ROWS, seed=3)
    assert stored_bytes(again) == stored_bytes(store)
    k = data.open_store(store).field("permeability")[:]
    rechunked = data.write_field_store(tmp_path / "rechunked.zarr", 4, H, W, chunk_rows=48, seed=3)
    assert np.array_equal(data.open_store(rechunked).field("permeability")[:], k)
    other_seed = data.write_field_store(tmp_path / "other.zarr", 4, H, W, chunk_rows=ROWS, seed=4)
    assert not np.allclose(data.open_store(other_seed).field("permeability")[:], k)
    assert k.shape == (4, 1, H, W) and k.dtype == np.float32 and k.min() > 0
    assert not np.allclose(k[0], k[1])  # samples differ
    assert np.abs(np.diff(k[0, 0], axis=0)).max() < 0.05 * np.ptp(k[0])  # smooth: small row-to-row steps
    target = data.open_store(store).field("target")[:]
    assert np.allclose(target, 1 / (1 + k))


def test_a_complete_store_is_reused_and_one_of_other_parameters_replaced(store, tmp_path):
    chunk = store / "permeability" / "c" / "0" / "0" / "0" / "0"
    stamp = chunk.stat().st_mtime_ns
    assert data.write_field_store(store, 4, H, W, chunk_rows=ROWS, seed=3) == store
    assert chunk.stat().st_mtime_ns == stamp
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "keep.txt").write_text("not a store")
    with pytest.raises(data.StoreError, match=r"notes exists and is not a shardlab store: write to another path"):
        data.write_field_store(mine, 2, 32, 16, chunk_rows=8)
    assert (mine / "keep.txt").read_text() == "not a store"
    path = data.write_field_store(tmp_path / "s.zarr", 2, 32, 16, chunk_rows=8)
    data.write_field_store(path, 3, 32, 16, chunk_rows=8)
    assert data.open_store(path).field("permeability").shape == (3, 1, 32, 16)
    assert data.open_store(path).params["samples"] == 3


@pytest.mark.parametrize("interruption", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_write_that_fails_half_way_leaves_nothing_and_keeps_the_old_store(tmp_path, monkeypatch, interruption):
    rows_written = []
    original = data.writer._permeability_rows

    def failing(*args, **kwargs):
        rows_written.append(args[1])
        if len(rows_written) == 3:  # the third chunk of rows: two are on disk already
            raise interruption
        return original(*args, **kwargs)

    monkeypatch.setattr(data.writer, "_permeability_rows", failing)
    with pytest.raises(type(interruption)):
        data.write_field_store(tmp_path / "new.zarr", 2, 64, 16, chunk_rows=8)
    assert list(tmp_path.iterdir()) == []  # neither the store nor its partial copy
    monkeypatch.setattr(data.writer, "_permeability_rows", original)
    old = data.write_field_store(tmp_path / "old.zarr", 1, 64, 16, chunk_rows=8)
    before = stored_bytes(old)
    rows_written.clear()
    monkeypatch.setattr(data.writer, "_permeability_rows", failing)
    with pytest.raises(type(interruption)):
        data.write_field_store(old, 2, 64, 16, chunk_rows=8)
    assert [p.name for p in tmp_path.iterdir()] == ["old.zarr"] and stored_bytes(old) == before


def rchar() -> int:
    """Bytes this process has read through read() calls, as the kernel counts them."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="/proc/self/io is Linux's")
@pytest.mark.parametrize("start, stop", [(0, 128), (100, 228), (256, 512), (0, 512), (200, 201)])
def test_reading_rows_reads_only_the_chunks_that_overlap_them(store, start, stop):
    opened = data.open_store(store)
    opened.field("permeability")  # metadata read before counting
    before = rchar()
    values, counted = data.read_range(opened, 2, start, stop)
    kernel = rchar() - before
    chunks = len(range(start // ROWS, -(-stop // ROWS)))
    expected = chunks * ROWS * W * 4
    assert values.shape == (1, 1, stop - start, W)
    assert np.array_equal(values, opened.field("permeability")[2:3, :, start:stop])
    assert counted == expected
    assert expected <= kernel <= expected + 16 * 1024, (kernel, expected)  # a metadata file at most beside them
    sample = H * W * 4
    assert kernel / sample <= (stop - start) / H + 2 * ROWS / H + 0.02  # about (b - a) / H, chunk-rounded


class FakeMesh:
    """What read_slab asks of a (ddp, domain) mesh before it reads anything."""

    mesh_dim_names = ("ddp", "domain")

    def __init__(self, domain: int, ddp: int = 1, coordinate=(0, 0)):
        self.sizes, self.coordinate = {"ddp": ddp, "domain": domain}, list(coordinate)

    def __getitem__(self, axis):
        sizes, local = self.sizes, self.coordinate[1]
        return type("Axis", (), {"size": lambda self: sizes[axis], "get_local_rank": lambda self: local})()

    def get_coordinate(self):
        return self.coordinate


BAD = {
    "sample out of range": (dict(sample=4), r"sample 4 is outside .*holds 4 samples: use an index in \[0, 4\)"),
    "negative sample": (dict(sample=-1), r"sample -1 is outside"),
    "rows outside": (dict(bounds=[(0, 256), (256, 600)]), r"reach outside the field's 512 rows: keep them within"),
    "gap": (dict(bounds=[(0, 200), (256, 512)]), r"do not cover the 512 rows once each: start at 0, start each rank"),
    "overlap": (dict(bounds=[(0, 300), (256, 512)]), r"do not cover the 512 rows once each"),
    "too few bounds": (dict(bounds=[(0, 512)]), r"1 bounds for 2 domain ranks: give one \(start, stop\) per rank"),
    "shape": (dict(expect_shape=(1, 1, 256, 256)), r"holds permeability samples of shape \(1, 1, 512, 512\), not "
                                                   r"\(1, 1, 256, 256\): write a store of that size"),
    "dtype": (dict(expect_dtype=torch.float64), r"holds permeability as torch.float32, not torch.float64: convert"),
    "field": (dict(field="velocity"), r"field='velocity' is not in .*: use one of \['permeability', 'target'\]"),
    "dim": (dict(dim=1), r"dim=1: shard along 2 \(rows, the chunked axis\) or 3 \(columns\)"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_slabs_are_refused_before_anything_is_read(store, case):
    options, message = BAD[case]
    opened = data.open_store(store)
    options = {"sample": 0, **options}
    with pytest.raises(data.StoreError, match=message) as raised:
        data.read_slab(opened, options.pop("sample"), FakeMesh(domain=2), **options)
    assert "\n" not in str(raised.value)
    assert opened.bytes_read == 0


def test_more_domain_ranks_than_rows_and_a_missing_store_say_what_to_do(tmp_path):
    short = data.write_field_store(tmp_path / "short.zarr", 1, 3, 8, chunk_rows=2)
    with pytest.raises(data.StoreError, match=r"4 domain ranks for 3 rows: .*Use at most 3 domain ranks"):
        data.read_slab(short, 0, FakeMesh(domain=4))
    with pytest.raises(data.StoreError, match=r"no field store at .*nowhere.zarr: write one with `python -m "
                                              r"shardlab.data store --out .*nowhere.zarr`"):
        data.read_slab(tmp_path / "nowhere.zarr", 0, FakeMesh(domain=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.zarr"]  # reading wrote nothing


def test_the_default_store_lives_under_shardlab_data_or_the_temp_folder_and_the_command_writes_it(
        tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SHARDLAB_DATA", raising=False)
    assert data.store_dir().parent == Path(__import__("tempfile").gettempdir())
    assert "shardlab" in data.store_dir().name
    monkeypatch.setenv("SHARDLAB_DATA", str(tmp_path))
    path = data.field_store()
    small = data.SMALL_STORE
    assert path.parent == tmp_path and data.open_store(path).field("permeability").shape == (
        small["samples"], 1, small["height"], small["width"])
    data.main(["store", "--out", str(tmp_path / "cli.zarr")])
    size = 2 * small["samples"] * small["height"] * small["width"] * 4 / 2**20  # two float32 fields, uncompressed
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'cli.zarr'}: {size:.1f} MiB"
    with pytest.raises(SystemExit):
        data.main(["store", "--big", "--darcy"])


def test_the_darcy_store_holds_load_darcys_samples(tmp_path):
    opened = data.open_store(data.write_darcy_store(tmp_path / "darcy.zarr"))
    raw = data.load_darcy()
    for name in data.FIELDS:
        assert np.array_equal(opened.field(name)[:], raw[name].numpy())
    assert opened.params["held_out"] == data.HELD_OUT


# --- the sampler ----------------------------------------------------------------------------------------------------

def by_hand(n, ddp, replica, seed, epoch):
    """Notebook 12's split: one permutation of (seed, epoch), the leftover dropped, position p to replica p % ddp."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return order[: n // ddp * ddp][replica::ddp]


@pytest.mark.parametrize("n", [7, 8, 13])
@pytest.mark.parametrize("ddp", [1, 2, 3, 4])
def test_a_distributed_sampler_over_the_ddp_replicas_is_the_split_by_hand(n, ddp):
    """num_replicas = the ddp size, rank = the ddp coordinate (global rank = replica × domain + domain rank): the
    ranks of a domain group get one list, the replicas disjoint ones of n // ddp samples, a new order each epoch."""
    domain = 2
    lists = {}
    for epoch in (0, 1):
        for rank in range(ddp * domain):
            sampler = DistributedSampler(range(n), num_replicas=ddp, rank=rank // domain, seed=5, drop_last=True)
            sampler.set_epoch(epoch)
            lists[epoch, rank] = list(sampler)
            assert lists[epoch, rank] == by_hand(n, ddp, rank // domain, 5, epoch)
        groups = [lists[epoch, replica * domain] for replica in range(ddp)]
        assert all(lists[epoch, r] == groups[r // domain] for r in range(ddp * domain))
        everything = [i for group in groups for i in group]
        assert len(set(everything)) == len(everything) == n // ddp * ddp
    assert lists[0, 0] != lists[1, 0]


def test_a_whole_world_distributed_sampler_glues_two_samples_into_one_field(store):
    """ddp=2, domain=2 on 4 ranks, global rank = 2 × replica + domain rank: ranks 0 and 1 build one ShardTensor."""
    ddp, domain, n = 2, 2, 4
    world = [list(DistributedSampler(range(n), num_replicas=ddp * domain, rank=r, seed=0)) for r in range(4)]
    ours = [list(DistributedSampler(range(n), num_replicas=ddp, rank=r // domain, seed=0)) for r in range(4)]
    assert world[0] != world[1] and world[2] != world[3]  # the two halves of each group: different samples
    assert ours[0] == ours[1] and ours[2] == ours[3] and not set(ours[0]) & set(ours[2])
    top, bottom = world[0][0], world[1][0]
    k = data.open_store(store).field("permeability")
    halves = [data.read_range(store, sample, a, b)[0]
              for sample, (_, a, b) in zip((top, bottom), mesh.shard_bounds(H, 2))]
    glued = np.concatenate(halves, axis=2)  # what full_tensor() would see: no error anywhere
    assert not any(np.allclose(glued, k[i:i + 1]) for i in range(n))  # a field of no sample
    steps = np.abs(np.diff(glued[0, 0], axis=0)).max(axis=1)
    assert steps[H // 2 - 1] > 5 * np.median(steps)  # a seam where the halves meet
    target = data.open_store(store).field("target")
    assert not np.allclose(1 / (1 + glued), target[top:top + 1])  # the top rank's target matches none of it
