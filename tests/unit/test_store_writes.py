"""Every rank writes the same field store at once (notebook 12 does, in a %%px cell): each writer ends with the one
complete store, none fails, and nothing half-written or temporary is left, round after round. Processes, and threads
inside them (two writers with one process id), all released together by one barrier."""

import multiprocessing
import os
import threading
import traceback
from pathlib import Path

import numpy as np
import pytest

from shardlab import data

PROCESSES, THREADS, ROUNDS = 3, 2, 50
SHAPE = {"samples": 1, "height": 12, "width": 8, "chunk_rows": 4}  # a store of 4 KiB: written in milliseconds
OTHER = SHAPE | {"height": 16}


def _write_rounds(root: str, barrier, errors: str) -> None:
    """One process: THREADS writers, each writing every round's store the moment the barrier lets them go; each
    failure goes to a file of the writer's own in ``errors``."""

    def writer(name):
        for round_ in range(ROUNDS):
            try:
                barrier.wait(timeout=60)
                data.write_field_store(Path(root) / f"round-{round_}.zarr", **SHAPE, seed=round_)
            except Exception:  # every failure is the test's business, reported whole
                with open(Path(errors) / name, "a") as out:
                    out.write(f"round {round_}: {traceback.format_exc(limit=4)}\x00")

    threads = [threading.Thread(target=writer, args=(f"{os.getpid()}-{i}",)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork: a second "
                    "interpreter per writer would take longer to start than the rounds to run")
def test_many_processes_writing_the_same_store_at_once_all_end_with_it(tmp_path_factory):
    tmp_path, errors = tmp_path_factory.mktemp("stores"), tmp_path_factory.mktemp("errors")
    for round_ in range(0, ROUNDS, 2):  # every other round replaces a store of other parameters
        data.write_field_store(tmp_path / f"round-{round_}.zarr", **OTHER, seed=round_)
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(PROCESSES * THREADS)
    processes = [context.Process(target=_write_rounds, args=(str(tmp_path), barrier, str(errors)))
                 for _ in range(PROCESSES)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    alive = [p.pid for p in processes if p.is_alive()]
    for process in processes:
        process.kill() if process.is_alive() else None
    failures = [f for path in errors.iterdir() for f in path.read_text().split("\x00") if f]
    assert not alive, f"writer processes {alive} did not finish within 300 s"
    assert not failures, f"{len(failures)} of {PROCESSES * THREADS * ROUNDS} writes failed; the first:\n{failures[0]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"round-{r}.zarr" for r in range(ROUNDS))
    for round_ in range(ROUNDS):
        store = data.open_store(tmp_path / f"round-{round_}.zarr")
        assert store.params["height"] == SHAPE["height"]
        expected = data.writer._permeability_rows([round_, 0], 0, SHAPE["height"], SHAPE["height"], SHAPE["width"])
        assert np.array_equal(store.field("permeability")[0, 0], expected)
