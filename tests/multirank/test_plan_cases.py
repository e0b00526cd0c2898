"""The planner for any model against a measurement that shares no code with it, on 2 and 4 CPU ranks.

For every model of docs/models.md that runs at that rank count (a parity row with an output error), ``sl.plan.Planner
(case, size)`` is calibrated on the ranks (one job for all of them: ``plan.cases.prepare``) and asked for the step's
peak at a size it never measured (twice the larger of its two); ``scripts/plan_cases.py`` measures that step on the
ranks with its own code (the parity harness's layout, its own step, torch.profiler's ``[memory]`` events). The
largest rank's planned peak is within 10 % of the measured one. Ratios are printed (``-s``). CPU ranks: no GPU figure.
"""

import importlib.util
import re
from pathlib import Path

import pytest

from shardlab import model_cases
from shardlab.plan.cases import prepare

ROOT = Path(__file__).resolve().parents[2]
RUN_ON_CPU = {"Transolver", "GeoTransolver", "FNO", "U-Net (sl.models.unet)"}  # parity at 2 and 4 CPU ranks here


def _script():
    spec = importlib.util.spec_from_file_location("plan_cases", ROOT / "scripts" / "plan_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runnable(ranks: int) -> list:
    """The cases whose docs/models.md row at ``ranks`` CPU ranks has a parity result (the model ran), and those known to
    run on CPU ranks (``RUN_ON_CPU``) whatever the last table says."""
    ran = set()
    for line in (ROOT / "docs" / "models.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) > 3 and cells[1] == f"{ranks} (cpu)" and re.search(r"output \d", cells[3]):
            ran.add(cells[0])
    return [case for case in model_cases.CASES if case.name in ran | RUN_ON_CPU]


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 4])
def test_planned_peak_within_10_percent_of_a_step_measured_at_a_size_never_measured(ranks, no_leftovers):
    cases = runnable(ranks)
    prepare(cases, ranks)  # one calibration job for every case; each Planner(case, ...) reuses it
    rows = _script().ratios(cases, ranks)
    for row in rows:
        print(f"{ranks} ranks, {row['model']}: planned {row.get('predicted')} / measured {row.get('measured')} at "
              f"{row['size']} (calibrated at {row.get('measured at')}, {row.get('method')}): {row.get('ratio', 0):.3f}")
    assert len(rows) == len(cases) and all("error" not in row for row in rows), rows
    for row in rows:
        assert row["size"] > max(row["measured at"]), row  # a size the planner did not measure
        assert abs(row["ratio"] - 1) <= 0.10, row
