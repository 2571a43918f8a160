"""The SLO-aware step budget (engine/step_budget.py): its outputs for given cost curves, SLOs,
streams and waiting prompts, and the scheduler applying it."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.step_budget import FRACTION, IDLE_WAIT, MAX_STALL, MIN_TOKENS, StepCost, StepTargets, plan_budget

# 10 ms per step + 1 ms per stream + 0.25 ms per prompt token; TPOT 50 ms, TTFT 1000 ms
COST = StepCost(fixed_ms=10.0, decode_ms=1.0, prefill_ms=0.25)
SLO = StepTargets(tpot_ms=50.0, ttft_ms=1000.0)
TPOT, TTFT = 50.0 * FRACTION, 1000.0 * FRACTION  # the targets the plan works to: 40 and 800 ms


def plan(decoding=(), prompts=(), cost=COST, slo=SLO, max_tokens=4096):
    return plan_budget(cost, slo, list(decoding), [(left, age, 0) for left, age in prompts], max_tokens)


def test_nobody_decoding_a_step_may_take_a_quarter_of_the_ttft_target():
    b = plan(prompts=[(300, 0.0)])
    assert b.tokens == int((IDLE_WAIT * TTFT - 10.0) / 0.25) == 760
    assert "nobody decoding" in b.reason


def test_fresh_streams_get_the_chunk_that_fits_their_tpot_target():
    # 4 streams that just got their first token, no future tokens credited: no slack; a
    # backlog longer than one step of the target
    b = plan(decoding=[(0, 0.0)] * 4, prompts=[(100, 0.0), (100, 0.0)])
    assert b.tokens == int((TPOT - (10 + 4)) / 0.25) == 104
    assert "TPOT target 40 ms" in b.reason
    # a backlog that fits in that step: the streams absorb it, so nothing holds the chunk back
    # (but the gap bound)
    small = plan(decoding=[(0, 0.0)] * 4, prompts=[(100, 0.0)])
    assert small.tokens == int((MAX_STALL * TPOT - 14) / 0.25) and "holds the backlog" in small.reason


def test_streams_with_tokens_to_come_absorb_a_backlog_in_big_chunks():
    """A stream's TPOT is its mean: over its next r tokens it can carry tpot x (k + r) - age
    - r x base ms of prompt compute. A backlog within that costs it the same in any chunking,
    so the prompt gets the largest chunk the gap bound allows."""
    # 16 tokens to come, 1 stream (base 11 ms): W = 40 x 16 - 16 x 11 = 464 ms >= 900 x 0.25
    credited = plan(decoding=[(0, 0.0, 16)], prompts=[(900, 0.0)])
    assert credited.tokens == int((MAX_STALL * TPOT - 11) / 0.25) == 596 and "holds the backlog" in credited.reason
    # the credit stops at HORIZON tokens: 1000 to come count as 16
    assert plan(decoding=[(0, 0.0, 1000)], prompts=[(900, 0.0)]).tokens == 596
    # no count of future tokens (r = 1): only its slack, a prompt that meets its TTFT in small chunks
    assert plan(decoding=[(0, 0.0)], prompts=[(900, 0.0)]).tokens == int((TPOT - 11) / 0.25) == 116
    # a backlog beyond what it can carry: W / r per step (464 / 16 = 29 ms: a step of the target)
    assert plan(decoding=[(0, 0.0, 16)], prompts=[(4000, 0.0)]).tokens == 116
    # a stream behind its target that bare steps would bring back (W = 1040 - 870 - 176 < 0
    # over 16 tokens; over its 100: 40 x 110 - 870 - 1100 > 0): steps of the target, no longer
    behind = plan(decoding=[(10, 0.87, 100)], prompts=[(900, 0.0)])
    assert behind.tokens == 116 and "behind" in behind.reason
    # one that misses whatever happens (2 tokens left: 40 x 12 - 870 - 22 < 0) sets no limit
    lost = plan(decoding=[(10, 0.87, 2)], prompts=[(4000, 0.0)])
    assert lost.tokens == 596 and "holds the backlog" in lost.reason


def test_a_long_prompt_gets_the_chunks_its_ttft_needs_when_the_streams_have_slack():
    # Streams at 20 tokens in 0.3 s: slack = 40 x 20 - 300 = 500 ms each.
    streams = [(20, 0.3)] * 4
    b = plan(decoding=streams, prompts=[(2800, 0.0)])
    # 2800 tokens in 800 ms: 800 - 700 = 100 ms of step bases of 14 ms -> 7 steps of 400 tokens
    assert b.tokens == 400
    assert "the streams afford" in b.reason and "it fits" in b.reason
    # the same prompt beside fresh streams (no slack): they win, at what they afford
    fresh = plan(decoding=[(0, 0.0)] * 4, prompts=[(2800, 0.0)])
    assert fresh.tokens == 104 and "the streams win" in fresh.reason


def test_slack_is_spent_up_to_max_stall_only():
    huge = [(1000, 1.0)]  # 39 s of slack
    # 3100 tokens due in 800 ms need 2 steps of 1550 (398 ms each): more than MAX_STALL allows
    b = plan(decoding=huge, prompts=[(3100, 0.0)], max_tokens=100_000)
    assert b.tokens == int((MAX_STALL * TPOT - 11.0) / 0.25) == 596


def test_a_stream_behind_its_target_gets_steps_of_the_target_while_the_prompts_can_wait():
    """Behind its target, a stream takes no slack from anyone: while the prompts meet their TTFT
    in steps of the target, that is what they get (not shorter: that starves them); once they
    need more, or are late, the stream does not hold them back."""
    behind = [(10, 0.5)]  # 40 x 10 - 500 = -100 ms
    fits = plan(decoding=behind, prompts=[(1200, 0.0)])  # meets its 800 ms in 116-token chunks
    assert fits.tokens == int((TPOT - 11) / 0.25) == 116 and "behind" in fits.reason
    needs = plan(decoding=behind, prompts=[(2800, 0.0)])  # needs chunks of 400: nothing holds it back
    assert needs.tokens == int((MAX_STALL * TPOT - 11) / 0.25) and "behind while" in needs.reason
    late = plan(decoding=behind, prompts=[(3000, 2.0)])  # late whatever the chunk: the gap bound
    assert late.tokens == int((MAX_STALL * TPOT - 11) / 0.25)
    # a stream with slack beside it still gives only what it affords (40 x 11 - 330 - 12 = 98 ms):
    # the prompts' need (350 tokens with 2 streams' base of 12 ms) fits in it
    beside = plan(decoding=behind + [(10, 0.33)], prompts=[(2800, 0.0)])
    assert beside.tokens == 350 and "afford 98 ms" in beside.reason
    assert plan(decoding=behind + [(10, 0.39)], prompts=[(2800, 0.0)]).tokens == int((40 * 11 - 390 - 12) / 0.25)

def test_a_prompt_past_its_ttft_target_is_drained_with_the_streams_slack():
    # It arrived 2 s ago: past its target whatever the chunk; the stream has 500 ms of slack.
    b = plan(decoding=[(20, 0.3)], prompts=[(3000, 2.0)])
    assert b.tokens == int((MAX_STALL * TPOT - 11) / 0.25) and "cannot make" in b.reason
    # a fresh stream has no slack to give: the late prompt gets what fits the TPOT target
    assert plan(decoding=[(0, 0.0)], prompts=[(3000, 2.0)]).tokens == int((TPOT - 11) / 0.25)


def test_prompts_waiting_together_need_the_chunk_of_their_cumulative_tokens():
    # a stream with 79 ms to spare (W = 40 x 11 - 350 - 11): neither backlog fits in it
    one = plan(decoding=[(10, 0.35)], prompts=[(400, 0.0)])
    two = plan(decoding=[(10, 0.35)], prompts=[(400, 0.0), (2000, 0.0)])
    assert one.tokens == 116 and two.tokens == 134 > one.tokens


@pytest.mark.parametrize("cost, max_tokens, expect", [
    (StepCost(45.0, 1.0, 0.25), 4096, MIN_TOKENS),  # no room at all: the minimum chunk, progress
    (StepCost(1.0, 0.0, 1e-4), 512, 512),  # nearly free tokens: the engine's cap
])
def test_the_budget_is_clamped(cost, max_tokens, expect):
    assert plan(decoding=[(0, 0.0)], prompts=[(5000, 0.0)], cost=cost, max_tokens=max_tokens).tokens == expect


def test_the_prefill_time_of_a_chunked_prompt():
    assert COST.prefill_time_ms(1000, 250, decodes=2) == 4 * 12 + 250
    assert COST.prefill_time_ms(0, 250, decodes=2) == 0


# -- the scheduler applying it ------------------------------------------------------------

def test_a_waiting_short_prompt_starts_within_one_step_of_a_long_planned_prefill(llama_dir):
    """Under the planned budget, a short prompt arriving while a long prompt is prefilled in
    chunks is scheduled in the very next step, beside the long prompt's next chunk."""
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    eng.set_step_targets(StepCost(5.0, 0.5, 2.0), StepTargets(tpot_ms=50.0, ttft_ms=1000.0))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    eng.add_request([(7 * j) % 290 + 3 for j in range(480)], params, request_id="long")
    eng.step()  # nobody decoding: (0.25 x 800 - 5) / 2 = 97 tokens
    assert eng.last_step[1] == 97 and eng.prefill_token_budget == 97
    eng.add_request([5, 6, 7], params, request_id="short")
    firsts = {d.request_id for d in eng.step() if d.new_token_ids}
    assert "short" in firsts, "the short prompt waited behind the long prefill"
    _, tokens, _ = eng.last_step
    assert tokens == 3 + eng.prefill_token_budget // 2  # the long chunk took half, the short its 3 tokens


def test_planned_budget_keeps_decode_tokens_and_greedy_output(llama_dir):
    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    long_prompt = [(11 * j) % 290 + 3 for j in range(200)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ref = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).generate(prompts + [long_prompt], params)
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    # 30 ms fixed + 1 ms per token: fresh streams afford (40 - 33) / 1 = 7 tokens -> the minimum, 16
    eng.set_step_targets(StepCost(30.0, 1.0, 1.0), StepTargets(tpot_ms=50.0, ttft_ms=10_000.0))
    outputs, chunks = {}, []
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"s{i}")
    eng.add_request(long_prompt, params, request_id="long")
    while eng.has_work():
        for d in eng.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
        _, tokens, decodes = eng.last_step
        chunks.append((tokens - decodes, decodes))
    assert all(p <= MIN_TOKENS for p, d in chunks[1:] if d == 3), chunks
    assert [outputs[f"s{i}"] for i in range(3)] + [outputs["long"]] == [r.token_ids for r in ref]


def test_step_targets_are_checked(llama_dir):
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    with pytest.raises(ValueError, match="prefill_ms > 0"):
        eng.set_step_targets(StepCost(1.0, 1.0, 0.0), SLO)
    with pytest.raises(ValueError, match="step targets"):
        eng.set_step_targets(COST, StepTargets(0.0, 100.0))


def test_future_tokens_are_credited_at_the_streams_recent_pace():
    """Under a steady load the steps to come carry new prompts too: a stream's future tokens
    are credited at its measured time per token (when longer than the bare step), not at the
    bare step."""
    stream, prompt = [(0, 0.0, 16)], [(900, 0.0)]
    assert plan(decoding=stream, prompts=prompt).tokens == 596  # bare steps (11 ms) to come
    # at 25 ms a token: W = 40 x 16 - 16 x 25 = 240 ms >= the prompt's 225 ms: still absorbed
    assert plan_budget(COST, SLO, stream, [(900, 0.0, 0)], 4096, period_ms=25.0).tokens == 596
    # at the target's pace there is nothing to credit: a step of the target
    paced = plan_budget(COST, SLO, stream, [(900, 0.0, 0)], 4096, period_ms=40.0)
    assert paced.tokens == int((TPOT - 11) / 0.25) == 116
