"""The instructors' notes (``instructors/``): one per lesson, their common mistakes generated from the wrong answers
kept with the solution cells, every end-of-chapter problem answered under its quoted text, and none of it in the
learners' handout (``make handout``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from shardlab.tools import instructor_notes as notes
from shardlab.tools.instructor_notes import NotesError

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "instructors"
MARKER = "instructors only"


def test_the_committed_notes_follow_the_notebooks():
    assert notes.main([str(FOLDER), "--check"]) == 0, (
        f"run `{sys.executable} -m shardlab.tools.instructor_notes instructors` after changing a notebook's exercises, "
        "wrong answers, hints or problems, then answer any new problem in instructors/answers.md")


def test_every_lesson_has_a_note_and_no_problem_of_the_series_escapes_the_reader():
    books = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert {p.stem for p in books} == {p.stem for p in FOLDER.glob("[0-9][0-9]_*.md")}
    for path in books:
        cells = nbformat.read(path, as_version=4).cells
        asks = [c for c in cells if c.cell_type == "markdown" and re.search(
            r"^## Problems|\*\*Problems\.\*\*|\(Discussion\)|To think about:|for discussion", c.source, re.M)]
        assert bool(asks) == bool(notes.problems(path)), f"{path.name}: problems asked, none read, or the reverse"
    answers = (FOLDER / notes.ANSWERS).read_text()
    assert len(re.findall(r"^### \d\d\.\d+$", answers, re.M)) == sum(len(notes.problems(p)) for p in books) >= 30


def write_notebook(path: Path) -> Path:
    cells = [
        nbformat.v4.new_markdown_cell("## Exercises\n\nThese are for discussion.\n\n1. Why one?\n   Say why.\n"
                                      "2. And two?\n\nMore text."),
        nbformat.v4.new_markdown_cell("**1.** Write `double(x)`.\n\n*Core: every learner does this one.*"),
        nbformat.v4.new_code_cell("%%px\ndef double(x):\n    return 2 * x",
                                  metadata={"tags": ["solution", "core"], "shardlab": {"wrong_answers": [
                                      {"source": "def double(x):\n    return x", "why": "the input, not doubled"},
                                      {"source": "def double(x):\n    return 4", "why": "a constant typed for x = 2"},
                                      {"source": "def double(x):\n    return twice(x)",
                                       "why": "calls the library it rebuilds: twice"}]}}),
        nbformat.v4.new_code_cell('sl.exercises.judged(judge, double, what="double",\n'
                                  '                hint="Twice " "the input.")'),
        nbformat.v4.new_markdown_cell("**2.** (Discussion) Is 2x the same as x + x?"),
        nbformat.v4.new_markdown_cell("## Problems\n\n1. **First.** One\n   line more.\n2. Second.\n\nDone."),
        nbformat.v4.new_markdown_cell("**Problems.** (1) Left or\nright? (2) Up or down?\n\nDone: stop the ranks."),
    ]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


def test_the_mistakes_come_from_the_rehearsed_wrong_answers_split_by_kind(tmp_path):
    path = write_notebook(tmp_path / "01_one.ipynb")
    (ex,) = notes.exercises(path)
    assert (ex.number, ex.level, ex.names, ex.hint) == ("1", "core", ("double",), "Twice the input.")
    assert ex.mistakes == ("the input, not doubled",)
    assert ex.shortcuts == ("a constant typed for x = 2", "calls the library it rebuilds: twice")
    block = notes.mistakes_block(path)
    assert block.startswith(notes.BEGIN) and block.endswith(notes.END)
    assert block.index("the input, not doubled") < block.index("Shortcuts") < block.index("a constant typed")


def test_problems_are_read_in_each_form_the_notebooks_write_them(tmp_path):
    found = notes.problems(write_notebook(tmp_path / "01_one.ipynb"))
    assert found == [("1", "Why one? Say why."), ("2", "And two?"), ("2", "Is 2x the same as x + x?"),
                     ("1", "**First.** One line more."), ("2", "Second."), ("1", "Left or right?"),
                     ("2", "Up or down?")]


def note_text(body="- a point\n") -> str:
    return (f"# One\n\n## Key points\n{body}\n## Common mistakes\n\n{notes.BEGIN}\nstale\n{notes.END}\n\n"
            "## Where to cut\n- cut this\n\n## On a GPU\n- nothing\n")


def test_a_note_gets_its_mistakes_made_again_and_is_refused_without_a_section(tmp_path):
    path = write_notebook(tmp_path / "01_one.ipynb")
    new = notes.rewrite_note(note_text(), path)
    assert "stale" not in new and "the input, not doubled" in new and "- cut this" in new
    with pytest.raises(NotesError, match="## Where to cut section"):
        notes.rewrite_note(note_text().replace("## Where to cut", "## Cuts"), path)
    with pytest.raises(NotesError, match="Key points is empty"):
        notes.rewrite_note(note_text(body=""), path)
    with pytest.raises(NotesError, match="mistakes markers"):
        notes.rewrite_note(note_text().replace(notes.END, ""), path)


def test_answers_quote_each_problem_and_refuse_a_missing_an_empty_or_an_unknown_one(tmp_path):
    path = write_notebook(tmp_path / "01_one.ipynb")
    keys = ["01.1", "01.2"]  # numbers repeat across forms here: the last of each number wins the quote
    text = "# Answers\n\n## 01_one\n\n" + "".join(f"### {k}\n\n> old text\n\nThe answer to {k}.\n\n" for k in keys)
    new = notes.rewrite_answers(text, [path])
    assert "old text" not in new and "> Up or down?" in new and "The answer to 01.2." in new
    assert notes.rewrite_answers(new, [path]) == new
    with pytest.raises(NotesError, match="no answer to problem"):
        notes.rewrite_answers(text.split("### 01.2")[0], [path])
    with pytest.raises(NotesError, match="### 01.2 has no answer"):
        notes.rewrite_answers(text.replace("The answer to 01.2.", ""), [path])
    with pytest.raises(NotesError, match="### 01.9 answers no problem"):
        notes.rewrite_answers(text + "### 01.9\n\nExtra.\n", [path])


def test_check_fails_on_a_stale_note_and_the_command_rewrites_it(tmp_path):
    (tmp_path / "notebooks").mkdir()
    write_notebook(tmp_path / "notebooks" / "01_one.ipynb")
    folder = tmp_path / "instructors"
    folder.mkdir()
    (folder / "01_one.md").write_text(note_text())
    (folder / notes.ANSWERS).write_text("## 01_one\n\n### 01.1\n\nOne.\n\n### 01.2\n\nTwo.\n")
    assert notes.main([str(folder), "--check"]) == 1
    assert notes.main([str(folder)]) == 0
    assert notes.main([str(folder), "--check"]) == 0
    (folder / "01_one.md").unlink()
    assert notes.main([str(folder), "--check"]) == 2


def anchors(page: Path) -> set[str]:
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}


@pytest.mark.parametrize("page", sorted(FOLDER.glob("*.md")), ids=lambda p: p.name)
def test_every_link_of_the_notes_resolves_and_each_says_it_is_for_instructors(page):
    text = page.read_text()
    assert text.startswith(f"<!-- {MARKER}"), f"{page.name}: its first line says it is for instructors only"
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)):
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.name} links to {target}: there is no {file}"
        assert not anchor or anchor in anchors(linked), f"{page.name} links to {target}: no such heading"


# -- the handout: nothing of instructors/ reaches learners --------------------------------------------------------


def hand_written_lines() -> set[str]:
    """Lines of instructors/ that no notebook holds: not the quoted problems, not the generated mistakes block (its
    hints are in the check cells), not headings."""
    lines = set()
    for page in FOLDER.glob("*.md"):
        text = re.sub(re.escape(notes.BEGIN) + ".*?" + re.escape(notes.END), "", page.read_text(), flags=re.S)
        lines |= {line.strip() for line in text.splitlines()
                  if len(line.strip()) >= 40 and not line.startswith((">", "#", "<!--"))}
    return lines


def leaks(folder: Path) -> list[str]:
    """What of instructors/ a handed-out folder holds: its files, its marker, or any of its hand-written lines."""
    lines, found = hand_written_lines(), []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        where = path.relative_to(folder)
        if "instructors" in where.parts or path.name == notes.ANSWERS:
            found.append(f"{where}: a file of instructors/")
        if path.suffix == ".ipynb":
            text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
        else:
            text = path.read_text(errors="replace")
        if MARKER in text:
            found.append(f"{where}: the instructors-only marker")
        found += [f"{where}: {line[:60]}" for line in lines if line in text]
    return found


def handout_commands(out: Path) -> list[str]:
    """The commands `make handout` runs, with its output in ``out`` (the environment taken as installed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "VIRTUAL_ENV")}
    venv = Path(sys.prefix)
    made = subprocess.run(["make", "-n", "--no-print-directory", "-o", f"{venv}/.installed", "handout",
                           f"VENV={venv}", f"HANDOUT_DIR={out}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    return [line for line in made.stdout.splitlines() if line.strip()]


def test_make_handout_hands_out_nothing_of_the_instructors_folder(tmp_path):
    out = tmp_path / "handout"
    commands = handout_commands(out)
    assert any("shardlab.tools.handout" in c for c in commands), commands
    for command in commands:
        run = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (command, run.stderr[-2000:])
    assert sorted(p.name for p in out.glob("*.ipynb")) == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert leaks(out) == []


def test_the_leak_check_finds_a_copied_answers_file_and_a_pasted_answer(tmp_path):
    assert len(hand_written_lines()) > 100
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text((FOLDER / "07_capstone.md").read_text())
    assert any("the instructors-only marker" in leak for leak in leaks(tmp_path))
    pasted = sorted(line for line in hand_written_lines() if "GradReducer" in line)[0]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"Hint: {pasted}")])
    nbformat.write(notebook, tmp_path / "01_one.ipynb")
    (tmp_path / "docs" / "notes.md").unlink()
    assert leaks(tmp_path) == [f"01_one.ipynb: {pasted[:60]}"]
