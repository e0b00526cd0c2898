"""The rank panel on real ranks: while a cell hangs because rank 1 skipped a collective, the panel (read by a thread
of this process, no browser) names rank 1 as the one the others wait for; a warm rank's reset keeps one beacon per
rank; nothing is left running after stop."""

import threading
import time

import pytest
from ipyparallel.error import CompositeError

import shardlab as sl
from shardlab.ranks import beacon, bringup, warm

pytestmark = pytest.mark.multirank

SKIPS_A_COLLECTIVE = """
import torch
import torch.distributed as dist

if dist.get_rank() != 1:
    dist.all_reduce(torch.ones(1))
"""

BEACONS_ON_THIS_RANK = """
import threading

import torch
import torch.distributed as dist
from IPython import get_ipython

beacon_threads = sum(t.name == "shardlab-beacon" for t in threading.enumerate())
cell_hooks = sum(getattr(f, "__self__", None).__class__.__name__ == "Beacon"
                 for f in get_ipython().events.callbacks["pre_execute"])
"""


def wait_until(condition, timeout_s: float, every_s: float = 0.2):
    """``condition()``'s first true value within ``timeout_s``, else its last."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(every_s)
    return value


def states(panel) -> dict[int, str]:
    return {row["rank"]: row["state"] for row in panel.rows}


def test_the_panel_names_the_rank_the_others_wait_for_and_stops_with_the_cluster(no_leftovers):
    with sl.RankCluster(n=3, device="cpu", timeout_s=12) as cluster:
        panel = cluster.panel()
        assert cluster.panel() is panel and not panel.running  # nothing runs until it is shown
        panel.watch()
        assert wait_until(lambda: set(states(panel).values()) == {"idle"}, 10), panel.rows

        hung = cluster.view.execute(SKIPS_A_COLLECTIVE, block=False)
        said = wait_until(lambda: [s for s in panel.sentences if "for rank(s) [1]" in s], 10)
        assert said and said[0].startswith("rank(s) [0, 2] wait in all_reduce #"), panel.sentences
        assert not hung.ready(), "the cell ended before the panel said anything: the check proved nothing"
        assert states(panel) == {0: "running", 1: "idle", 2: "running"}
        rows = {row["rank"]: row for row in panel.rows}
        assert rows[0]["last collective"].startswith("all_reduce #") and "(in progress)" in rows[0]["last collective"]
        assert float(rows[0]["cell"].removesuffix(" s")) >= 0 and "RSS" in rows[0]["memory"]
        assert "rank(s) [0, 2] wait in all_reduce" in panel.value  # the widget shows what the rows say

        with pytest.raises(CompositeError):
            hung.get(timeout=60)
        assert wait_until(lambda: states(panel) == {0: "failed", 1: "idle", 2: "failed"}, 5), panel.rows

        # A warm rank's reset (what a claimed cluster runs) keeps one beacon and one set of cell hooks per rank.
        cluster.run("%reset -f", 60)
        bringup.initialise_ranks(cluster.view, [0, 1, 2], 12, 60, reset=warm.kernel_environment())
        cluster.run(BEACONS_ON_THIS_RANK + "dist.all_reduce(torch.ones(1))", 60)
        assert cluster.view.pull("beacon_threads") == [1, 1, 1] and cluster.view.pull("cell_hooks") == [1, 1, 1]
        assert wait_until(lambda: set(states(panel).values()) == {"idle"} and not panel.sentences, 5), panel.rows

        folder = panel.folder
        assert (folder / beacon.WATCHED).exists()
    assert not panel.running and not folder.exists() and not cluster.alive_processes()
    assert not [t for t in threading.enumerate() if t.name == "shardlab-rank-panel"]
