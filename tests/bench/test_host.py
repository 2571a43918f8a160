"""bench/host.py: a benchmark turns scheduler autogroups off for its run and puts them back;
bench/lag_probe.py --why says where the CPUs' time went while it slept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.host import autogroups_off

REPO = Path(__file__).resolve().parents[2]


def test_autogroups_are_off_during_the_run_and_restored_after_also_on_an_error(tmp_path):
    knob = tmp_path / "sched_autogroup_enabled"
    knob.write_text("1\n")
    lines = []
    with autogroups_off("off", lines.append, knob) as host:
        assert knob.read_text().strip() == "0"
        assert host == {"autogroups": "off", "changed": True}
    assert knob.read_text().strip() == "1"
    with pytest.raises(RuntimeError):
        with autogroups_off("off", lines.append, knob):
            assert knob.read_text().strip() == "0"
            raise RuntimeError("the benchmark failed")
    assert knob.read_text().strip() == "1"
    assert any("restored after" in line for line in lines)


def test_a_run_stopped_with_sigterm_restores_them(tmp_path):
    """`kill` (or a CI timeout) on a benchmark mid-run must not leave the host's setting changed."""
    knob = tmp_path / "sched_autogroup_enabled"
    knob.write_text("1\n")
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
            "from bench.host import autogroups_off\n"
            "with autogroups_off('off', print, Path(sys.argv[2])):\n"
            "    print('running', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(REPO), str(knob)], stdout=subprocess.PIPE, text=True)
    try:
        assert "running" in proc.stdout.readline() + proc.stdout.readline()
        assert knob.read_text().strip() == "0"
        proc.terminate()
        assert proc.wait(timeout=30) == 128 + 15
    finally:
        proc.kill()
        proc.wait()
    assert knob.read_text().strip() == "1"


def test_keep_leaves_the_host_and_says_what_that_means(tmp_path):
    knob = tmp_path / "sched_autogroup_enabled"
    knob.write_text("1\n")
    lines = []
    with autogroups_off("keep", lines.append, knob) as host:
        assert knob.read_text().strip() == "1"
    assert host == {"autogroups": "on", "changed": False}
    assert any("--autogroups off" in line for line in lines)
    knob.write_text("0\n")
    with autogroups_off("off", lines.append, knob) as host:  # already off: nothing to change or restore
        pass
    assert host == {"autogroups": "off", "changed": False} and knob.read_text().strip() == "0"
    with autogroups_off("off", lines.append, tmp_path / "absent") as host:  # not Linux, or no such knob
        pass
    assert host["autogroups"] == "n/a"


def test_the_lag_probe_reports_the_kernels_counters_for_a_late_wake_up(tmp_path):
    out = tmp_path / "probe.json"
    # --report-ms 0: every wake-up counts as late, so the run records the counters of some
    res = subprocess.run([sys.executable, str(REPO / "bench/lag_probe.py"), "--seconds", "0.5", "--sleep-ms", "10",
                          "--report-ms", "0", "--nice", "0", "--why", "--json", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    stalls = json.loads(out.read_text())["stalls"]
    assert stalls
    if Path("/proc/stat").is_file():
        changed = stalls[-1][2]
        assert {"cpu_user_ms", "cpu_idle_ms", "cpu_steal_ms", "runnable"} <= set(changed)
        # half a second of readings: the CPUs' time (every kind summed) passed between them
        assert sum(v for s in stalls for k, v in s[2].items() if k.startswith("cpu_")) > 0
