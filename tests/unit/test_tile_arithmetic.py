"""A field tiled over two domain axes, without ranks: the tile mesh's shapes, the tiles' bounds, the halo arithmetic
of tiles against slabs (measured on ranks in tests/multirank/test_tiles.py), and the tile-placement figure."""

import matplotlib

matplotlib.use("Agg")

from types import SimpleNamespace

import matplotlib.pyplot as plt
import pytest
import torch

from shardlab import mesh, plot
from shardlab.mesh import MeshError
from shardlab.models import conv_stack
from shardlab.plot import layout


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("world, ddp, tiles, expected", [
    (4, -1, (2, 2), (1, 2, 2)), (8, -1, (2, 2), (2, 2, 2)), (8, 1, (2, 4), (1, 2, 4)), (6, -1, (3, 1), (2, 3, 1)),
    (1, -1, (1, 1), (1, 1, 1)),
])
def test_tile_shapes(world, ddp, tiles, expected):
    assert mesh.resolve_tile_shape(world, ddp, tiles) == expected


@pytest.mark.parametrize("world, ddp, tiles, match", [
    (6, -1, (2, 2), r"tiles=\(2, 2\) put 4 ranks in each domain group, which does not divide the world size 6: "
                    r"choose tiles whose product is one of \[1, 2, 3, 6\], or start 8 ranks"),
    (8, 1, (2, 2), r"ddp × tiles = 1 × 2×2 = 4, but the world size is 8\. Use ddp=-1"),
    (4, 0, (2, 2), "ddp=0: an axis size is a positive integer"),
    (4, -1, (4,), r"tiles=\(4,\): give \(tiles along H, tiles along W\) as two positive integers"),
    (4, -1, (2, 0), "tiles=.2, 0.: give"),
    (4, -1, (2.0, 2), "tiles=.2.0, 2.: give"),
    (4, -1, 4, "tiles=4: give"),
])
def test_bad_tile_shapes_say_what_to_change(world, ddp, tiles, match):
    with pytest.raises(MeshError, match=match):
        mesh.resolve_tile_shape(world, ddp, tiles)


def test_tile_domain_refuses_a_mesh_without_the_two_domain_axes():
    with pytest.raises(MeshError, match=r"no \(domain_h, domain_w\) axes: build it with build_tile_mesh"):
        mesh.tile_domain(SimpleNamespace(mesh_dim_names=("ddp", "domain")))


@pytest.mark.parametrize("height, width, tiles", [(8, 8, (2, 2)), (9, 10, (2, 4)), (7, 5, (3, 2)), (6, 6, (1, 3))])
def test_tiles_cover_the_field_once_row_major_as_torch_chunk_splits(height, width, tiles):
    owner = torch.full((height, width), -1)
    bounds = mesh.tile_bounds(height, width, tiles)
    for tile in bounds:
        (r0, r1), (c0, c1) = tile["rows"], tile["cols"]
        assert (owner[r0:r1, c0:c1] == -1).all()
        owner[r0:r1, c0:c1] = tile["rank"]
    assert (owner >= 0).all()
    assert [t["rank"] for t in bounds] == list(range(tiles[0] * tiles[1]))
    assert [t["coords"] for t in bounds][:2] == [(0, 0), (0, 1) if tiles[1] > 1 else (1, 0)]
    rows = [len(c) for c in torch.chunk(torch.arange(height), tiles[0])]
    assert [r1 - r0 for (r0, r1) in dict.fromkeys(t["rows"] for t in bounds)] == rows


def test_slab_halo_is_k_half_rows_of_the_whole_width_per_neighbour():
    # 4 ranks, 3×3 kernel, 5 channels, float64: edges have one neighbour, the middle ranks two.
    assert mesh.halo_bytes_slab(64, 48, 5, 4, 3, 8) == [48 * 5 * 8, 2 * 48 * 5 * 8, 2 * 48 * 5 * 8, 48 * 5 * 8]
    assert mesh.halo_bytes_slab(64, 48, 5, 4, 5, 8)[1] == 2 * 2 * 48 * 5 * 8  # 2 rows per side for a 5×5 kernel
    assert mesh.halo_bytes_slab(64, 48, 5, 1, 3) == [0]


def test_tile_halo_sends_rows_then_h_padded_columns():
    h, c, item = 1, 3, 4
    # 2×2 tiles of 32×32: one H neighbour (h × 32 columns) and one W neighbour (h × (32 + 2h) rows, corners in).
    assert mesh.halo_bytes_tile(64, 64, c, (2, 2), 3, item) == [(32 + 34) * h * c * item] * 4
    # 3×3 tiles of 10×10: the middle tile has every neighbour: 2h(W/pw + H/ph + 2h)·C.
    sent = mesh.halo_bytes_tile(30, 30, c, (3, 3), 3, item)
    assert sent[4] == 2 * h * (10 + 10 + 2 * h) * c * item
    assert sent[0] == h * (10 + 12) * c * item and sent[1] == h * (2 * 12 + 10) * c * item
    # 5×5 kernel: 2 rows per side; uneven split (torch.chunk: 4 and 3 rows, 5 and 5 columns).
    assert mesh.halo_bytes_tile(7, 10, 1, (2, 2), 5, 1) == [2 * 5 + 2 * (4 + 4), 2 * 5 + 2 * (4 + 4),
                                                            2 * 5 + 2 * (3 + 4), 2 * 5 + 2 * (3 + 4)]


@pytest.mark.parametrize("height, width, n", [(64, 48, 4), (65, 16, 3), (256, 16, 8)])
def test_n_by_one_tiles_are_slabs(height, width, n):
    assert mesh.halo_bytes_tile(height, width, 2, (n, 1), 3, 8) == mesh.halo_bytes_slab(height, width, 2, n, 3, 8)


def test_halo_arithmetic_refuses_what_cannot_be_exchanged():
    with pytest.raises(ValueError, match=r"tile \(0, 0\) is only 8×1: use fewer tiles or a larger field than 16×4"):
        mesh.halo_bytes_tile(16, 4, 1, (2, 4), 5)
    with pytest.raises(ValueError, match="odd"):
        mesh.halo_bytes_tile(16, 16, 1, (2, 2), 4)
    with pytest.raises(ValueError, match="rank 0 owns only 1 of 4 rows"):
        mesh.halo_bytes_slab(4, 16, 1, 4, 5)
    with pytest.raises(MeshError, match="tiles="):
        mesh.halo_bytes_tile(16, 16, 1, (0, 2), 3)


def test_conv_halo_bytes_sum_every_layer_at_its_input_channels():
    model = conv_stack(width=4, layers=3).double()  # inputs of 1, 4 and 4 channels
    one_channel = mesh.halo_bytes_tile(64, 64, 1, (2, 2), 3, 8)
    assert mesh.conv_halo_bytes(model, 64, 64, (2, 2)) == [9 * b for b in one_channel]
    assert mesh.conv_halo_bytes(model, 64, 64, 4) == [9 * b for b in mesh.halo_bytes_slab(64, 64, 1, 4, 3, 8)]
    assert mesh.conv_halo_bytes(model.float(), 64, 64, 4)[0] == 9 * 64 * 4  # the parameters' itemsize
    with pytest.raises(ValueError, match="'same' convolutions only"):
        mesh.conv_halo_bytes(torch.nn.Conv2d(1, 1, 3, stride=2, padding=1), 16, 16, 2)
    with pytest.raises(ValueError, match="no Conv2d layer"):
        mesh.conv_halo_bytes(torch.nn.Linear(2, 2), 16, 16, 2)


def test_tiles_win_on_a_square_field_and_slabs_on_a_tall_narrow_one():
    square = mesh.halo_by_tile_grid(64, 64, 4)
    assert square == {(1, 4): 132, (2, 2): 66, (4, 1): 128}  # 2×2: L + 2h against a slab's 2L
    assert min(square, key=square.get) == (2, 2)
    tall = mesh.halo_by_tile_grid(256, 16, 8)
    assert min(tall, key=tall.get) == (8, 1) and tall[(8, 1)] == 2 * 16  # slabs: 2 neighbours × W
    # Past N = 3 a slab's halo never shrinks (2·64); a tile's perimeter does, once tiles have neighbours on every
    # side (16 ranks: 4×4, 2·(16 + 16 + 2); 64 ranks: 8×8, 2·(8 + 8 + 2)).
    best = {n: min(mesh.halo_by_tile_grid(64, 64, n).values()) for n in (4, 16, 64)}
    assert best == {4: 66, 16: 68, 64: 36}
    assert all(mesh.halo_by_tile_grid(64, 64, n)[(n, 1)] == 128 for n in (4, 16, 64))
    assert (1, 32) not in mesh.halo_by_tile_grid(16, 16, 32)  # tiles narrower than the halo are left out


def test_tile_map_draws_each_tile_and_the_strips_it_receives_in_the_sender_colour():
    fig = layout.tile_map(64, 64, (2, 2))
    ax = fig.axes[0]
    boxes = {p.get_gid(): p for p in ax.patches}
    tiles = {b: boxes[b] for b in boxes if b.startswith("rank ")}
    assert sorted(tiles) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert all((t.get_width(), t.get_height()) == (32, 32) for t in tiles.values())
    assert tiles["rank 0"].get_edgecolor() == plot.rank_colour(0)
    # Each tile: a strip from its H neighbour, one from its W neighbour, and the diagonal's corner via the W one.
    assert sorted(b for b in boxes if b.startswith(("halo 0", "corner 0"))) == ["corner 0<-3 via 1", "halo 0<-1",
                                                                              "halo 0<-2"]
    assert len([b for b in boxes if b.startswith(("halo", "corner"))]) == 4 * 3
    rank0, below, right = tiles["rank 0"], boxes["halo 0<-2"], boxes["halo 0<-1"]
    assert (below.get_y(), below.get_height(), below.get_width()) == (rank0.get_y() + 32, 1, 32)
    assert (right.get_x(), right.get_width(), right.get_height()) == (rank0.get_x() + 32, 1, 32)
    assert boxes["corner 0<-3 via 1"].get_edgecolor() == plot.rank_colour(3) and below.get_hatch()
    assert "sends 66 values/channel" in " ".join(t.get_text() for t in ax.texts)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "32", "32", "64"]  # the field's own columns
    fig.canvas.draw()


def test_tile_map_middle_tile_and_a_given_axes():
    fig, ax = plt.subplots()
    assert layout.tile_map(30, 30, (3, 3), kernel_size=5, ax=ax) is fig
    boxes = {p.get_gid(): p for p in ax.patches}
    middle = sorted(b for b in boxes if b.startswith(("halo 4<", "corner 4<")))
    assert middle == ["corner 4<-0 via 3", "corner 4<-2 via 5", "corner 4<-6 via 3", "corner 4<-8 via 5",
                      "halo 4<-1", "halo 4<-3", "halo 4<-5", "halo 4<-7"]
    assert boxes["halo 4<-3"].get_height() == 10 and boxes["halo 4<-3"].get_width() == 2
    with pytest.raises(ValueError, match="tile"):
        layout.tile_map(8, 8, (4, 4), kernel_size=7)
