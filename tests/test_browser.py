"""The series in the UI learners use: JupyterLab from `make lab`, headless Chromium, Run -> Run All Cells.

tests/test_notebooks.py proves the notebooks' code; this proves that in the browser the `shardlab` kernel starts
from the notebook's metadata, a cluster starts and its `%%px` cells finish, tables render as HTML and figures as
images. Notebook 09 also has its planner's widgets worked: changing the domain size re-plans, and the verdict in
the widget's output turns from "does not fit" to "fits". Notebook 11 (the memory levers) is run whole as well:
its figures are drawn in the kernel from what the ranks measured, and its check calls back into the ranks.

Cost, on a 2-core CI machine: each notebook gets its own JupyterLab and two ranks (a few seconds to start; the
notebook's own run dominates), so a failure in one does not hide the other. The other notebooks share the same
kernel, cluster and `%%px` machinery, which these two exercise; their code runs in tests/test_notebooks.py.
"""

import contextlib
import re
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from browser_support import CHROMIUM_ARGS, chromium_environment, find_chromium, lab_server

REPO = Path(__file__).resolve().parents[1]
PLANNER = "09_memory_planner.ipynb"
# Run whole in the browser besides 09 (whose widgets are worked too).
RUN_ALL = ("10_beyond_halos.ipynb", "11_memory_levers.ipynb")
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
def notebook_in_lab(notebook: str, folder: Path, monkeypatch, artifact: str):
    """A copy of ``notebook`` open in JupyterLab in headless Chromium, every cell run (Run All), none failed:
    yields the page. On the way out the notebook's kernel is stopped (its cluster was stopped by its last cell);
    if the body fails, a screenshot of what the UI showed goes to test-artifacts/ for CI."""
    with sync_playwright() as pw:
        chromium = find_chromium(pw)
    monkeypatch.setenv("SHARDLAB_RANKS", "2")  # the kernel's cluster: two ranks are enough in the browser
    shutil.copy(REPO / "notebooks" / notebook, folder)  # outputs land in the copy; the committed one stays clean
    ARTIFACTS.mkdir(exist_ok=True)
    for old in ARTIFACTS.glob(f"{artifact}*"):
        old.unlink()

    with lab_server(folder, ARTIFACTS / f"{artifact}.server.log") as (base, token, api), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
                                     env=chromium_environment(folder))
        page = browser.new_page(viewport={"width": 1600, "height": 1200})
        try:
            page.goto(f"{base}/lab/tree/{notebook}?token={token}")
            ready = page.locator(".jp-Dialog").or_(page.get_by_text(f"{KERNEL_DISPLAY} | Idle"))
            expect(ready.first).to_be_visible(timeout=120_000)
            if page.locator(".jp-Dialog").is_visible():
                page.locator(".jp-Dialog select").select_option(label=KERNEL_DISPLAY)
                page.locator(".jp-Dialog").get_by_role("button", name="Select").click()
            expect(page.get_by_text(f"{KERNEL_DISPLAY} | Idle")).to_be_visible(timeout=120_000)

            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
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
            browser.close()

        sessions = [s for s in api("/api/sessions") if s["path"].endswith(notebook)]
        assert [s["kernel"]["name"] for s in sessions] == [KERNEL], sessions
        for session in sessions:  # stops the notebook's kernel (its cluster was stopped by the last cell)
            api(f"/api/kernels/{session['kernel']['id']}", "DELETE")


@pytest.mark.browser
@pytest.mark.timeout(1800)  # `make test-system` may install chromium with apt-get first
def test_notebook_09_runs_in_jupyterlab_and_its_widget_replans(tmp_path, monkeypatch, no_leftovers):
    screenshot = ARTIFACTS / "lab_planner.png"
    with notebook_in_lab(PLANNER, tmp_path, monkeypatch, "lab_planner") as page:
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
        page.screenshot(path=screenshot)
    assert screenshot.stat().st_size > 20_000, f"{screenshot} is suspiciously small"


@pytest.mark.browser
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("notebook", RUN_ALL, ids=lambda name: name.split(".")[0])
def test_notebook_runs_all_cells_in_jupyterlab(notebook, tmp_path, monkeypatch, no_leftovers):
    artifact = f"lab_{notebook.split('.')[0]}"
    screenshot = ARTIFACTS / f"{artifact}.png"
    with notebook_in_lab(notebook, tmp_path, monkeypatch, artifact) as page:
        figures = page.locator(".jp-OutputArea-output img")
        assert figures.count() > 0, "no figure was drawn"
        passed = page.locator(".jp-OutputArea-output").filter(has_text=re.compile(r"^✓ ", re.M))
        assert passed.count() > 0, "no exercise check printed its ✓"
        figures.last.scroll_into_view_if_needed()
        page.screenshot(path=screenshot)
    assert screenshot.stat().st_size > 20_000, f"{screenshot} is suspiciously small"
