"""bench/tracing.py as a smoke run with small settings: every mode (off, 1%, 100%) reports
its TTFT and engine step, and only the traced modes export spans (100%: every request's)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_tracing_bench_reports_every_mode(llama_dir, tmp_path):
    out = tmp_path / "tracing.json"
    subprocess.run([sys.executable, "bench/tracing.py", "--model", llama_dir, "--requests", "3", "--rounds", "1",
                    "--prompt-tokens", "16", "--max-tokens", "4", "--concurrency", "2", "--json", str(out)],
                   check=True, timeout=300)
    report = json.loads(out.read_text())
    assert set(report) == {"off", "1%", "100%"}
    for mode, r in report.items():
        assert r["requests"] == 3 and r["ttft_p50_ms"] > 0 and r["steps"] > 0 and r["step_mean_ms"] > 0, mode
    assert report["off"]["spans_exported"] == 0
    assert report["100%"]["spans_exported"] >= 3 * 4  # request, admission, queue, prefill per request
