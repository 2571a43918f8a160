"""The SLO-aware step budget (engine/step_budget.py): its outputs for given cost curves, SLOs,
streams and waiting prompts, and the scheduler applying it."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.scheduler import TAIL_SHARE
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
    assert "nobody decoding" in b.reason and b.rule == "idle"


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
    # over 16 tokens; over its 100: 40 x 110 - 870 - 1100 > 0) does not hold the prompt back
    behind = plan(decoding=[(10, 0.87, 100)], prompts=[(900, 0.0)])
    assert behind.tokens == 596 and "or is behind it (1)" in behind.reason and behind.rule == "absorbed"
    # one that misses whatever happens (2 tokens left: 40 x 12 - 870 - 22 < 0) sets no limit
    lost = plan(decoding=[(10, 0.87, 2)], prompts=[(4000, 0.0)])
    assert lost.tokens == 596 and "holds the backlog" in lost.reason


def test_a_long_prompt_gets_the_chunks_its_ttft_needs_when_the_streams_have_slack():
    # Streams at 20 tokens in 0.3 s: slack = 40 x 20 - 300 = 500 ms each.
    streams = [(20, 0.3)] * 4
    b = plan(decoding=streams, prompts=[(2800, 0.0)])
    # 2800 tokens in 800 ms: 800 - 700 = 100 ms of step bases of 14 ms -> 7 steps of 400 tokens
    assert b.tokens == 400 and b.rule == "prompts_need"
    assert "the streams afford" in b.reason and "it fits" in b.reason
    # the same prompt beside fresh streams (no slack): they win, at what they afford
    fresh = plan(decoding=[(0, 0.0)] * 4, prompts=[(2800, 0.0)])
    assert fresh.tokens == 104 and "the streams win" in fresh.reason and fresh.rule == "streams_win"


def test_slack_is_spent_up_to_max_stall_only():
    huge = [(1000, 1.0)]  # 39 s of slack
    # 3100 tokens due in 800 ms need 2 steps of 1550 (398 ms each): more than MAX_STALL allows
    b = plan(decoding=huge, prompts=[(3100, 0.0)], max_tokens=100_000)
    assert b.tokens == int((MAX_STALL * TPOT - 11.0) / 0.25) == 596


def test_a_stream_behind_its_target_does_not_hold_the_prompts_back():
    """Behind its target, a stream sets no limit on the step (the gap bound does) unless it has
    at most ENDING_TOKENS left: holding every prompt to steps of the target for it drained a
    burst of long prompts later for everyone (docs/PERFORMANCE.md). The streams with slack
    beside it still give only what they afford."""
    behind = [(10, 0.5)]  # 40 x 10 - 500 = -100 ms
    gap_bound = int((MAX_STALL * TPOT - 11) / 0.25)
    for prompts in ([(1200, 0.0)], [(2800, 0.0)], [(3000, 2.0)]):  # would wait, needs more, late
        b = plan(decoding=behind, prompts=prompts)
        assert b.tokens == gap_bound
    assert "behind it (1)" in plan(decoding=behind, prompts=[(1200, 0.0)]).reason
    # a stream with slack beside it gives only what it affords (40 x 11 - 330 - 12 = 98 ms):
    # the prompts' need (350 tokens with 2 streams' base of 12 ms) fits in it
    beside = plan(decoding=behind + [(10, 0.33)], prompts=[(2800, 0.0)])
    assert beside.tokens == 350 and "afford 98 ms" in beside.reason
    assert plan(decoding=behind + [(10, 0.39)], prompts=[(2800, 0.0)]).tokens == int((40 * 11 - 390 - 12) / 0.25)
    # one behind with few tokens left (4: W = 40 x 14 - 420 - 44 = 96 ms, 24 a step) cannot
    # spread a long step over tokens to come: steps of the target while the prompts can wait
    ending = plan(decoding=[(10, 0.42, 4)], prompts=[(1200, 0.0)])
    assert ending.tokens == 116 and "with <= 8 tokens left" in ending.reason and ending.rule == "ending_hold"
    assert plan(decoding=[(10, 0.42, 4)], prompts=[(2800, 0.0)]).tokens == gap_bound  # they need more
    # with 9 left (W = 241 ms, 26.8 a step: behind too) it holds nothing back
    assert plan(decoding=[(10, 0.42, 9)], prompts=[(1200, 0.0)]).tokens == gap_bound
    # and a step of the target when the prompts can wait in such steps (base 12 ms: 2 streams)
    waits = plan(decoding=behind + [(10, 0.39)], prompts=[(1200, 0.0)])
    assert waits.tokens == int((TPOT - 12) / 0.25) == 112 and "TPOT target 40 ms" in waits.reason
    assert waits.rule == "target_step"


def test_the_ablation_restores_the_hold_for_any_stream_behind(monkeypatch):
    """PDSERVE_STEP_PLAN_BEHIND=all (read at import): the rule before, for the bench's ablation."""
    from pdserve.engine import step_budget
    behind = [(10, 0.87, 100)]  # behind, 100 tokens left: holds nothing back under the rule kept
    assert plan(decoding=behind, prompts=[(900, 0.0)]).tokens == 596
    monkeypatch.setattr(step_budget, "HOLD_ALL_BEHIND", True)
    held = plan(decoding=behind, prompts=[(900, 0.0)])
    assert held.tokens == 116 and held.rule == "ending_hold"
    assert plan(decoding=behind, prompts=[(2800, 0.0)]).tokens == 596  # the prompts need more: not held


def test_a_prompt_past_its_ttft_target_is_drained_with_the_streams_slack():
    # It arrived 2 s ago: past its target whatever the chunk; the stream has 500 ms of slack.
    b = plan(decoding=[(20, 0.3)], prompts=[(3000, 2.0)])
    assert b.tokens == int((MAX_STALL * TPOT - 11) / 0.25) and "cannot make" in b.reason and b.rule == "late_drain"
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

def stepped_clock(eng, ms_per_step: float = 10.0):
    """The engine's request times (arrival, first token) come off a clock that moves
    ``ms_per_step`` a step and not otherwise: the plan reads request ages off it, and how long
    this machine takes over a step must not change the plan (a 15 ms age on a slow CI runner
    turned a plan's TTFT need from 78 tokens into 128)."""
    now = [0.0]
    eng.scheduler.clock = lambda: now[0]
    step = eng.step

    def stepped(*args, **kwargs):
        out = step(*args, **kwargs)
        now[0] += ms_per_step / 1e3
        return out
    eng.step = stepped


def test_a_waiting_short_prompt_starts_within_one_step_of_a_long_planned_prefill(llama_dir):
    """Under the planned budget, a short prompt arriving while a long prompt is prefilled in
    chunks is scheduled in the very next step, beside the long prompt's next chunk."""
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    eng.set_step_targets(StepCost(5.0, 0.5, 2.0), StepTargets(tpot_ms=50.0, ttft_ms=2000.0))
    stepped_clock(eng)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    eng.add_request([(7 * j) % 290 + 3 for j in range(480)], params, request_id="long")
    eng.step()  # nobody decoding: (0.25 x 1600 - 5) / 2 = 197 tokens
    assert eng.last_step[1] == 197 and eng.prefill_token_budget == 197
    eng.add_request([5, 6, 7], params, request_id="short")
    firsts = {d.request_id for d in eng.step() if d.new_token_ids}
    assert "short" in firsts, "the short prompt waited behind the long prefill"
    _, tokens, _ = eng.last_step
    # The short prompt gets its first token at the end of this step, so the step is a short one
    # (engine/scheduler.py `_short_prompts`): the short prompt's 3 tokens, the long chunk the rest.
    plan = eng.scheduler.last_budget
    assert plan.short_step() < plan.tokens == eng.prefill_token_budget
    assert tokens == max(plan.short_step(), 3 + MIN_TOKENS)


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
    # The short prompts finish in the first step, whose long chunk stays at the minimum (a step
    # of the target holds fewer tokens than that); every stream then gets its token every step.
    assert chunks[0] == (3 * 4 + MIN_TOKENS, 0), chunks
    assert all(d >= 3 for _, d in chunks[1:12]), chunks
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
    # at the target's pace there is nothing to credit (W = 0): the stream is behind its target;
    # with 16 tokens to come it does not hold the prompt back, with 8 it gets steps of the target
    paced = plan_budget(COST, SLO, stream, [(900, 0.0, 0)], 4096, period_ms=40.0)
    assert paced.tokens == 596 and "or is behind it (1)" in paced.reason
    ending = plan_budget(COST, SLO, [(0, 0.0, 8)], [(900, 0.0, 0)], 4096, period_ms=40.0)
    assert ending.tokens == int((TPOT - 11) / 0.25) == 116


def test_the_plan_carries_a_step_of_the_target_and_the_prompts_need():
    # nobody decoding: a quarter of the TTFT target, but a short step is one of the TPOT target
    b = plan(prompts=[(300, 0.0)])
    assert b.target_tokens == int((TPOT - 10) / 0.25) == 120 and b.need <= b.target_tokens
    assert b.short_step() == 120 < b.tokens
    # prompts due soon need more than a step of the target: the short step is what they need
    late = plan(decoding=[(0, 0.0)] * 4, prompts=[(2000, 0.2)])
    assert late.need > late.target_tokens and late.short_step() == min(late.tokens, late.need)
    # never below the minimum chunk, never over the plan
    tight = plan(decoding=[(0, 0.0)] * 20, prompts=[(100, 0.0)], cost=StepCost(30.0, 1.0, 1.0))
    assert tight.target_tokens == MIN_TOKENS and tight.short_step() <= tight.tokens


def planned_with_a_stream(llama_dir, params: SamplingParams):
    """An engine under the plan (5 ms + 0.5 / stream + 0.5 / prompt token; TPOT 50, TTFT 5000 ms)
    on the stepped clock, with one stream decoding."""
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    eng.set_step_targets(StepCost(5.0, 0.5, 0.5), StepTargets(tpot_ms=50.0, ttft_ms=5000.0))
    stepped_clock(eng)
    eng.add_request([5, 6, 7, 8], params, request_id="stream")
    eng.step()  # the stream decodes from now on
    return eng


def test_a_short_prompt_behind_a_waiting_long_one_gets_its_first_token_in_the_next_step(llama_dir):
    """First come, first served would admit the long prompt first and leave the short one the
    rest of the step or none; a short prompt goes first instead, and the step it finishes in
    is a short one: its long chunk stays within the plan's short step."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng = planned_with_a_stream(llama_dir, params)
    eng.add_request([(7 * j) % 290 + 3 for j in range(400)], params, request_id="long")
    eng.add_request([9, 10, 11], params, request_id="short")
    firsts = {d.request_id for d in eng.step() if d.new_token_ids}
    assert "short" in firsts, "the short prompt waited behind the long one"
    plan = eng.scheduler.last_budget
    _, tokens, decodes = eng.last_step
    long_req = next(r for r in eng.scheduler.running if r.request_id == "long")
    assert decodes == 1 and tokens - decodes == 3 + long_req.num_computed_tokens
    assert long_req.num_computed_tokens == max(plan.short_step(), 3 + MIN_TOKENS) - 3 < plan.tokens - 3
    # with no short prompt waiting, the long prompt's chunk is the plan's again
    before = long_req.num_computed_tokens
    eng.step()
    budget, left = eng.scheduler.last_budget.tokens, 400 - before
    want = left if left - budget <= budget // TAIL_SHARE else budget  # a tail of <= 1/8 comes along
    assert long_req.num_computed_tokens - before == want


@pytest.mark.parametrize("share", [False, True])
def test_under_the_plan_a_running_prefill_keeps_the_step_while_a_long_prompt_waits(llama_dir, monkeypatch, share):
    """First come, first served among long prompts (scheduler.SHARE_UNDER_PLAN off): the older
    prefill takes all of the plan's prompt tokens while a long one waits behind it; sharing
    them (the rule before, and still the rule under a fixed budget) gives it half."""
    from pdserve.engine import scheduler
    monkeypatch.setattr(scheduler, "SHARE_UNDER_PLAN", share)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng = planned_with_a_stream(llama_dir, params)
    eng.add_request([(7 * j) % 290 + 3 for j in range(1000)], params, request_id="older")
    eng.step()
    older = next(r for r in eng.scheduler.running if r.request_id == "older")
    before = older.num_computed_tokens
    assert 0 < before < 1000 - 2 * before  # mid-prefill, with more than two steps' worth left
    eng.add_request([(5 * j) % 290 + 3 for j in range(1000)], params, request_id="younger")
    eng.step()
    planned = eng.scheduler.last_budget.tokens
    younger = next(r for r in [*eng.scheduler.running, *eng.scheduler.waiting] if r.request_id == "younger")
    got = older.num_computed_tokens - before
    assert got == (planned // 2 if share else planned)
    assert younger.num_computed_tokens == planned - got  # the rest of the step, if any, goes on


def test_a_prompt_whose_prefix_the_pool_holds_is_short(llama_dir):
    """Short is what is left after the pool's prefix hit: a 163-token prompt whose first 160
    tokens are cached goes ahead of a waiting long prompt, in a short step, and its output is
    the same as without the cache."""
    prefix = [(5 * j) % 290 + 3 for j in range(160)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).generate([prefix + [9, 10, 11]], params)[0]
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    eng.set_step_targets(StepCost(5.0, 0.5, 0.5), StepTargets(tpot_ms=50.0, ttft_ms=5000.0))
    stepped_clock(eng)
    eng.add_request(prefix, SamplingParams(max_tokens=1), request_id="warm")
    while eng.has_work():
        eng.step()
    eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                    request_id="stream")
    eng.step()  # the stream decodes from now on
    eng.add_request([(7 * j) % 290 + 3 for j in range(400)], params, request_id="long")
    eng.add_request(prefix + [9, 10, 11], params, request_id="prefixed")
    outputs = {}
    for d in eng.step():
        outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert outputs.get("prefixed"), "the prompt with a cached prefix waited behind the long one"
    plan = eng.scheduler.last_budget
    assert 163 > plan.target_tokens >= 3, plan  # long in full, short after the hit
    long_req = next(r for r in eng.scheduler.running if r.request_id == "long")
    assert long_req.num_computed_tokens == max(plan.short_step(), 3 + MIN_TOKENS) - 3 < plan.tokens - 3
    while eng.has_work():
        for d in eng.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert outputs["prefixed"] == ref.token_ids


def test_short_prompts_never_hold_a_long_prompt_below_what_its_ttft_needs(llama_dir):
    """A long prompt due soon needs big chunks: a step with a short prompt in it still gives
    the long prompt what the prompts' TTFT targets need (Budget.need) less the short prompt's
    tokens, and never less than the minimum chunk."""
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    eng.set_step_targets(StepCost(5.0, 0.5, 0.5), StepTargets(tpot_ms=50.0, ttft_ms=600.0))
    stepped_clock(eng)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    eng.add_request([5, 6, 7, 8], params, request_id="stream")
    eng.step()
    eng.add_request([(7 * j) % 290 + 3 for j in range(900)], params, request_id="long")
    long_req, shorts, needy = None, 0, 0
    while long_req is None or long_req.num_computed_tokens < 900:
        assert shorts < 200, "the long prompt never finished beside a short prompt every step"
        eng.add_request([9, 10, 11 + shorts], params, request_id=f"short{shorts}")  # one every step
        shorts += 1
        before = long_req.num_computed_tokens if long_req is not None else 0
        eng.step()
        plan = eng.scheduler.last_budget
        long_req = next(r for r in eng.scheduler.running if r.request_id == "long")
        got = long_req.num_computed_tokens - before
        assert got >= min(max(plan.need - 3, MIN_TOKENS), 900 - before), (plan, got)
        needy += plan.need > plan.target_tokens
    assert needy, "the TTFT target never asked for more than a step of the TPOT target: the test proves nothing"
