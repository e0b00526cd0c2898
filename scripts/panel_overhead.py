"""What the rank panel costs a training loop: ``python scripts/panel_overhead.py [--ranks 4] [--repeats 5]``.

The same loop of steps (a matmul, a gradient-sized all_reduce, a few small ones: the collectives keep the Flight
Recorder busy) is timed on every rank of one cluster under three conditions, taken in turn so that a machine that
gets busier or quieter during the run affects each alike:

- ``no beacon``: every rank's beacon thread stopped, as if the panel did not exist;
- ``hidden``: the beacon running, nobody watching (what every notebook pays);
- ``shown``: the panel shown, ranks writing their state and this kernel's thread reading it.

Prints each condition's median seconds per step and its ratio to ``no beacon``.
"""

import argparse
import statistics
import sys
import time

import shardlab as sl

SETUP = """
import time

import torch
import torch.distributed as dist

from shardlab.ranks import beacon, launch

device = launch.default_device()
a = torch.randn(384, 384, device=device)
gradient = torch.zeros(2**20, device=device)
small = torch.zeros(16, device=device)


def step():
    (a @ a).sum().item()
    dist.all_reduce(gradient)
    for _ in range(4):
        dist.all_reduce(small)


def timed(steps):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return time.perf_counter() - t0
"""


def seconds_per_step(cluster, steps: int) -> float:
    cluster.run(f"elapsed = timed({steps})", timeout_s=600, what="finish the timed steps")
    return max(cluster.view.pull("elapsed")) / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=6.0, help="how long one timed loop runs")
    args = parser.parse_args(argv)
    cluster = sl.start_cluster(n=args.ranks, activate=False, keep_warm=False)
    try:
        cluster.run(SETUP)
        seconds_per_step(cluster, 5)  # warm-up: first collectives, allocator
        steps = max(5, round(args.seconds / seconds_per_step(cluster, 20)))
        panel = cluster.panel()
        conditions = {
            "no beacon": lambda: (panel.stop(), cluster.run("beacon._BEACON.stop()")),
            "hidden": lambda: (panel.stop(), cluster.run("beacon.start(beacon._BEACON.folder, dist.get_rank(), "
                                                         "beacon._BEACON.device)")),
            "shown": panel.watch,
        }
        times = {name: [] for name in conditions}
        for repeat in range(args.repeats):
            for name, set_up in conditions.items():
                set_up()
                time.sleep(1.5)  # the beacons notice the marker (or its absence) within a second
                times[name].append(seconds_per_step(cluster, steps))
            print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
                f"{name} {t[-1] * 1e3:.1f} ms/step" for name, t in times.items()), flush=True)
        panel.stop()
        cluster.run("from shardlab import flight\nheld = len(flight.entered())")
        held = cluster.view.pull("held")
    finally:
        cluster.stop()
    base = statistics.median(times["no beacon"])
    print(f"\n{args.ranks} {cluster.device.upper()} ranks, {steps} steps per loop, {args.repeats} loops each, "
          f"Flight Recorder entries per rank at the end: {held}")
    for name, t in times.items():
        median = statistics.median(t)
        print(f"{name:>10}: {median * 1e3:7.2f} ms/step (median; min {min(t) * 1e3:.2f}, max {max(t) * 1e3:.2f})"
              f"  ratio to no beacon {median / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
