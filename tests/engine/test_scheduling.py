"""Prefix caching, chunked prefill, preemption, block accounting, remote-KV hooks."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import RequestStatus

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def prompts_of(lengths, vocab=32000, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Outputs of a plain engine (no prefix cache, big budget) for the shared prompts."""
    prompts = prompts_of([5, 40, 90, 130, 200, 17, 64, 150], seed=7)
    llm = LLM(llama_dir, enable_prefix_caching=False)
    return prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)]


def assert_no_leak(llm: LLM):
    kv = llm.engine.kv
    assert not llm.engine.requests
    assert kv.tables == {}
    assert kv.num_free_blocks == kv.pool.num_blocks
    # Blocks still indexed by the prefix cache are all free, hence evictable.
    assert all(b.ref_cnt == 0 for b in kv.pool.cached.values())


def test_prefix_cache_reuses_blocks_and_keeps_output(llama_dir):
    shared = prompts_of([160], seed=3)[0]
    a, b = shared + [11, 12, 13], shared + [21, 22]
    ref = LLM(llama_dir, enable_prefix_caching=False).generate([b], GREEDY)[0].token_ids
    llm = LLM(llama_dir)
    llm.generate([a], GREEDY)
    computed_before = llm.engine.stats.num_prompt_tokens_computed
    out = llm.generate([b], GREEDY)[0]
    computed_b = llm.engine.stats.num_prompt_tokens_computed - computed_before
    assert out.num_cached_tokens == 160  # ten full blocks of the shared prefix
    assert computed_b == len(b) - 160
    assert out.token_ids == ref
    assert_no_leak(llm)


def test_fully_cached_prompt_recomputes_only_its_last_block(llama_dir):
    p = prompts_of([64], seed=4)[0]
    llm = LLM(llama_dir)
    first = llm.generate([p], GREEDY)[0]
    before = llm.engine.stats.num_prompt_tokens_computed
    second = llm.generate([p], GREEDY)[0]
    assert llm.engine.stats.num_prompt_tokens_computed - before == 16
    assert second.token_ids == first.token_ids


def test_chunked_prefill_gives_identical_output(llama_dir, reference):
    prompts, ref = reference
    llm = LLM(llama_dir, max_num_batched_tokens=16)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    # 200 prompt tokens at 16 per step need many steps: chunking really happened.
    assert llm.engine.stats.num_steps > 200 // 16
    assert_no_leak(llm)


def test_preemption_by_recompute_gives_identical_output(llama_dir):
    prompts = prompts_of([30, 45, 60, 20, 75, 33, 50, 40], seed=8)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    ref = [o.token_ids for o in LLM(llama_dir, enable_prefix_caching=False).generate(prompts, params)]
    # 24 blocks of 16 tokens: the prompts fit, but not their 48-token outputs at once,
    # so growing requests must preempt others.
    llm = LLM(llama_dir, num_gpu_blocks_override=24, max_model_len=384)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == ref
    assert_no_leak(llm)


def test_priority_policy_preempts_low_priority_first(llama_dir):
    llm = LLM(llama_dir, num_gpu_blocks_override=12, max_model_len=192, scheduling_policy="priority")
    eng = llm.engine
    long = prompts_of([80, 80], seed=9)
    low = eng.add_request(long[0], SamplingParams(max_tokens=60, temperature=0), priority="low")
    high = eng.add_request(long[1], SamplingParams(max_tokens=60, temperature=0), priority="high")
    preempted = set()
    for _ in range(400):
        plan_before = eng.stats.num_preemptions
        eng.step()
        if eng.stats.num_preemptions > plan_before:
            preempted |= {r.request_id for r in eng.scheduler.waiting}
        if not eng.scheduler.has_work():
            break
    assert preempted == {low.request_id}
    assert high.finish_reason == "length" and low.finish_reason == "length"


def _first_token_order(eng, reqs) -> list[str]:
    """Step until done; the request ids in the order their first token came."""
    order = []
    for _ in range(2000):
        for d in eng.step():
            if d.new_token_ids and d.request_id not in order:
                order.append(d.request_id)
        if not eng.scheduler.has_work():
            return order
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_sequence_slots_are_shared_in_turns_among_tenants(llama_dir, policy):
    """Tenant A queues 12 sequences, then B queues 2, with 4 sequence slots: B's first starts
    among the first 4 and its second within the first 8 (A's burst does not take every slot
    ahead of it: on FCFS order B would start 13th and 14th). Without tenants (keys off) the
    order stays FCFS. Outputs are the same either way."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = prompts_of([20] * 14, seed=21)
    orders, outputs = {}, {}
    for tenants in (True, False):
        llm = LLM(llama_dir, max_num_seqs=4, scheduling_policy=policy)
        eng = llm.engine
        reqs = [eng.add_request(p, params, request_id=f"{'AB'[i >= 12]}{i}",
                                tenant=("A" if i < 12 else "B") if tenants else None) for i, p in enumerate(prompts)]
        orders[tenants] = _first_token_order(eng, reqs)
        outputs[tenants] = [r.output_token_ids for r in reqs]
        assert all(r.finish_reason == "length" for r in reqs)
        assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    fair, fifo = orders[True], orders[False]
    assert outputs[True] == outputs[False]
    assert fifo == [f"{'AB'[i >= 12]}{i}" for i in range(14)]
    assert fair.index("B12") < 4 and fair.index("B13") < 8, fair
    assert [r for r in fair if r.startswith("A")] == [f"A{i}" for i in range(12)]  # each tenant in its own order


def test_tenant_turns_respect_priority_first(llama_dir):
    """Under the priority policy a tenant's high-priority request still goes before another
    tenant's normal ones; turns only order requests of equal priority."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = prompts_of([16] * 8, seed=22)
    llm = LLM(llama_dir, max_num_seqs=2, scheduling_policy="priority")
    eng = llm.engine
    for i in range(6):
        eng.add_request(prompts[i], params, request_id=f"A{i}", tenant="A")
    eng.add_request(prompts[6], params, request_id="B-normal", tenant="B")
    eng.add_request(prompts[7], params, request_id="A-high", tenant="A", priority="high")
    order = _first_token_order(eng, [])
    assert order[0] == "A-high" and order.index("B-normal") <= 2, order


def test_mixed_prefill_and_decode_in_one_step(llama_dir):
    llm = LLM(llama_dir, max_num_batched_tokens=64)
    eng = llm.engine
    eng.add_request(prompts_of([10], seed=1)[0], SamplingParams(max_tokens=20, temperature=0))
    eng.step()  # prefill of the first request
    eng.add_request(prompts_of([100], seed=2)[0], SamplingParams(max_tokens=4, temperature=0))
    plan = eng.scheduler.schedule()
    sizes = sorted(n for _, n in plan.scheduled)
    assert sizes == [1, 63]  # one decode token + a 63-token prefill chunk within the budget


def test_abort_frees_blocks(llama_dir):
    llm = LLM(llama_dir)
    eng = llm.engine
    req = eng.add_request(prompts_of([50])[0], SamplingParams(max_tokens=100, temperature=0))
    eng.step()
    assert eng.kv.num_free_blocks < eng.kv.pool.num_blocks
    assert eng.abort_request(req.request_id)
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert_no_leak(llm)


def test_remote_kv_path_matches_local(llama_dir):
    """Decode side of disaggregation inside one process: another engine computes the
    prompt KV, its pages are copied into the reserved blocks, and decoding from
    them gives exactly the local output."""
    prompt = prompts_of([70], seed=5)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    local = LLM(llama_dir).generate([prompt], params)[0].token_ids

    prefill = LLM(llama_dir, enable_prefix_caching=False).engine
    decode = LLM(llama_dir).engine
    # Decode worker: reserve blocks for the whole prompt.
    dreq = decode.make_request(prompt, params)
    res = decode.connector.reserve(dreq)
    assert res.cached_len == 0 and len(res.block_ids) == 5
    assert decode.connector.is_awaiting(dreq.request_id)
    assert decode.scheduler.schedule().scheduled == []  # waiting for remote KV: not scheduled
    # Prefill worker: compute the prompt and the first token, keep the blocks.
    prefill.connector.add_export(prompt, SamplingParams(max_tokens=1, temperature=0.0), "p-1")
    first = prefill.step()[0]
    src = prefill.connector.export_blocks("p-1", 0, len(res.block_ids))
    decode.runner.kv_cache[:, res.block_ids] = prefill.runner.kv_cache[:, src]
    prefill.connector.release_export("p-1")
    delta = decode.connector.remote_ready(dreq.request_id, first.new_token_ids[0])
    assert delta.new_token_ids == [local[0]]
    while decode.has_unfinished():
        for d in decode.step():
            if d.finished:
                out = decode.release(d.request_id)
    assert out.token_ids == local
    assert decode.stats.num_prompt_tokens_computed == 0
    assert prefill.kv.num_free_blocks == prefill.kv.pool.num_blocks


def test_remote_failure_falls_back_to_local_without_leak(llama_dir):
    prompt = prompts_of([40], seed=6)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    local = LLM(llama_dir).generate([prompt], params)[0].token_ids
    llm = LLM(llama_dir)
    eng = llm.engine
    req = eng.make_request(prompt, params)
    eng.connector.reserve(req)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks - 3
    eng.connector.fall_back(req.request_id)
    while eng.has_unfinished():
        for d in eng.step():
            if d.finished:
                out = eng.release(d.request_id)
    assert out.token_ids == local
    assert_no_leak(llm)


def test_seeded_sampling_remote_path_matches_local(llama_dir):
    """The prefill side draws the first token from a generator with the request's
    seed; the decode side skips one draw, so the rest of the sequence matches."""
    prompt = prompts_of([33], seed=12)[0]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=1234)
    local = LLM(llama_dir).generate([prompt], params)[0].token_ids

    prefill = LLM(llama_dir, enable_prefix_caching=False).engine
    decode = LLM(llama_dir).engine
    dreq = decode.make_request(prompt, params)
    targets = decode.connector.reserve(dreq).block_ids
    prefill.connector.add_export(prompt, SamplingParams(**{**params.to_dict(), "max_tokens": 1}), "p-1")
    first = prefill.step()[0].new_token_ids[0]
    decode.runner.kv_cache[:, targets] = prefill.runner.kv_cache[:, prefill.connector.export_blocks(
        "p-1", 0, len(targets))]
    decode.connector.remote_ready(dreq.request_id, first)
    for _ in range(100):
        if dreq.finish_reason is not None:
            break
        decode.step()
    assert dreq.output_token_ids == local


def test_quarantined_reservation_is_kept_until_freed(llama_dir):
    llm = LLM(llama_dir)
    eng = llm.engine
    req = eng.make_request(prompts_of([40], seed=13)[0], SamplingParams(max_tokens=4, temperature=0))
    targets = eng.connector.reserve(req).block_ids
    eng.connector.fall_back(req.request_id, quarantine_as="q#1")
    assert eng.kv.block_ids("q#1")[-len(targets):] == targets
    while eng.has_unfinished():
        for d in eng.step():
            if d.finished:
                eng.release(d.request_id)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks - 3  # the quarantine still holds its blocks
    eng.connector.free("q#1")
    assert_no_leak(llm)


def test_connector_cached_prefix_len_is_what_scheduling_finds(llama_dir):
    llm = LLM(llama_dir)
    eng = llm.engine
    prompt = prompts_of([70], seed=14)[0]
    assert eng.connector.cached_prefix_len(prompt) == 0
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    # 70 tokens: four full blocks cached (the last token is always recomputed)
    assert eng.connector.cached_prefix_len(prompt) == 64
    assert eng.connector.cached_prefix_len(prompt[:64] + [7]) == 64
    assert eng.connector.cached_prefix_len(prompt, salt=b"tenant-b") == 0
    res = eng.connector.reserve(eng.make_request(prompt + [9, 9], SamplingParams(max_tokens=1)))
    assert res.cached_len == 64 and len(res.block_ids) == 1  # 72 tokens: blocks 0-3 cached, block 4 to write
    assert eng.connector.abort(next(iter(eng.requests)))
    assert_no_leak(llm)


def test_connector_abort_quarantines_an_awaited_reservation(llama_dir):
    llm = LLM(llama_dir)
    eng = llm.engine
    req = eng.make_request(prompts_of([40], seed=15)[0], SamplingParams(max_tokens=4))
    targets = eng.connector.reserve(req).block_ids
    assert eng.connector.abort(req.request_id, quarantine_as="q#1")
    assert not eng.connector.is_awaiting(req.request_id) and not eng.requests
    assert eng.kv.block_ids("q#1")[-len(targets):] == targets  # a late write still lands in its own blocks
    eng.connector.free("q#1")
    assert_no_leak(llm)


def test_connector_export_side(llama_dir):
    """finishing() names the exports a step completes; export_blocks skips the decode
    worker's cached prefix; release_export frees everything, finished or not."""
    llm = LLM(llama_dir, max_num_batched_tokens=32)
    eng = llm.engine
    c = eng.connector
    c.add_export(prompts_of([50], seed=16)[0], SamplingParams(max_tokens=1, temperature=0), "long")
    c.add_export(prompts_of([20], seed=17)[0], SamplingParams(max_tokens=1, temperature=0), "short")
    seen = []
    eng.step(on_plan=lambda plan: seen.append(c.finishing(plan)))
    assert seen == [[]]  # 32-token budget: "long" is chunked, "short" not yet scheduled
    eng.step(on_plan=lambda plan: seen.append(c.finishing(plan)))
    assert seen[-1] == ["long"]
    table = eng.kv.block_ids("long")
    assert c.export_blocks("long", 32, 2) == table[2:4]
    c.release_export("long")
    c.release_export("short")  # still running: stopped and freed
    assert_no_leak(llm)


def test_prefill_token_budget_caps_prompt_chunks_but_never_decode_tokens(llama_dir):
    """A long prompt arriving next to running streams is prefilled in chunks of the budget while
    every running request still gets its decode token each step; tokens stay greedy-exact."""
    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    long_prompt = [(11 * j) % 290 + 3 for j in range(200)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ref = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).generate(prompts + [long_prompt], params)

    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    with pytest.raises(ValueError, match="prefill token budget"):
        eng.set_prefill_token_budget(0)
    eng.set_prefill_token_budget(48)
    outputs, steps = {}, []

    def step():
        for d in eng.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
        _, tokens, decodes = eng.last_step
        steps.append((tokens - decodes, decodes))

    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"s{i}")
    step()  # the short prompts: 12 tokens, within the budget
    eng.add_request(long_prompt, params, request_id="long")
    while eng.has_work():
        step()
    chunks = [p for p, _ in steps[1:] if p > 0]
    assert chunks == [48, 48, 48, 48, 8]  # 200 prompt tokens, 48 per step at most
    assert all(d == 3 for _, d in steps[1:5]), f"running streams lost decode tokens: {steps[1:5]}"
    assert [outputs[f"s{i}"] for i in range(3)] + [outputs["long"]] == [r.token_ids for r in ref]


def test_a_chunk_takes_a_small_tail_of_its_prompt_rather_than_leave_it_a_step_of_its_own(llama_dir):
    """A chunk that would leave at most 1/8 of itself (TAIL_SHARE) takes it now, on admission
    and when continuing; a larger tail, or one past max_num_batched_tokens, waits its step.
    Tokens stay greedy-exact."""
    from pdserve.engine.scheduler import TAIL_SHARE
    assert TAIL_SHARE == 8
    params = SamplingParams(max_tokens=4, temperature=0.0)
    # 53 = 48 + 5 (5 <= 48 // 8): one step; 100 = 48 + 52: the second chunk takes its tail of 4;
    # 110 = 48 + 48 + 14 (14 > 6)
    cases = {53: [53], 100: [48, 52], 110: [48, 48, 14]}
    lengths = list(cases)
    prompts = prompts_of(lengths, vocab=290, seed=5)
    ref = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).generate(prompts, params)
    for (n, chunks), prompt, want in zip(cases.items(), prompts, ref):
        eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
        eng.set_prefill_token_budget(48)
        eng.add_request(prompt, params, request_id="p")
        seen, out = [], []
        while eng.has_work():
            out.extend(t for d in eng.step() for t in d.new_token_ids)
            seen.append(eng.last_step[1] - eng.last_step[2])
        assert [c for c in seen if c > 0] == chunks, n
        assert out == want.token_ids
    # the step's hard cap holds the tail back: 53 tokens with max_num_batched_tokens 50
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=50).engine
    eng.set_prefill_token_budget(48)
    eng.add_request(prompts[0], params, request_id="p")
    eng.step()
    assert eng.last_step[1] == 48


def test_under_a_prefill_budget_a_short_prompt_starts_beside_a_long_prefill(llama_dir):
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    eng.set_prefill_token_budget(64)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    eng.add_request([(7 * j) % 290 + 3 for j in range(400)], params, request_id="long")
    eng.step()  # the long prompt's first chunk: the whole budget (nothing waits)
    assert eng.last_step[1] == 64
    eng.add_request([5, 6, 7], params, request_id="short")
    firsts = {d.request_id for d in eng.step() if d.new_token_ids}
    assert "short" in firsts, "the short prompt waited behind the long prefill"
    assert eng.last_step[1] == 32 + 3  # the long chunk took half the budget, the short prompt its 3 tokens


def test_the_idle_prefill_budget_applies_while_nothing_decodes(llama_dir):
    eng = LLM(llama_dir, kv_cache_memory_bytes=8 << 20).engine
    eng.set_prefill_token_budget(16, idle_tokens=96)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    eng.add_request([(7 * j) % 290 + 3 for j in range(300)], params, request_id="long")
    eng.step()
    assert eng.last_step[1] == 96  # alone: the idle budget
    eng.add_request([5, 6, 7], params, request_id="short")
    eng.step()  # the short prompt arrives: half of the idle budget for the long one, 3 tokens for it
    assert eng.last_step[1] == 48 + 3
    eng.step()  # now the short one decodes: the tight budget protects it
    assert eng.last_step[1:] == (16 + 1, 1)


def test_the_scheduler_reserves_remote_kv_in_the_step_that_admits_it_ahead_of_local_prompts(llama_dir):
    """The scheduler side of the connector (engine/remote_kv.py): a request added with
    ``remote_kv`` gets its blocks in the next schedule(), before the local prompts waiting ahead
    of it, is left out of the step, and the workers' side takes the reservation once; one the
    pool cannot hold is queued locally and reported as no room."""
    eng = LLM(llama_dir, num_gpu_blocks_override=16, max_num_batched_tokens=64).engine
    long_local, remote, too_big = prompts_of([150, 70, 130], seed=9)
    eng.add_request(long_local, SamplingParams(max_tokens=2), request_id="local")
    eng.add_request(remote, SamplingParams(max_tokens=2), request_id="remote", remote_kv=True)
    assert eng.connector.take_reservations() == []  # nothing before a step
    plan = eng.scheduler.schedule()
    (rid, res), = eng.connector.take_reservations()
    assert rid == "remote" and res.cached_len == 0 and len(res.block_ids) == 5  # 70 tokens in blocks of 16
    assert eng.connector.is_awaiting("remote") and "remote" not in {r.request_id for r, _ in plan.scheduled}
    assert [r.request_id for r, _ in plan.scheduled] == ["local"]
    assert eng.connector.take_reservations() == []  # taken once
    # no room now (of 16 blocks, 5 reserved and 4 for the local prompt's first chunk; 130 tokens
    # need 9): queued for a local prefill instead
    eng.add_request(too_big, SamplingParams(max_tokens=2), request_id="big", remote_kv=True)
    eng.scheduler.schedule()
    assert eng.connector.take_reservations() == [("big", None)]
    assert not eng.connector.is_awaiting("big") and eng.scheduler.waiting[-1].request_id == "big"
    for rid in ("local", "remote", "big"):
        assert eng.abort_request(rid)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_an_export_keeps_its_blocks_past_its_end_until_released_and_an_abort_does_not(llama_dir):
    """`request_finished` (the scheduler side): a prefill worker's export keeps its blocks once
    computed, for its pages to be read; an aborted one frees them at once."""
    eng = LLM(llama_dir).engine
    free = eng.kv.num_free_blocks
    eng.connector.add_export(prompts_of([40], seed=3)[0], SamplingParams(max_tokens=1), "exp")
    while eng.has_work():
        eng.step()
    assert eng.kv.num_free_blocks == free - 3 and eng.connector.export_blocks("exp", 0, 3)
    eng.connector.release_export("exp")
    assert eng.kv.num_free_blocks == free
    eng.connector.add_export(prompts_of([40], seed=4)[0], SamplingParams(max_tokens=1), "gone")
    eng.step()
    assert eng.abort_request("gone") and eng.kv.num_free_blocks == free
