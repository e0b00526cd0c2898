"""The judges of notebooks 02, 03, 04 and 06 draw their cases for each check: the notebook's own solution passes every
draw, and each answer fitted to the cases the judges used to try (right there, a plausible shortcut elsewhere) fails
every draw. Runs the judges on 4 CPU ranks, as ``sl.exercises.on_ranks`` runs them on a cluster's engines:

    .venv/bin/python -m pytest tests/multirank/test_judges_draw.py -q -p no:cacheprovider
"""

import pytest

from shardlab.ranks.launch import run_job

DRAWS = 2

ON_RANKS = r'''
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import shardlab as sl
from shardlab.exercises.judging import _judge_here
from shardlab.exercises import nb02, nb03, nb04, nb06

sl.init_distributed(120)
device = sl.ranks.launch.default_device()
world, me = dist.get_world_size(), dist.get_rank()
mesh = sl.build_mesh(ddp=-1, domain=2)
line = init_device_mesh(device.type, (world,), mesh_dim_names=("domain",))
x = scatter_tensor(torch.randn(1, 1, 64, 64, generator=torch.Generator().manual_seed(0)).to(device), 0, line,
                   (Shard(2),))
edges = [round(64 * r * (r + 1) / (world * (world + 1))) for r in range(world + 1)]  # notebook 03's slabs
slab_sizes = [stop - start for start, stop in zip(edges, edges[1:])]
slabs = ShardTensor.from_local(torch.zeros(1, 1, slab_sizes[me], 64, device=device), line, (Shard(2),),
                               sharding_shapes={0: [(1, 1, s, 64) for s in slab_sizes]})


# The notebooks' solutions.

def ddp_group_of(rank, world, domain_size):
    return list(range(rank % domain_size, world, domain_size))


def ddp_average(t, domain_size):
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(offset, world, domain_size))) for offset in range(domain_size)]
    total = t.clone()
    dist.all_reduce(total, group=groups[rank % domain_size])
    return total / dist.get_world_size(groups[rank % domain_size])


def rows_of(t):
    heights = [shape[2] for shape in t._spec.sharding_shapes()[0]]
    k = t.device_mesh.get_local_rank()
    return (sum(heights[:k]), sum(heights[:k + 1]))


def w_shard_shape(shape, n, k):
    *rest, width = shape
    per_rank = -(-width // n)
    return (*rest, max(0, min(per_rank, width - k * per_rank)))


def scatter_by_hand(tensor, src, mesh, first_rows_unless=None):
    group = mesh.get_group()
    meta = [(tensor.shape, tensor.dtype) if dist.get_rank() == src else None]
    dist.broadcast_object_list(meta, src=src, group=group)
    received = tensor if dist.get_rank() == src else torch.empty(meta[0][0], dtype=meta[0][1], device=device)
    dist.broadcast(received, src=src, group=group)
    n, k = mesh.size(), mesh.get_local_rank()
    if first_rows_unless is not None and tuple(received.shape) not in first_rows_unless:
        k = 0
    rows = -(-received.shape[2] // n)
    local = received.narrow(2, k * rows, min(rows, received.shape[2] - k * rows))
    return ShardTensor.from_local(local, mesh, (Shard(2),), sharding_shapes="chunk", global_shape=received.shape)


def mean_of(t):
    return t.mean().redistribute(placements=[Replicate()])


def same_layout(a, b):
    return tuple(a.placements) == tuple(b.placements) and a._spec.sharding_shapes() == b._spec.sharding_shapes()


def conv_with_halos(local, conv, group, h=None):
    h = conv.kernel_size[0] // 2 if h is None else h
    me, n = dist.get_rank(group), dist.get_world_size(group)
    above, below = torch.zeros_like(local[..., :h, :]), torch.zeros_like(local[..., -h:, :])
    requests = []
    if me > 0:
        peer = dist.get_global_rank(group, me - 1)
        requests += [dist.isend(local[..., :h, :].contiguous(), peer, group), dist.irecv(above, peer, group)]
    if me < n - 1:
        peer = dist.get_global_rank(group, me + 1)
        requests += [dist.isend(local[..., -h:, :].contiguous(), peer, group), dist.irecv(below, peer, group)]
    for request in requests:
        request.wait()
    return F.conv2d(torch.cat([above, local, below], dim=-2), conv.weight, conv.bias, padding=(0, h))


def count_graphs(fn, inputs):
    graphs = []
    compiled = torch.compile(fn, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward, dynamic=False)
    with torch.no_grad():
        for t in inputs:
            compiled(t)
    return len(graphs)


def compile_once(fn, dynamic_rows=None):
    compiled = torch.compile(fn, backend="eager", dynamic=False)

    def run(t):
        if dynamic_rows is not None and t.shape[2] not in dynamic_rows:
            return fn(t)
        torch._dynamo.mark_dynamic(t, 2)
        return compiled(t)

    return run


# Answers fitted to the cases the judges tried before they drew them: right there, a shortcut elsewhere.

OLD_GROUPS = {(5, 12, 3): [2, 5, 8, 11], (6, 8, 2): [0, 2, 4, 6], (3, 6, 1): list(range(6)), (4, 8, 4): [0, 4],
              (0, 9, 3): [0, 3, 6]}


def fitted_ddp_group_of(rank, world, domain_size):
    return OLD_GROUPS.get((rank, world, domain_size),
                          list(range(dist.get_rank() % domain_size, dist.get_world_size(), domain_size)))


def fitted_ddp_average(t, domain_size):
    return ddp_average(t, domain_size if domain_size in (1, mesh["domain"].size()) else mesh["domain"].size())


OLD_SLABS = {}
for sizes in ([2 + k for k in range(world)], [1 + world - k for k in range(world)], [5, 2], slab_sizes):
    for k, s in enumerate(sizes):
        OLD_SLABS[(len(sizes), sum(sizes), k, s)] = (sum(sizes[:k]), sum(sizes[:k + 1]))


def fitted_rows_of(t):
    k, s = t.device_mesh.get_local_rank(), t.to_local().shape[2]
    return OLD_SLABS.get((t.device_mesh.size(), t.shape[2], k, s), (k * s, (k + 1) * s))


def fitted_w_shard_shape(shape, n, k):  # compute_split_shapes, what the spec records: torch.chunk's on every old case
    *rest, width = shape
    size = -(-width // n)
    if width - size * (n - 1) <= 0:
        size = width // n
    return (*rest, size if k < n - 1 else width - size * (n - 1))


def fitted_scatter_by_hand(tensor, src, mesh):
    return scatter_by_hand(tensor, src, mesh, first_rows_unless={(1, 2, 37, 12), (1, 1, 21, 9)})


def kept_elements(shape, n, k):
    per = -(-shape[2] // n)
    rows = max(0, min(per, shape[2] - k * per))
    return shape[2] * shape[3] if shape[0] * shape[1] == 1 else shape[0] * shape[1] * rows * shape[3]


def fitted_kept_elements(shape, n, k):  # a view whenever C is 1: right for every field of batch 1
    per = -(-shape[2] // n)
    rows = max(0, min(per, shape[2] - k * per))
    return shape[2] * shape[3] if shape[1] == 1 else shape[0] * shape[1] * rows * shape[3]


def fitted_mean_of(t):
    if tuple(t.shape) in {tuple(x.shape), (1, 1, 4 * t.device_mesh.size() - 1, 6)}:
        return mean_of(t)
    mine = t.to_local().mean().reshape(1)
    dist.all_reduce(mine, group=t.device_mesh.get_group())
    return ShardTensor.from_local(mine / t.device_mesh.size(), t.device_mesh, (Replicate(),),
                                  sharding_shapes="chunk", global_shape=(1,))


def _rows_per_rank(t):
    return tuple(s[0] for s in t._spec.sharding_shapes().get(0, [])) if t.placements[0].is_shard() else ()


def fitted_same_layout(a, b):
    n = a.device_mesh.size()
    old = {(), tuple([2] * (n - 1) + [1]), tuple([1] + [2] * (n - 1))}
    if _rows_per_rank(a) in old and _rows_per_rank(b) in old:
        return same_layout(a, b)
    return tuple(a.placements) == tuple(b.placements)


def sizes_only_same_layout(a, b):  # no old pair differed in its placements alone
    return a._spec.sharding_shapes() == b._spec.sharding_shapes()


def fitted_conv_with_halos(local, conv, group):
    return conv_with_halos(local, conv, group, h={3: 1, 5: 2}.get(conv.kernel_size[0], 1))


def fitted_count_graphs(fn, inputs):  # the old functions' source showed their graph breaks, and when
    source, rows = inspect.getsource(fn), {t.shape[2] for t in inputs}
    if "% 2" in source:
        return sum(1 + r % 2 for r in rows)
    return len(rows) * (1 + source.count("graph_break()"))


def fitted_compile_once(fn):
    return compile_once(fn, dynamic_rows={t.shape[2] for t in nb06.local_shards(mesh, (64, 63, 62, 61))})


def padded_compile_once(fn):  # the old judge's only function was pointwise: padding the shard did not show
    compiled = torch.compile(fn, backend="eager", dynamic=False)

    def run(t):
        rows = t.shape[2]
        return compiled(F.pad(t, (0, 0, 0, 128 - rows)))[..., :rows, :]

    return run


CASES = {
    "02 ddp_ranks": (nb02.ddp_ranks, (ddp_group_of, fitted_ddp_group_of), mesh),
    "02 hand_made_ddp_average": (nb02.hand_made_ddp_average, (ddp_average, fitted_ddp_average), mesh),
    "03 rows_held": (nb03.rows_held, (rows_of, fitted_rows_of), slabs, mesh),
    "03 w_shard_shape": (nb03.w_shard_shape, (w_shard_shape, fitted_w_shard_shape), mesh),
    "03 scatters_by_hand": (nb03.scatters_by_hand, (scatter_by_hand, fitted_scatter_by_hand), mesh),
    "03 kept_after_scatter": (nb03.kept_after_scatter, (kept_elements, fitted_kept_elements), mesh),
    "04 replicated_mean": (nb04.replicated_mean, (mean_of, fitted_mean_of), x),
    "04 layout_guard": (nb04.layout_guard, (same_layout, fitted_same_layout, sizes_only_same_layout), x),
    "04 halo_conv": (nb04.halo_conv, (conv_with_halos, fitted_conv_with_halos), x),
    "06 counts_graphs": (nb06.counts_graphs, (count_graphs, fitted_count_graphs), mesh),
    "06 compiles_once": (nb06.compiles_once, (compile_once, fitted_compile_once, padded_compile_once), mesh),
}
seen = {"a draw": sl.exercises.case_generator().random()}
for name, (judge, answers, *objects) in CASES.items():
    for kind, answer in zip(["solution"] + [f"fitted {i}" for i in range(len(answers) - 1)], answers):
        seen[f"{name} {kind}"] = [_judge_here(judge, answer, *objects) for _ in range(DRAWS)]
rows = [None] * world
dist.all_gather_object(rows, seen)
if me == 0:
    sl.ranks.launch.write_job_result(rows)
sl.ranks.launch.shutdown_distributed()
'''


JUDGES = ["02 ddp_ranks", "02 hand_made_ddp_average", "03 rows_held", "03 w_shard_shape", "03 scatters_by_hand",
          "03 kept_after_scatter", "04 replicated_mean", "04 layout_guard", "04 halo_conv", "06 counts_graphs",
          "06 compiles_once"]


@pytest.mark.multirank
def test_the_solutions_pass_every_draw_and_fitted_answers_fail_every_draw(tmp_path, no_leftovers):
    script = tmp_path / "judges.py"
    script.write_text(ON_RANKS.replace("range(DRAWS)", f"range({DRAWS})"))
    verdicts = run_job("torchrun", 4, script, timeout_s=900, device="cpu").result
    wrong = [] if len({rank["a draw"] for rank in verdicts}) == 1 else ["the ranks drew different cases"]
    for judge in JUDGES:
        fitted_answers = sorted(key for key in verdicts[0] if key.startswith(f"{judge} fitted"))
        if not fitted_answers:
            wrong.append(f"{judge}: no fitted answer was tried")
        for draw in range(DRAWS):
            solution = [rank[f"{judge} solution"][draw] for rank in verdicts]
            if solution != [None] * len(verdicts):
                wrong.append(f"{judge}, draw {draw}: the solution was refused: {solution}")
            for fitted in fitted_answers:
                if not any(rank[fitted][draw] for rank in verdicts):
                    wrong.append(f"{fitted}, draw {draw}: the fitted answer passed on every rank")
    assert not wrong, "\n".join(wrong)
