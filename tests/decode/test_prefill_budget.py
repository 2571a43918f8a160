"""The decode worker's local prefill budget: derived from its measured costs and the policy's
TPOT target (or fixed by the topology), handed to its engine, exposed as a metric."""

from __future__ import annotations

import urllib.request

import pytest

from pdserve.decode.prefill_budget import MIN_TOKENS, TARGET_FRACTION, PrefillBudget, derive_budget
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import PERMISSIVE_POLICY, WorkerThread, wait_until


def test_budget_fills_the_step_up_to_the_tpot_target():
    d = derive_budget(tpot_slo_ms=50, decode_step_ms=10, prefill_ms_per_token=0.25, max_tokens=2048)
    assert d.tokens == int((50 * TARGET_FRACTION - 10) / 0.25) == 120
    assert "tpot_slo_ms 50" in d.reason and "decode step 10.0 ms" in d.reason


@pytest.mark.parametrize("decode_ms, per_token, max_tokens, expect", [
    (45.0, 0.25, 2048, MIN_TOKENS),  # no room left: the minimum chunk, so prefills still progress
    (1.0, 0.001, 2048, 2048),  # cheap tokens: capped at the engine's step budget
    (10.0, 0.0, 512, 512),  # nothing measured yet
])
def test_budget_is_clamped(decode_ms, per_token, max_tokens, expect):
    assert derive_budget(50, decode_ms, per_token, max_tokens).tokens == expect


def test_fixed_budget_wins_and_small_moves_are_not_reapplied():
    assert derive_budget(50, 45, 1.0, 2048, fixed=256).tokens == 256
    applied = []
    budget = PrefillBudget(applied.append, max_tokens=2048)
    budget.update(50, 10, 0.25)  # 120
    budget.update(50, 10, 0.26)  # 115: within the hysteresis, kept
    budget.update(50, 20, 0.25)  # 80
    assert applied == [120, 80]


def test_the_worker_gives_its_engine_the_derived_budget(llama_dir, tmp_path):
    policy = tmp_path / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY + "  tpot_slo_ms: 40\n")
    w = WorkerThread(DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 512},
                                        router_policy=str(policy))).start()
    try:
        worker = w.worker
        est = worker._policy.costs.snapshot()
        expected = derive_budget(40, est.decode_step_ms, est.prefill_local_ms_per_token,
                                 worker.engine.config.max_num_batched_tokens).tokens
        wait_until(lambda: worker.engine.prefill_token_budget == expected)
        body = urllib.request.urlopen(f"{w.http}/metrics", timeout=10).read().decode()
        line = next(x for x in body.splitlines() if x.startswith("pdserve_local_prefill_budget_tokens{"))
        assert float(line.rsplit(" ", 1)[1]) == expected
    finally:
        w.stop()
