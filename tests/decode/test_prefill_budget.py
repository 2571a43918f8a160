"""The decode worker's step plan: calibrated at boot, fed to its engine from the measured step
cost curve and the policy's SLOs (or fixed by the topology), exposed as metrics; and the
router's TTFT predictions checked against every request."""

from __future__ import annotations

import json
import urllib.request

import pytest

from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine.step_budget import StepTargets
from pdserve.engine.step_plan import StepPlanFeed, step_cost
from pdserve.router.costs import CostEstimates
from pdserve.router.policy import CostModelParams
from tests.harness import PERMISSIVE_POLICY, WorkerThread, wait_until


def estimates(**changes) -> CostEstimates:
    import dataclasses
    return dataclasses.replace(CostEstimates.seed(CostModelParams(), 1024), **changes)


def test_the_feed_reapplies_only_when_the_curve_or_the_slos_move():
    applied = []
    feed = StepPlanFeed(lambda c, t: applied.append((c, t)), apply_fixed=None)
    assert feed.update(estimates(prefill_local_ms_per_token=0.30), 50, 1000)
    assert not feed.update(estimates(prefill_local_ms_per_token=0.32), 50, 1000)  # within 10 %
    assert feed.update(estimates(prefill_local_ms_per_token=0.40), 50, 1000)
    assert feed.update(estimates(prefill_local_ms_per_token=0.40), 40, 1000)  # a new TPOT SLO
    assert not feed.update(estimates(prefill_local_ms_per_token=0.40, step_fixed_ms=10.3), 40, 1000)
    assert [t for _, t in applied] == [StepTargets(50, 1000), StepTargets(50, 1000), StepTargets(40, 1000)]
    assert applied[-1][0] == step_cost(estimates(prefill_local_ms_per_token=0.40))


def test_a_fixed_budget_is_applied_once_and_never_planned():
    fixed, planned = [], []
    feed = StepPlanFeed(lambda c, t: planned.append(c), apply_fixed=fixed.append, fixed=256)
    assert not feed.update(estimates(), 50, 1000)
    assert (fixed, planned) == ([256], [])


def metric(body: str, name: str, **labels) -> float:
    for line in body.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_a_worker_calibrates_at_boot_and_plans_its_engine_steps(llama_dir, tmp_path):
    policy = tmp_path / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY + "  tpot_slo_ms: 40\n")
    w = WorkerThread(DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 512},
                                        router_policy=str(policy))).start()
    try:
        worker = w.worker
        seeds = CostModelParams()
        est = worker._policy.costs.snapshot()
        # calibration replaced the seeds with this machine's figures
        assert (est.step_fixed_ms, est.prefill_local_ms_per_token) != (seeds.step_fixed_ms,
                                                                       seeds.prefill_local_ms_per_token)
        assert worker._policy.costs.samples("prefill_local_ms_per_token") > 0
        sched = worker.engine.scheduler
        wait_until(lambda: sched.step_targets == StepTargets(40, 1000))
        assert sched.step_cost == worker.step_plan.cost
        # The router's local prediction plans a long prompt beside the streams that will be
        # decoding by then: requests admitted ahead of it count, not only those decoding now.
        fe = worker.frontend
        # (A backlog longer than the streams can absorb: else they take it in chunks as large
        # as the gap bound allows, alone or crowded.)
        alone = fe.prefill_budget_tokens(20000, 0, fe.local_backlog())
        fe.num_prefilling += 8
        try:
            crowded = fe.prefill_budget_tokens(20000, 0, fe.local_backlog())  # (fails with num_decoding alone)
        finally:
            fe.num_prefilling -= 8
        assert crowded < alone, (crowded, alone)
        body = json.dumps({"model": worker.frontend.served_model, "prompt": "hello there " * 20, "max_tokens": 4})
        req = urllib.request.Request(f"{w.http}/v1/completions", body.encode(), {"Content-Type": "application/json"})
        assert urllib.request.urlopen(req, timeout=30).status == 200
        text = urllib.request.urlopen(f"{w.http}/metrics", timeout=10).read().decode()
        assert metric(text, "pdserve_local_prefill_budget_tokens") >= 16
        # the step that ran its prompt was planned with nobody decoding, and counted so
        assert metric(text, "pdserve_step_plan_steps_total", rule="idle") >= 1
        assert metric(text, "pdserve_step_plan_steps_total", rule="streams_win") == 0
        # the request's measured TTFT was compared with the local route's prediction
        assert metric(text, "pdserve_ttft_prediction_ratio_count", route="local") == 1
        assert worker._policy.costs.samples("ttft_residual_local_ms") == 1
    finally:
        w.stop()


@pytest.mark.parametrize("fixed", [48])
def test_a_topology_can_fix_the_budget_instead(llama_dir, fixed):
    w = WorkerThread(DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 512}, calibrate=False,
                                        local_prefill_budget_tokens=fixed)).start()
    try:
        eng = w.worker.engine
        wait_until(lambda: eng.prefill_token_budget == fixed)
        assert eng.scheduler.step_cost is None
    finally:
        w.stop()


def test_a_step_trace_has_every_step_and_its_plan(llama_dir, tmp_path, monkeypatch):
    """PDSERVE_STEP_TRACE=FILE: one JSON line per engine step, with the plan's budget and reason."""
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PDSERVE_STEP_TRACE", str(trace))
    w = WorkerThread(DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 512})).start()
    try:
        body = json.dumps({"model": w.worker.frontend.served_model, "prompt": "hello there " * 20, "max_tokens": 4})
        req = urllib.request.Request(f"{w.http}/v1/completions", body.encode(), {"Content-Type": "application/json"})
        assert urllib.request.urlopen(req, timeout=30).status == 200
    finally:
        w.stop()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    prompt = [r for r in rows if r["prompt_tokens"] > 0]
    assert prompt and all(r["budget"] >= 16 and r["reason"] and r["ms"] > 0 for r in prompt), prompt
    assert sum(r["decodes"] for r in rows) == 3  # 4 tokens: the first came with the prompt's last chunk
    assert all(a["end_s"] < b["end_s"] for a, b in zip(rows, rows[1:]))
