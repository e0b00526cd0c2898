"""A cluster notebook run by a learner's route: JupyterLab from `make lab`, headless Chromium, Run → Run All Cells.

The notebooks' code is proved by tests/test_notebooks.py; this proves the series works in the UI people use: the
`shardlab` kernel starts from the notebook's metadata, `%%px` cells finish in the browser, and the per-rank table
renders as HTML. A small fixture notebook does that without running a whole lesson a second time.
"""

import contextlib
import re
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from browser_support import CHROMIUM_ARGS, ensure_chromium, lab_server

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "lab_cluster.ipynb"
NOTEBOOK = FIXTURE.name
ARTIFACTS = REPO / "test-artifacts"
KERNEL, KERNEL_DISPLAY = "shardlab", "Python (shardlab: PhysicsNeMo distributed)"
RUN_TIMEOUT_MS = 4 * 60_000  # a 2-rank cluster starts in ~20 s on 2 cores; the browser adds the UI's own work
STATES_COLUMNS = ["rank", "local_rank", "world_size", "launcher", "method", "backend", "device", "timeout_s", "pid"]

# Done = kernel idle and nothing queued ([*]) after at least one cell ran. Run All queues every cell at once and,
# on an error, clears the queue, so this also ends the wait early when a cell fails.
RUN_FINISHED = """() => {
  const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent.trim());
  const status = document.querySelector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator')?.dataset.status;
  return status === 'idle' && !prompts.includes('[*]:') && prompts.some(p => /^\\[\\d+\\]:$/.test(p));
}"""


@pytest.mark.browser
@pytest.mark.timeout(1800)  # a first run may install chromium with apt-get
def test_cluster_notebook_runs_in_jupyterlab(tmp_path, no_leftovers):
    chromium = ensure_chromium()
    shutil.copy(FIXTURE, tmp_path)  # outputs land in the copy; the committed notebook stays clean
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "lab_cluster.png"
    for old in ARTIFACTS.glob("lab_cluster*"):
        old.unlink()

    with lab_server(tmp_path, ARTIFACTS / "lab_cluster.server.log") as (base, token, api), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1200})
        try:
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")

            # The notebook names its kernel; a kernel picker only appears if that kernel is unknown to the server.
            ready = page.locator(".jp-Dialog").or_(page.get_by_text(f"{KERNEL_DISPLAY} | Idle"))
            expect(ready.first).to_be_visible(timeout=120_000)
            if page.locator(".jp-Dialog").is_visible():
                page.locator(".jp-Dialog select").select_option(label=KERNEL_DISPLAY)
                page.locator(".jp-Dialog").get_by_role("button", name="Select").click()
            expect(page.get_by_text(f"{KERNEL_DISPLAY} | Idle")).to_be_visible(timeout=120_000)

            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            page.wait_for_function(RUN_FINISHED, timeout=RUN_TIMEOUT_MS, polling=1000)

            # A failing cell renders its traceback as stderr (JupyterLab has no separate error mime renderer);
            # warnings are stderr too, so look for the traceback itself.
            stderr = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
            tracebacks = [t for t in stderr.all_inner_texts() if "Traceback" in t or "CompositeError" in t]
            assert not tracebacks, "a cell failed in the browser:\n" + "\n---\n".join(tracebacks)[-4000:]
            prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()
            unrun = [i for i, p in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", p.strip())]
            assert not unrun, f"code cells {unrun} (0-based, code cells only) have no execution count: {prompts}"

            # The per-rank table: the HTML rendering of `states`, one row per MPI rank.
            table = page.locator(".jp-OutputArea-output table").filter(has=page.locator("th", has_text="timeout_s"))
            expect(table).to_have_count(1)
            table.scroll_into_view_if_needed()
            expect(table).to_be_visible()
            headers = [h.strip() for h in table.locator("thead th").all_inner_texts()]
            assert headers == STATES_COLUMNS
            rows = [dict(zip(headers, row)) for row in table.evaluate(
                "t => [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.textContent.trim()))")]
            assert [r["rank"] for r in rows] == ["0", "1"], rows
            assert {(r["world_size"], r["method"], r["backend"]) for r in rows} == {("2", "openmpi", "gloo")}, rows
            # The %%px cell's output, grouped by rank as learners see it.
            outputs = " ".join(page.locator(".jp-OutputArea-output").all_inner_texts())
            assert "rank 0: sum of ones = 2" in outputs and "rank 1: sum of ones = 2" in outputs

            table.evaluate("t => t.closest('.jp-Cell').scrollIntoView({block: 'center'})")
            page.screenshot(path=screenshot)
            table.screenshot(path=ARTIFACTS / "lab_cluster_states_table.png")
        except Exception:
            with contextlib.suppress(Exception):  # what the UI showed when it failed, for CI's artifacts
                page.screenshot(path=ARTIFACTS / "lab_cluster.failure.png")
            raise
        finally:
            browser.close()

        # The server reports which kernel the UI started: the series' own, not the default python3.
        sessions = [s for s in api("/api/sessions") if s["path"].endswith(NOTEBOOK)]
        assert [s["kernel"]["name"] for s in sessions] == [KERNEL], sessions
        for session in sessions:  # stops the notebook's cluster with its kernel, before the server goes
            api(f"/api/kernels/{session['kernel']['id']}", "DELETE")

    assert screenshot.stat().st_size > 20_000, f"{screenshot} is suspiciously small"
