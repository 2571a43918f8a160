"""A short goodput sweep end to end: three modes started by the launcher, JSON table, PNG plots.

The percentiles, throughputs and goodput in the JSON are recomputed here from
the raw per-request samples with numpy, independently of pdserve.bench.metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import small_topology_yaml

RATES = [2.0, 8.0]
NUM_PROMPTS = 6
SLOS = {"ttft": 3000.0, "tpot": 300.0}
PERCENTILES = [50.0, 90.0, 99.0]

@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Run `bench sweep` once (about 1.5 minutes on 2 cores); yields (document, output dir, stdout)."""
    tmp = tmp_path_factory.mktemp("sweep")
    topo = tmp / "topology.yaml"
    topo.write_text(small_topology_yaml("bench-test", tmp))
    out = tmp / "out"  # passed relative to the working directory, as users type it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib"}
    cmd = [sys.executable, "-m", "pdserve.bench.cli", "sweep", "--topology", str(topo), "--output-dir", "out",
           "--request-rates", *map(str, RATES), "--cdf-rate", str(RATES[0]), "--num-prompts", str(NUM_PROMPTS),
           "--dataset-name", "mixed", "--mixed-short-input-len", "24", "--mixed-short-output-len", "6",
           "--mixed-long-input-len", "300", "--mixed-long-output-len", "3", "--mixed-long-fraction", "0.34",
           "--goodput", *(f"{k}:{v:g}" for k, v in SLOS.items()), "--metric-percentiles", "50,90,99",
           "--no-warmup", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=tmp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads((out / "sweep.json").read_text()), out, res.stdout


def runs(doc):
    for mode, by_rate in doc["results"].items():
        for key, m in by_rate.items():
            yield mode, key, m


def test_sweep_writes_every_mode_and_rate(sweep):
    doc, out, stdout = sweep
    assert list(doc["results"]) == ["colocated", "always-remote", "conditional"]
    for mode, by_rate in doc["results"].items():
        assert sorted(float(k) for k in by_rate) == RATES
    assert doc["config"]["roles"] == {"colocated": {"prefill": 0, "decode": 2},
                                      "always-remote": {"prefill": 1, "decode": 1},
                                      "conditional": {"prefill": 1, "decode": 1}}
    assert len(doc["table"]) == 6
    assert {(row["mode"], row["request_rate"]) for row in doc["table"]} == {
        (mode, rate) for mode in doc["results"] for rate in RATES}
    assert "| colocated | 2 |" in stdout and "goodput/worker" in stdout


def test_each_run_has_vllm_named_fields_and_every_raw_sample(sweep):
    doc, _, _ = sweep
    fields = ["duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
              "request_goodput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "route_mix", "handoff", "by_kind"]
    for mode, _, m in runs(doc):
        assert not [f for f in fields if f not in m], mode
        assert len(m["requests"]) == NUM_PROMPTS
        assert m["completed"] == NUM_PROMPTS, [r["error"] for r in m["requests"] if not r["success"]]
        assert {r["kind"] for r in m["requests"]} == {"short", "long"}
        for r in m["requests"]:
            assert r["completion_tokens"] == r["output_len"]  # ignore_eos: exactly what was asked
            assert len(r["itl_ms"]) <= r["completion_tokens"] - 1
            assert r["breakdown"]["route"] in ("local", "remote")


def test_route_mix_matches_the_mode(sweep):
    doc, _, _ = sweep
    for mode, _, m in runs(doc):
        routes = m["route_mix"]["routes"]
        workers = {r["breakdown"]["worker_id"] for r in m["requests"]}
        if mode == "colocated":
            assert routes == {"local": NUM_PROMPTS}
            assert workers == {"decode-0", "decode-1"}  # round-robin over both decode workers
        else:
            assert workers == {"decode-0"}
        if mode == "always-remote":
            assert routes.get("remote", 0) + m["route_mix"]["fell_back_to_local"] == NUM_PROMPTS
            assert m["handoff"]["remote"]["mean_transfer_bytes"] > 0


def test_percentiles_agree_with_the_raw_samples(sweep):
    doc, _, _ = sweep
    for mode, key, m in runs(doc):
        ok = [r for r in m["requests"] if r["success"]]
        raw = {
            "ttft": [r["ttft_ms"] for r in ok],
            "tpot": [(r["e2el_ms"] - r["ttft_ms"]) / (r["completion_tokens"] - 1) for r in ok
                     if r["completion_tokens"] > 1],
            "itl": [x for r in ok for x in r["itl_ms"]],
            "e2el": [r["e2el_ms"] for r in ok],
        }
        for name, values in raw.items():
            v = np.asarray(values)
            assert v.size > 0, (mode, key, name)
            where = f"{mode} @ {key}: {name}"
            assert m[f"mean_{name}_ms"] == pytest.approx(v.mean(), rel=1e-9), where
            assert m[f"median_{name}_ms"] == pytest.approx(np.median(v), rel=1e-9), where
            for p in PERCENTILES:
                assert m[f"p{int(p)}_{name}_ms"] == pytest.approx(np.percentile(v, p), rel=1e-9), where
            assert v.min() <= m[f"p50_{name}_ms"] <= m[f"p90_{name}_ms"] <= m[f"p99_{name}_ms"] <= v.max(), where


def test_throughput_and_goodput_agree_with_the_raw_samples(sweep):
    doc, _, _ = sweep
    for mode, key, m in runs(doc):
        ok = [r for r in m["requests"] if r["success"]]
        end = max(r["end_s"] for r in m["requests"])
        assert m["duration"] == pytest.approx(end, rel=1e-9)
        assert all(r["end_s"] >= r["start_s"] + r["e2el_ms"] / 1e3 - 1e-9 for r in ok)
        assert m["request_throughput"] == pytest.approx(len(ok) / end)
        assert m["total_output_tokens"] == sum(r["completion_tokens"] for r in ok)
        assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / end)

        def good(r):
            tpot = (r["e2el_ms"] - r["ttft_ms"]) / (r["completion_tokens"] - 1) if r["completion_tokens"] > 1 else 0
            return r["ttft_ms"] <= SLOS["ttft"] and tpot <= SLOS["tpot"]

        n_good = sum(good(r) for r in ok)
        assert m["request_goodput"] == pytest.approx(n_good / end), f"{mode} @ {key}"
        assert m["request_goodput_per_worker"] == pytest.approx(n_good / end / 2)
        row = next(r for r in doc["table"] if r["mode"] == mode and r["request_rate"] == float(key))
        assert row["request_goodput"] == m["request_goodput"]


def test_plots_are_pngs(sweep):
    doc, out, _ = sweep
    import matplotlib.image

    for name in ("goodput_vs_rate", "latency_vs_rate", "ttft_cdf", "tpot_cdf"):
        path = Path(doc["plots"][name])
        assert path.parent == out and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        h, w = matplotlib.image.imread(path).shape[:2]
        assert h > 200 and w > 300, name
    assert doc["plots"]["cdf_rate"] == RATES[0]


def test_clusters_are_stopped_after_the_sweep(sweep):
    doc, out, _ = sweep
    runs_dir = Path(doc["config"]["topology"]).parent / "runs"
    assert not list(out.glob("runs/*.state.json")) and not list(runs_dir.glob("*.state.json"))
