"""What the suite's own plumbing reports: the first half's failures and stray processes printed at
the end of `make test` (tests/failures.py), and the cleanup after a failed local Ray start
(tests/harness.py)."""

from __future__ import annotations

import subprocess
import sys

import psutil

from tests.failures import main, stray_processes
from tests.harness import _kill_children_since


def test_the_stray_process_report_is_found_above_the_summary(tmp_path, capsys):
    log = tmp_path / "first.log"
    lines = ["tests/a.py ....", "2 process(es) left running by the test suite (killed now):",
             "  pid 11 (first seen after tests/a.py::t): gcs_server --x", "  pid 12 (first seen after tests/a.py::t): raylet",
             "===== slowest durations =====", *[f"{i}.0s call tests/a.py::t{i}" for i in range(200)],
             "1027 passed in 1038.76s"]
    log.write_text("\n".join(lines) + "\n")
    assert stray_processes(lines) == lines[1:4]
    main(["failures", str(tmp_path / "missing.xml"), str(log)])
    out = capsys.readouterr().out.splitlines()
    assert out[1:4] == lines[1:4]  # after the line saying the report is missing, before the tail
    assert out[-1] == "1027 passed in 1038.76s"


def test_a_clean_log_reports_no_stray_processes():
    assert stray_processes(["tests/a.py ....", "1 passed in 1.0s"]) == []


def test_only_the_children_started_after_the_snapshot_are_killed():
    kept = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        _kill_children_since(before)  # kills and reaps it (Popen then sees no child to wait for)
        alive = {p.pid for p in psutil.Process().children(recursive=True)}
        assert late.pid not in alive and not psutil.pid_exists(late.pid)
        assert kept.pid in alive and kept.poll() is None
    finally:
        kept.kill()
        kept.wait(timeout=10)
