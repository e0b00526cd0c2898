"""The workshop agendas in INSTRUCTORS.md come from the time model (``shardlab.tools.time_model``): each lesson's
minutes computed from its notebook and its measured run time, laid out by ``python -m shardlab.tools.agenda``,
never typed by hand. Every exercise is marked core or stretch."""

import sys
from pathlib import Path

import nbformat
import pytest

from shardlab.tools import agenda, time_model
from shardlab.tools.time_model import Settings, TimeModelError

ROOT = Path(__file__).resolve().parents[2]
INSTRUCTORS = ROOT / "INSTRUCTORS.md"
TIMINGS = "| notebook test | seconds |\n|---|---|\n| `01_one` | 60.0 |\n| `02_two` | 120.0 |\n| `03_three` | 30.0 |\n"


def write_notebook(path: Path, words: int, code_lines: int, solutions: list[tuple[str, int]]) -> Path:
    cells = [nbformat.v4.new_markdown_cell(" ".join(["word"] * words)),
             nbformat.v4.new_code_cell("\n".join(f"x{i} = {i}" for i in range(code_lines)))]
    for level, lines in solutions:
        body = "\n".join(f"    y{i} = {i}" for i in range(lines - 1))
        source = f'%%px\ndef answer(a):\n    """What the learner writes: kept by the handout, not counted."""\n{body}\n'
        cells.append(nbformat.v4.new_code_cell(source, metadata={"tags": ["solution", level]}))
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


@pytest.fixture
def notebooks(tmp_path):
    write_notebook(tmp_path / "01_one.ipynb", 240, 40, [("core", 4), ("stretch", 10)])
    write_notebook(tmp_path / "02_two.ipynb", 1200, 0, [("core", 2)])
    write_notebook(tmp_path / "03_three.ipynb", 120, 20, [])
    return tmp_path


def test_the_agenda_in_instructors_md_is_the_time_models():
    assert agenda.main([str(INSTRUCTORS), "--check"]) == 0, (
        f"run `{sys.executable} -m shardlab.tools.agenda INSTRUCTORS.md` after changing a notebook, the time model "
        "or the formats, and after `make timings`")


def test_every_exercise_of_the_series_is_marked_core_or_stretch_and_its_text_says_which():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        lesson = time_model.read_lesson(path, 0.0)  # raises on a solution cell without exactly one of the two tags
        cells = nbformat.read(path, as_version=4).cells
        solutions = [i for i, c in enumerate(cells) if "solution" in c.metadata.get("tags", [])]
        for (level, _), i in zip(lesson.exercises, solutions):
            prompt = next(cells[j].source for j in range(i - 1, -1, -1) if cells[j].cell_type == "markdown")
            assert f"*{level.capitalize()}:" in prompt, f"{path.name} cell {i}: its text does not say it is {level}"


def test_a_lessons_minutes_are_its_words_code_exercises_and_measured_run(notebooks):
    s = Settings(words_per_minute=120, code_lines_per_minute=20, exercise_min=5, exercise_min_per_line=1.5,
                 questions_share=0.1, start_min=5, demo_reading_share=0.5)
    one = time_model.read_lesson(notebooks / "01_one.ipynb", 60.0)
    assert (one.words, one.code_lines, one.exercises) == (240, 40, (("core", 4), ("stretch", 10)))
    assert one.reading_min(s) == pytest.approx(240 / 120 + 40 / 20)
    assert one.exercise_min(s, "core") == pytest.approx(5 + 1.5 * 4)
    assert one.exercise_min(s, "stretch") == pytest.approx(5 + 1.5 * 10)
    assert one.taught_min(s) == pytest.approx((4 + 1 + 11) * 1.1 + 5)  # stretch is not in it
    assert one.demo_min(s) == pytest.approx((4 * 0.5 + 1) * 1.1)


def test_an_unmarked_exercise_is_refused_with_what_to_do(tmp_path):
    path = write_notebook(tmp_path / "01_one.ipynb", 10, 1, [("core", 2)])
    notebook = nbformat.read(path, as_version=4)
    notebook.cells[-1].metadata["tags"] = ["solution"]
    nbformat.write(notebook, path)
    with pytest.raises(TimeModelError, match="cell 2: a solution cell needs one tag of .*tag it core"):
        time_model.read_lesson(path, 1.0)


def test_settings_come_from_the_table_and_bad_ones_say_what_to_change():
    s = time_model.settings_from("| reading, text | 200 words a minute | x |\n| questions | 20 % | y |\n")
    assert s.words_per_minute == 200 and s.questions_share == pytest.approx(0.2)
    assert s.exercise_min == Settings().exercise_min  # not in the table: the default
    with pytest.raises(TimeModelError, match="give a number first"):
        time_model.settings_from("| reading, text | fast | x |\n")
    with pytest.raises(TimeModelError, match="above 0"):
        time_model.settings_from("| reading, code | 0 lines a minute | x |\n")


def test_a_missing_measured_time_says_to_measure(notebooks):
    with pytest.raises(TimeModelError, match="no measured run time for 03_three.*make timings"):
        time_model.lessons(notebooks, TIMINGS.replace("| `03_three` | 30.0 |\n", ""))


FORMATS = """| format | hours | taught | demonstrated |
|---|---|---|---|
| half day | 09:00–12:30 | 01 | 02 |
"""


def test_a_day_has_an_introduction_breaks_a_buffer_and_a_wrap_up_without_gaps(notebooks):
    s = Settings()
    by_number = {ln.notebook[:2]: ln for ln in time_model.lessons(notebooks, TIMINGS)}
    fmt = agenda.formats(FORMATS)[0]
    slots = agenda.day(fmt, by_number, s)
    assert [x["what"] for x in slots][0] == "introduction" and [x["what"] for x in slots][-2:] == ["buffer", "wrap-up"]
    assert all(a["end"] == b["start"] for a, b in zip(slots, slots[1:]))
    work = 0
    for slot in slots:
        work = 0 if slot["what"] in ("break", "lunch") else work + slot["minutes"]
        assert work <= agenda.SESSION_MAX_MIN + agenda.OVERRUN_MIN + sum(agenda.FIXED.values())
    taught = sum(x["minutes"] for x in slots if x["how"] == "taught")
    assert taught == agenda._five(by_number["01"].taught_min(s))
    assert {x["how"] for x in slots if x["what"] == "02_two"} == {"demonstrated"}


def test_a_format_that_does_not_fit_is_refused_with_the_overrun_and_a_saving(notebooks):
    by_number = {ln.notebook[:2]: ln for ln in time_model.lessons(notebooks, TIMINGS)}
    tight = agenda.formats(FORMATS.replace("09:00–12:30", "09:00–09:30"))[0]
    with pytest.raises(TimeModelError, match=r"half day: the lessons need until \d\d:\d\d, \d+ min past 09:30; "
                                             r"demonstrating 01_one instead of teaching it saves about"):
        agenda.day(tight, by_number, Settings())
    with pytest.raises(TimeModelError, match="both taught and demonstrated"):
        agenda.formats(FORMATS.replace("| 01 | 02 |", "| 01 | 01 |"))
    with pytest.raises(TimeModelError, match="no lesson 07"):
        agenda.day(agenda.formats(FORMATS.replace("| 01 | 02 |", "| 07 | 02 |"))[0], by_number, Settings())


def test_the_generated_text_holds_every_lesson_and_what_is_left_for_later(notebooks):
    text = f"# Guide\n{FORMATS}\n{agenda.BEGIN}\nstale\n{agenda.END}\n"
    new = agenda.rewrite(text, notebooks, TIMINGS)
    assert "stale" not in new and all(f"`{n}`" in new for n in ("01_one", "02_two", "03_three"))
    assert "Left for later (self-study, with the stretch exercises and the problems): `03_three`." in new
    assert "`01_one`, taught" in new and "`02_two`, demonstrated" in new
