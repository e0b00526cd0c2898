"""What an engine's memory is made of (scripts/learner_memory.py --imports, the breakdown on INSTRUCTORS.md's
operations page): each step of an engine's start, measured in a fresh interpreter, with whose code it is."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("learner_memory", ROOT / "scripts" / "learner_memory.py")
learner_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(learner_memory)


@pytest.mark.multirank  # initialises DistributedManager on one rank
def test_what_is_ours_in_an_engine_is_a_few_mib_of_what_it_holds():
    rows = learner_memory.engine_start_steps()
    assert [(r["step"], r["whose"]) for r in rows] == [(what, whose) for what, whose, _ in learner_memory.ENGINE_START]
    mib = {r["step"]: r["mib"] for r in rows}
    total = sum(mib.values())
    assert mib["torch"] > 100, mib  # the measurement sees what an import adds
    ours = sum(r["mib"] for r in rows if r["whose"].startswith("ours"))
    # matplotlib and pyplot alone would add more than this: an engine imports nothing of ours it does not use
    assert ours < 0.03 * total, f"ours: {ours:.1f} MiB of {total:.0f} MiB: {mib}"
