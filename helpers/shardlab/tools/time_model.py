"""How long each lesson takes a learner, computed from the notebooks and the measured run times, never typed in.

Per lesson: reading (the words of its text and the lines of its code, at the rates of ``Settings``), running (the
notebook's measured seconds in docs/timings.md, written by ``make timings``), exercises (a fixed time plus a time
per line of each solution, core and stretch apart: the mark is a ``core`` or ``stretch`` tag on the solution cell),
and a margin for questions and the first start. The rates live in one place an instructor edits, INSTRUCTORS.md's
"Time model" table; ``python -m shardlab.tools.agenda`` then lays the agendas out again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

import nbformat

from .handout import SOLUTION_TAG

LEVELS = ("core", "stretch")
MAGIC = re.compile(r"^\s*%")


class TimeModelError(ValueError):
    """A setting, a notebook or a measured time the model cannot use: the message says what to change."""


@dataclass(frozen=True)
class Settings:
    """The model's rates and margins (INSTRUCTORS.md's "Time model" table sets each; these are its defaults)."""

    words_per_minute: float = 120.0
    code_lines_per_minute: float = 12.0
    exercise_min: float = 5.0
    exercise_min_per_line: float = 1.5
    questions_share: float = 0.15
    start_min: float = 5.0
    demo_reading_share: float = 0.25


# The "Time model" table's first column, as an instructor reads it, for each setting.
SETTING_NAMES = {
    "reading, text": "words_per_minute",
    "reading, code": "code_lines_per_minute",
    "exercise, fixed": "exercise_min",
    "exercise, per solution line": "exercise_min_per_line",
    "questions": "questions_share",
    "first start": "start_min",
    "demonstration": "demo_reading_share",
}


def settings_from(text: str) -> Settings:
    """The settings of the "Time model" table in ``text`` (rows ``| reading, text | 120 words a minute | why |``;
    a share as ``15 %``); a setting the table leaves out keeps its default."""
    found = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] in SETTING_NAMES:
            number = re.match(r"(\d+(?:\.\d+)?)\s*(%?)", cells[1])
            if not number:
                raise TimeModelError(f"time model: {cells[0]!r} is {cells[1]!r}: give a number first, e.g. "
                                     f"'{getattr(Settings, SETTING_NAMES[cells[0]])}'")
            value = float(number[1]) / (100 if number[2] else 1)
            found[SETTING_NAMES[cells[0]]] = value
    wrong = [name for name, value in found.items() if value <= 0 and name not in ("questions_share", "start_min")]
    if wrong:
        raise TimeModelError(f"time model: {', '.join(wrong)} must be above 0")
    return Settings(**{f.name: found.get(f.name, f.default) for f in fields(Settings)})


@dataclass(frozen=True)
class Lesson:
    """What a notebook asks of a learner, counted from its cells, and its measured run time."""

    notebook: str
    words: int
    code_lines: int
    exercises: tuple[tuple[str, int], ...]  # (core or stretch, solution lines), in order
    run_s: float

    def reading_min(self, s: Settings) -> float:
        return self.words / s.words_per_minute + self.code_lines / s.code_lines_per_minute

    def exercise_min(self, s: Settings, level: str) -> float:
        return sum(s.exercise_min + s.exercise_min_per_line * lines for kind, lines in self.exercises
                   if kind == level)

    def taught_min(self, s: Settings) -> float:
        """Read, run and the core exercises done by every learner, with the margin for questions and the start."""
        work = self.reading_min(s) + self.run_s / 60 + self.exercise_min(s, "core")
        return work * (1 + s.questions_share) + s.start_min

    def demo_min(self, s: Settings) -> float:
        """Shown by the instructor: the run, and the text talked through at ``demo_reading_share`` of its reading."""
        return (self.reading_min(s) * s.demo_reading_share + self.run_s / 60) * (1 + s.questions_share)


def _solution_lines(source: str) -> int:
    """The lines a learner writes: not blank, not a cell magic, not the docstring the handout keeps."""
    body = re.sub(r'^(\s*def [^\n]*\n)\s*"""(?:.|\n)*?"""\s*\n', r"\1", source, flags=re.MULTILINE)
    return sum(1 for line in body.splitlines() if line.strip() and not MAGIC.match(line))


def read_lesson(path: Path, run_s: float) -> Lesson:
    """Count ``path``'s words, code lines and exercises; every solution cell must be tagged core or stretch."""
    cells = nbformat.read(path, as_version=4).cells
    words = code = 0
    exercises = []
    for i, cell in enumerate(cells):
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "markdown":
            words += len(cell.source.split())
        elif SOLUTION_TAG in tags:
            levels = [t for t in tags if t in LEVELS]
            if len(levels) != 1:
                raise TimeModelError(f"{path.name} cell {i}: a solution cell needs one tag of {LEVELS}, has {tags}: "
                                     "tag it core (every learner does it) or stretch (for those ahead)")
            exercises.append((levels[0], _solution_lines(cell.source)))
        elif cell.cell_type == "code":
            code += sum(1 for line in cell.source.splitlines() if line.strip())
    return Lesson(path.stem, words, code, tuple(exercises), run_s)


NOTEBOOK_ROW = re.compile(r"^\| `(\d\d_\w+)` \| (\d+(?:\.\d+)?) \|$", re.MULTILINE)


def measured_run_s(timings_text: str) -> dict[str, float]:
    """Each notebook's seconds at the default world size, from docs/timings.md's notebook table."""
    found = {m[1]: float(m[2]) for m in NOTEBOOK_ROW.finditer(timings_text)}
    if not found:
        raise TimeModelError("docs/timings.md has no notebook table: run `make test`, then `make timings`")
    return found


def lessons(notebooks: Path, timings_text: str) -> list[Lesson]:
    run = measured_run_s(timings_text)
    paths = sorted(notebooks.glob("[0-9][0-9]_*.ipynb"))
    missing = [p.stem for p in paths if p.stem not in run]
    if missing:
        raise TimeModelError(f"no measured run time for {', '.join(missing)} in docs/timings.md: run `make test`, "
                             "then `make timings`")
    return [read_lesson(p, run[p.stem]) for p in paths]
