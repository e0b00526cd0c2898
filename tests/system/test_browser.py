"""The series in the UI learners use: JupyterLab from `make lab`, headless Chromium, Run -> Run All Cells.

tests/notebooks/test_notebooks.py proves the notebooks' code; this proves that in the browser the `shardlab` kernel
starts from the notebook's metadata, a cluster starts and its `%%px` cells finish, tables render as HTML and figures as
images. Notebook 09 also has its planner's widgets worked: changing the domain size re-plans, and the verdict in the
widget's output turns from "does not fit" to "fits". Notebooks 10, 11 and 12 are run whole as well: their figures are
drawn in the kernel from what the ranks measured, and their checks call back into the ranks.

As a learner goes through the series: one JupyterLab (under `make lab`'s pool of warm ranks) and one browser, the
notebooks one after the other, each in a tab and a kernel of its own. The JupyterLab and Chromium starts are paid
once, and 10, 11 and 12 attach to the two ranks 09 left (the test asserts it). A failure in one notebook does not hide
the others: each is run, and the test reports every notebook that failed.
"""

import contextlib
import re
import shutil
from pathlib import Path

import psutil
import pytest
from playwright.sync_api import expect, sync_playwright

from browser_support import CHROMIUM_ARGS, chromium_environment, find_chromium, lab_server
from shardlab.ranks import owned

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
ARTIFACTS = REPO / "test-artifacts"
KERNEL, KERNEL_DISPLAY = "shardlab", "Python (shardlab: PhysicsNeMo distributed)"
RUN_TIMEOUT_MS = 6 * 60_000  # the notebook starts ranks and measures them; the browser adds the UI's own work

# Done = kernel idle and nothing queued ([*]) after at least one cell ran. Run All queues every cell at once and,
# on an error, clears the queue, so this also ends the wait early when a cell fails.
RUN_FINISHED = """() => {
  const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent.trim());
  const status = document.querySelector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator')?.dataset.status;
  return status === 'idle' && !prompts.includes('[*]:') && prompts.some(p => /^\\[\\d+\\]:$/.test(p));
}"""


@contextlib.contextmanager
def lab_with_browser(folder: Path, monkeypatch):
    """A JupyterLab serving ``folder`` and a headless Chromium: yields (base URL, token, api, browser)."""
    with sync_playwright() as pw:
        chromium = find_chromium(pw)
    monkeypatch.setenv("SHARDLAB_RANKS", "2")  # the kernels' clusters: two ranks are enough in the browser
    ARTIFACTS.mkdir(exist_ok=True)
    with lab_server(folder, ARTIFACTS / "lab.server.log") as (base, token, api), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
                                     env=chromium_environment(folder))
        try:
            yield base, token, api, browser
        finally:
            browser.close()


@contextlib.contextmanager
def notebook_in_lab(lab, notebook: str, artifact: str, while_running=None):
    """A copy of ``notebook`` open in a new tab, every cell run (Run All), none failed: yields the page. On the way
    out the tab closes and the notebook's kernel is stopped (its cluster was stopped by its last cell); if the body
    fails, a screenshot of what the UI showed goes to test-artifacts/ for CI. ``while_running(page)``: what to look
    at while the cells run."""
    base, token, api, browser = lab
    for old in ARTIFACTS.glob(f"{artifact}*"):
        old.unlink()
    page = browser.new_page(viewport={"width": 1600, "height": 1200})
    try:
        # A workspace of its own: the tab shows this notebook only, not the ones the workspace had open before.
        page.goto(f"{base}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?token={token}")
        ready = page.locator(".jp-Dialog").or_(page.get_by_text(f"{KERNEL_DISPLAY} | Idle"))
        expect(ready.first).to_be_visible(timeout=120_000)
        if page.locator(".jp-Dialog").is_visible():
            page.locator(".jp-Dialog select").select_option(label=KERNEL_DISPLAY)
            page.locator(".jp-Dialog").get_by_role("button", name="Select").click()
        expect(page.get_by_text(f"{KERNEL_DISPLAY} | Idle")).to_be_visible(timeout=120_000)

        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        if while_running is not None:
            while_running(page)
        page.wait_for_function(RUN_FINISHED, timeout=RUN_TIMEOUT_MS, polling=1000)
        stderr = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
        tracebacks = [t for t in stderr.all_inner_texts() if "Traceback" in t or "CompositeError" in t]
        assert not tracebacks, "a cell failed in the browser:\n" + "\n---\n".join(tracebacks)[-4000:]
        prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()
        unrun = [i for i, p in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", p.strip())]
        assert not unrun, f"code cells {unrun} (0-based, code cells only) have no execution count: {prompts}"
        expect(page.locator(".jp-OutputArea-output table").first).to_be_attached()  # sl.Table renders as HTML
        yield page
    except Exception:
        with contextlib.suppress(Exception):
            page.screenshot(path=ARTIFACTS / f"{artifact}.failure.png")
        raise
    finally:
        page.close()
        sessions = [s for s in api("/api/sessions") if s["path"].endswith(notebook)]
        for session in sessions:  # stops the notebook's kernel (its cluster was stopped, parked, by the last cell)
            api(f"/api/kernels/{session['kernel']['id']}", "DELETE")
    assert [s["kernel"]["name"] for s in sessions] == [KERNEL], sessions


def work_the_planners_widget(page) -> None:
    # The widget's own output area (not the cell below it, which calls the same function directly).
    verdict = page.locator(".widget-output").filter(has_text="GPU(s):")
    expect(verdict).to_have_count(1, timeout=60_000)
    verdict.scroll_into_view_if_needed()
    expect(verdict).to_contain_text("1 GPU(s): does not fit: smallest domain size that fits is 3")

    domain = page.locator(".widget-dropdown").filter(has_text="domain").locator("select")
    domain.select_option(label="3")
    expect(verdict).to_contain_text(re.compile(r"3 GPU\(s\): fits with \d+\.\d GiB left"), timeout=120_000)
    expect(verdict.locator("img")).to_have_count(1)  # the figure was redrawn with the verdict
    verdict.evaluate("o => o.scrollIntoView({block: 'center'})")


def figures_and_a_passed_check(page) -> None:
    figures = page.locator(".jp-OutputArea-output img")
    assert figures.count() > 0, "no figure was drawn"
    passed = page.locator(".jp-OutputArea-output").filter(has_text=re.compile(r"^✓ ", re.M))
    assert passed.count() > 0, "no exercise check printed its ✓"
    figures.last.scroll_into_view_if_needed()


def the_written_run_and_a_passed_check(page) -> None:
    """Lesson 15 draws no figure: the port's steps, the written run's parity on the ranks, and the check's ✓."""
    outputs = page.locator(".jp-OutputArea-output")
    for said in ("[5/5] write", "test_parity.parity_at(", "step 3: loss"):
        assert outputs.filter(has_text=said).count() > 0, f"no output says {said!r}"
    passed = outputs.filter(has_text=re.compile(r"^✓ ", re.M))
    assert passed.count() > 0, "no exercise check printed its ✓"
    passed.last.scroll_into_view_if_needed()


# What to look at in each notebook once it ran, and the screenshot that shows it.
IN_THE_BROWSER = {"09_memory_planner.ipynb": (work_the_planners_widget, "lab_planner"),
                  "10_beyond_halos.ipynb": (figures_and_a_passed_check, "lab_10_beyond_halos"),
                  "11_memory_levers.ipynb": (figures_and_a_passed_check, "lab_11_memory_levers"),
                  "12_data_at_scale.ipynb": (figures_and_a_passed_check, "lab_12_data_at_scale"),
                  "13_physicsnemo_models.ipynb": (figures_and_a_passed_check, "lab_13_physicsnemo_models"),
                  # before 14, which restarts its ranks: 15 runs on the engines 09 started, as 10 to 13 do
                  "15_port_your_model.ipynb": (the_written_run_and_a_passed_check, "lab_15_port_your_model"),
                  "14_see_every_rank.ipynb": (figures_and_a_passed_check, "lab_14_see_every_rank")}
RESTART_THEIR_RANKS = {"14_see_every_rank.ipynb"}  # the last notebook here: the ones after it would run on its ranks


def parked_engines() -> set[int]:
    """The PIDs of this test's live engine processes (the engines, their nannies and launcher): once a notebook's
    last cell stopped its cluster, the ones waiting in the pool for the next notebook."""
    alive = set()
    for proc in owned.leftover_processes():
        with contextlib.suppress(psutil.Error):
            if "ipyparallel.engine" in " ".join(proc.cmdline()):
                alive.add(proc.pid)
    return alive


@pytest.mark.browser
@pytest.mark.timeout(1800)  # `make test-system` may install chromium with apt-get first
def test_notebooks_run_in_jupyterlab_one_after_the_other_and_09s_widget_replans(tmp_path, monkeypatch,
                                                                                  no_leftovers):
    for notebook in IN_THE_BROWSER:  # outputs land in the copies; the committed notebooks stay clean
        shutil.copy(REPO / "notebooks" / notebook, tmp_path)
    failed, engines = {}, []
    with lab_with_browser(tmp_path, monkeypatch) as lab:
        for notebook, (look, artifact) in IN_THE_BROWSER.items():
            screenshot = ARTIFACTS / f"{artifact}.png"
            try:
                with notebook_in_lab(lab, notebook, artifact) as page:
                    look(page)
                    page.screenshot(path=screenshot)
                assert screenshot.stat().st_size > 20_000, f"{screenshot} is suspiciously small"
            except Exception as error:  # the next notebook still runs; every failure is reported below
                failed[notebook] = f"{type(error).__name__}: {error}"[-3000:]
            engines.append(parked_engines())
    assert not failed, "\n\n".join(f"{notebook}: {why}" for notebook, why in failed.items())
    # One start for them all: 10 to 13 and 15 ran on the two engines 09 started, which waited between the notebooks. 14
    # restarts its ranks after its hang, on purpose (a process group that timed out is broken for good): its fresh
    # engines are the ones parked after it.
    before = [parked for notebook, parked in zip(IN_THE_BROWSER, engines) if notebook not in RESTART_THEIR_RANKS]
    assert len(engines[0]) >= 2 and all(parked == engines[0] for parked in before), engines
    assert all(len(parked) >= 2 and parked != engines[0] for notebook, parked in zip(IN_THE_BROWSER, engines)
               if notebook in RESTART_THEIR_RANKS), engines


def rank_panel_seconds(panel, rank: int) -> float:
    """The seconds in the cell that the rank panel shows for ``rank``."""
    cell = panel.locator("tr").nth(rank + 1).locator("td").nth(2)
    return float(cell.inner_text().split(" s")[0])


def watch_the_rank_panel(page) -> None:
    """While the fixture's cells run: the panel counts a running cell's seconds, then names rank 1 while rank 0 waits
    for it in an all_reduce. The kernel is busy in the cell all along: only the panel's own thread updates it."""
    panel = page.locator(".widget-html-content").filter(has_text="last collective")
    expect(panel.locator("tr").nth(1)).to_contain_text("running", timeout=120_000)
    first = rank_panel_seconds(panel, 0)
    page.wait_for_timeout(2000)
    assert rank_panel_seconds(panel, 0) >= first + 1, "the panel did not update while the cell ran"
    expect(panel).to_contain_text(re.compile(r"rank\(s\) \[0\] wait in all_reduce #\d+ of group \[0, 1\] for "
                                             r"rank\(s\) \[1\]"), timeout=30_000)
    panel.scroll_into_view_if_needed()
    page.screenshot(path=ARTIFACTS / "lab_rank_panel.png")


@pytest.mark.browser
@pytest.mark.timeout(900)
def test_the_rank_panel_updates_while_a_cell_runs_and_names_the_rank_others_wait_for(tmp_path, monkeypatch,
                                                                                      no_leftovers):
    shutil.copy(FIXTURES / "rank_panel.ipynb", tmp_path)
    with lab_with_browser(tmp_path, monkeypatch) as lab:
        with notebook_in_lab(lab, "rank_panel.ipynb", "lab_rank_panel", while_running=watch_the_rank_panel) as page:
            expect(page.locator(".widget-html-content").filter(has_text="last collective")).to_contain_text("idle")
