"""scripts/suite_cost.py without running the suite: each run is `make test` in a clone of its own, the first with the
fork server off and the second as the series runs now (whatever this environment says), in a clone others can read
and with Ctrl-C delivered, every clone removed, and the table's ratios are each run's over the first."""

import importlib.util
import signal
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JUNIT = """<testsuites><testsuite hostname="{host}" time="{seconds}" timestamp="2026-12-05T10:00:00">
<testcase classname="tests.unit.test_repo" name="test_a" time="1.0"/>
<testcase classname="tests.unit.test_repo" name="test_b" time="1.0"><skipped/></testcase>
</testsuite></testsuites>"""


def load():
    spec = importlib.util.spec_from_file_location("suite_cost", ROOT / "scripts" / "suite_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_run_is_make_test_in_a_clone_of_its_own_first_without_the_fork_server(monkeypatch, tmp_path):
    suite_cost = load()
    monkeypatch.setenv("SHARDLAB_FORK_ENGINES", "0")  # the second run is the series as it runs, not this setting
    monkeypatch.setattr(suite_cost, "JUNIT", tmp_path / "junit")
    clones, settings = [], []

    def run(cmd, cwd=None, env=None, **kwargs):
        if cmd[:2] == ["git", "clone"]:
            clones.append(Path(cmd[-1]))
            assert clones[-1].is_dir()
        else:
            assert cmd == ["make", "test"] and Path(cwd) == clones[-1]
            assert Path(cwd).stat().st_mode & 0o777 == 0o755  # other accounts run its .venv (tests/system)
            ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job has it
            try:
                kwargs["preexec_fn"]()
                assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # the suite's Ctrl-C tests need it
            finally:
                signal.signal(signal.SIGINT, ignored)
            settings.append(env.get("SHARDLAB_FORK_ENGINES"))
            junit = Path(cwd, "test-artifacts", "junit", "make-test.xml")
            junit.parent.mkdir(parents=True)
            junit.write_text(JUNIT.format(host=socket.gethostname(), seconds=200 if len(settings) == 1 else 150))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(suite_cost.subprocess, "run", run)
    results = [suite_cost.run_suite(label, extra) for label, extra in suite_cost.RUNS]
    assert settings == ["0", None] and len(set(clones)) == 2 and not any(c.exists() for c in clones)
    counted = [(r["pytest_s"], r["passed"], r["skipped"], r["failed"]) for r in results]
    assert counted == [(200, 1, 1, 0), (150, 1, 1, 0)]
    assert (tmp_path / "junit" / "make-test.xml").read_text().count('time="150"') == 1  # the last run's
    results[0]["command_s"], results[1]["command_s"] = 400, 300
    rows = suite_cost.table(results).splitlines()
    assert rows[2].startswith("| without the fork server | 400 | 200 | 1.00x | 1.00x |")
    assert rows[3].startswith("| fork server | 300 | 150 | 0.75x | 0.75x |")
