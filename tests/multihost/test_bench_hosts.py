"""bench/hosts.py runs end to end: three placements measured side by side, hosts removed after."""

from __future__ import annotations

import subprocess

from pdserve.bench.hosts import PLACEMENTS, run


def test_bench_measures_every_placement_and_leaves_no_host():
    rows = run([4], 0.1, progress=lambda _: None)
    assert sorted(r["placement"] for r in rows) == sorted(PLACEMENTS)
    assert all(r["bytes"] == 4 * 2 * 2**20 and r["gb_per_s"] > 0 and r["reps"] >= 2 for r in rows)
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "-solo" not in leftover
