"""Who is stuck: the class's exercise checks as one table, ``python -m shardlab.tools.class_view FOLDER [--stuck N]``.

FOLDER is the class folder the learners' checks write to (``SHARDLAB_CLASS_DIR``, ``shardlab.exercises.progress``). One
row per learner: the exercise they checked last, how many exercises they have passed, each exercise they failed
``--stuck`` times (3 by default) or more without passing it since (the learners to visit first), and each exercise
whose reference answer they revealed (``sl.exercises.reveal``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..exercises.progress import read_class
from ..report import Table


def class_rows(records: list[dict], stuck_after: int = 3) -> list[dict]:
    by_learner: dict[str, list[dict]] = {}
    for r in records:
        by_learner.setdefault(r["learner"], []).append(r)
    rows = []
    for who, mine in sorted(by_learner.items()):
        failed_since_pass: dict[str, int] = {}
        passed, revealed = set(), []
        for r in mine:
            key = f"{r.get('notebook') or '?'}: {r['exercise']}"
            if r.get("revealed"):  # asked for the answer: not a try
                revealed.append(key)
            elif r["passed"]:
                passed.add(key)
                failed_since_pass[key] = 0
            else:
                failed_since_pass[key] = failed_since_pass.get(key, 0) + 1
        last = mine[-1]
        stuck = [f"{key} ({n}×)" for key, n in failed_since_pass.items() if n >= stuck_after]
        mark = "revealed" if last.get("revealed") else "✓" if last["passed"] else "✗"
        rows.append({"learner": who, "last check": f"{last.get('notebook') or '?'}: {last['exercise']} {mark}",
                     "minutes ago": round((time.time() - last.get("time", time.time())) / 60),
                     "passed": len(passed), "stuck on": "; ".join(stuck) or "-",
                     "revealed": "; ".join(dict.fromkeys(revealed)) or "-"})  # each once, in order
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.tools.class_view", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the class folder (what SHARDLAB_CLASS_DIR names for learners)")
    parser.add_argument("--stuck", type=int, default=3, help="failures without a pass that make a learner stuck")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"class_view: {args.folder} is not a folder: give the folder SHARDLAB_CLASS_DIR names for the "
              "learners' kernels (INSTRUCTORS.md, 'Who is stuck')", file=sys.stderr)
        return 2
    rows = class_rows(read_class(args.folder), args.stuck)
    if not rows:
        print(f"no check recorded in {args.folder} yet")
        return 0
    print(Table(rows, ["learner", "last check", "minutes ago", "passed", "stuck on", "revealed"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
