"""bench/step_plan_sim.py: the step plan's variants in the simulator, on a hand-written profile
(the bench measures one with the real engine; what it compares is the same either way)."""

from __future__ import annotations

import pytest

from pdserve.bench import step_plan_sim
from pdserve.engine import scheduler, step_budget
from pdserve.sim.profile import CostProfile, StepModel

# about the 2-core box's curve (sim profile of the bench model): ms per step, stream, prompt token
PROFILE = CostProfile(name="test", source="hand-written", kv_bytes_per_token=6144,
                      steps={1: StepModel(6.8, 0.1, 0.11, 0.07, 0.52, kv_blocks=2730)}, noise_cv=0.0)


def test_a_variant_sets_the_products_code_for_its_block_only():
    before = (scheduler.plan_budget, step_budget.HOLD_ALL_BEHIND, step_budget.ENDING_TOKENS, scheduler.TAIL_SHARE,
              step_budget.FRACTION)
    with step_plan_sim.variant("whole"):
        assert scheduler.plan_budget is step_plan_sim._whole_prompts
    with step_plan_sim.variant("no-hold"):
        assert step_budget.ENDING_TOKENS == 0 and not step_budget.HOLD_ALL_BEHIND
    with step_plan_sim.variant("target-1.0"):
        assert step_budget.FRACTION == 1.0
    with pytest.raises(RuntimeError), step_plan_sim.variant("no-tail"):
        raise RuntimeError("restored even when the run fails")
    assert (scheduler.plan_budget, step_budget.HOLD_ALL_BEHIND, step_budget.ENDING_TOKENS,
            scheduler.TAIL_SHARE, step_budget.FRACTION) == before


def test_the_variants_replay_the_same_arrivals_and_whole_prompts_stall_the_streams_longer():
    assert [(r.t, r.prompt_len) for r in step_plan_sim.workload(4.0, 3)] == \
        [(r.t, r.prompt_len) for r in step_plan_sim.workload(4.0, 3)]
    assert step_plan_sim.workload(4.0, 3) != step_plan_sim.workload(4.0, 4)
    plan = step_plan_sim.run_variant("plan", PROFILE, 4.0, 3, (1500.0, 50.0))
    whole = step_plan_sim.run_variant("whole", PROFILE, 4.0, 3, (1500.0, 50.0))
    assert len(plan["runs"]) == 3 and plan["requests"] == 120
    # a whole 900-token prompt is one ~170 ms step beside the streams; the plan bounds its gaps
    # at MAX_STALL x the TPOT target (160 ms): its ITL p99 is the lower
    assert plan["itl_p99_median"] < whole["itl_p99_median"]
    assert "| plan |" in step_plan_sim.table({"plan": plan, "whole": whole})


def test_unknown_variants_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        step_plan_sim.main(["--profile", "x.yaml", "--variants", "plan,fastest"])
    assert "unknown fastest" in capsys.readouterr().err
