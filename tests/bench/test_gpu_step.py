"""bench/gpu_step.py as a CPU smoke run: every figure it reports is computed and the page
write it times lands byte for byte (the GPU figures themselves come from a GPU run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_step_bench_runs_on_cpu_and_reports_against_the_floor(tmp_path, llama_dir):
    out = tmp_path / "g.json"
    run = subprocess.run(
        [sys.executable, "bench/gpu_step.py", "--device", "cpu", "--model", llama_dir, "--batches", "1,2",
         "--steps", "3", "--context-len", "32", "--transfer-blocks", "8", "--json", str(out)],
        cwd=REPO, env={**os.environ, "UCX_MODULES": "^ib"}, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    res = json.loads(out.read_text())
    points = res["steps"]["torch"]
    for batch in ("1", "2"):
        p = points[batch]
        assert p["step_ms"] > 0 and p["floor_ms"] > 0
        assert abs(p["x_floor"] - p["step_ms"] / p["floor_ms"]) < 1e-9
    assert points["2"]["floor_ms"] > points["1"]["floor_ms"]  # a bigger batch reads more KV
    assert res["transfer"]["gbps"] > 0 and res["transfer"]["mem"] == "DRAM" and res["transfer"]["blocks"] == 8
    assert "x floor" in run.stdout and "KV transfer DRAM->DRAM through NIXL" in run.stdout


def test_gpu_step_bench_refuses_an_unknown_backend():
    run = subprocess.run([sys.executable, "bench/gpu_step.py", "--device", "cpu", "--backends", "torch,tpu"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--backends: unknown ['tpu']" in run.stderr
