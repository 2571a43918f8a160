"""bench/kv_tier_gpu.py runs end to end on the host (`--device cpu`, a smoke run): the tier
stores the blocks, every load is checked against its source blocks, and the table and JSON
carry each figure. On a GPU it is part of bench/gpu_check.sh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_tier_bandwidth_bench_runs_and_checks_its_loads(tmp_path):
    out = tmp_path / "tier.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "kv_tier_gpu.py"), "--device", "cpu", "--layers", "2",
                           "--blocks", "16", "--sizes", "1,4", "--reps", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 blocks checked" in proc.stdout and "| blocks | MiB | floor H2D GB/s |" in proc.stdout
    body = json.loads(out.read_text())
    assert [r["blocks"] for r in body["rows"]] == [1, 4]
    assert all(r["tier_gb_s"] > 0 and r["floor_h2d_gb_s"] > 0 for r in body["rows"])
    assert body["block_bytes"] == 2 * 2 * 16 * 8 * 128 * 2
