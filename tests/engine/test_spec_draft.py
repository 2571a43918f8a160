"""Speculative decoding with a draft model (engine/spec_draft.py; docs/speculative.md): greedy
output equals the output without speculation and HF transformers, token for token, with the
target as its own draft (every proposal accepted), with a draft that agrees in part (a copy of
the target with noise in one layer: proposals accepted and rejected, the draft's KV rolled back)
and with a different, smaller model; seeded sampling equals the unspeculated seeded run;
unseeded sampling draws its proposals from the draft's distribution (accepted where the draft
is the target, with the logprobs a rescoring gives; the verification's distribution is tested
in tests/engine/test_spec_decode.py);
batches, structured outputs, preemption and a small draft pool; the load rule's k-off; the
draft's blocks all come back (finish, abort, preemption); bad config is a `ConfigError` naming
the field."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ConfigError
from pdserve.engine.model_maker import ModelSpec, make_model
from pdserve.engine.spec_config import parse_speculative_config

from .test_hf_parity import hf_greedy
from .test_spec_decode import prompts, run

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def want_params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def draft_cfg(path: str, k: int = 4, **extra) -> dict:
    """A draft model's config for these tests of the proposer's mechanics: the measured-cost
    rule off (a draft as large as its target never pays; tests/engine/test_spec_cost.py)."""
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, "disable_by_cost": False, **extra}


def draft_pool(llm: LLM) -> tuple[int, int]:
    """(free blocks, blocks) of the engine's draft KV pool."""
    draft = llm.engine.spec.draft
    return draft.kv.num_free_blocks, draft.kv.pool.num_blocks


@pytest.fixture(scope="module")
def noisy_dir(llama_dir, tmp_path_factory) -> str:
    """The target with noise added to its last layer's MLP: its argmax agrees with the target's
    about half the time (so proposals are accepted and rejected)."""
    from safetensors.torch import load_file, save_file

    out = str(tmp_path_factory.mktemp("noisy") / "model")
    shutil.copytree(llama_dir, out)
    path = os.path.join(out, "model.safetensors")
    weights = load_file(path)
    gen = torch.Generator().manual_seed(7)
    for name in [n for n in weights if "layers.2.mlp" in n]:
        weights[name] = weights[name] + 0.01 * torch.randn(weights[name].shape, generator=gen)
    save_file(weights, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def plain(llama_dir):
    with LLM(llama_dir, seed=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def self_draft(llama_dir):
    with LLM(llama_dir, seed=0, speculative_config=draft_cfg(llama_dir)) as llm:
        yield llm


@pytest.fixture(scope="module")
def noisy(llama_dir, noisy_dir):
    with LLM(llama_dir, seed=0, speculative_config=draft_cfg(noisy_dir, acceptance_floor=0.0)) as llm:
        yield llm


def test_the_target_as_its_own_draft_is_accepted_every_time_and_equals_hf(llama_dir, plain, self_draft):
    ps = prompts(8)
    want = run(plain, ps, GREEDY)
    stats = self_draft.engine.stats
    before = (stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens)
    assert run(self_draft, ps, GREEDY) == want
    proposed, accepted = stats.num_spec_draft_tokens - before[0], stats.num_spec_accepted_tokens - before[1]
    assert proposed > 100 and accepted == proposed  # the same model proposes what it verifies
    assert [o[0] for o in want[:3]] == hf_greedy(llama_dir, ps[:3], GREEDY.max_tokens)
    assert draft_pool(self_draft)[0] == draft_pool(self_draft)[1] and not self_draft.engine.spec.draft.seqs
    assert self_draft.engine.kv.num_free_blocks == self_draft.engine.kv.pool.num_blocks


def test_a_partly_agreeing_draft_rolls_back_and_stays_exact(plain, noisy):
    ps = prompts(12, seed=1)  # a batch of twelve
    stats = noisy.engine.stats
    before = (stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens)
    assert run(noisy, ps, GREEDY) == run(plain, ps, GREEDY)
    proposed, accepted = stats.num_spec_draft_tokens - before[0], stats.num_spec_accepted_tokens - before[1]
    assert 0.1 * proposed < accepted < 0.9 * proposed  # accepted and rejected: the draft's KV rolled back
    assert draft_pool(noisy)[0] == draft_pool(noisy)[1]


def test_logprobs_stops_and_penalties_equal_no_speculation(plain, noisy):
    ps = prompts(6, seed=2)
    want = plain.generate(ps, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stops = [o.text[len(o.text) // 2:len(o.text) // 2 + 3] for o in want]
    params = [SamplingParams(max_tokens=10 + i, temperature=0.0, logprobs=2, ignore_eos=True,
                             stop=[s] if i % 2 else [], repetition_penalty=1.2 if i % 3 == 0 else 1.0)
              for i, s in enumerate(stops)]
    a, b = plain.generate(ps, params), noisy.generate(ps, params)
    for x, y in zip(a, b):
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                         y.stop_reason)
        assert [e["token_id"] for e in x.logprobs] == [e["token_id"] for e in y.logprobs]


def test_seeded_sampling_equals_no_speculation(plain, self_draft, noisy):
    ps = prompts(3, seed=3) * 2
    params = [SamplingParams(max_tokens=16, temperature=t, top_p=0.9 if i % 3 else 1.0, seed=100 + i,
                             ignore_eos=True) for i, t in enumerate([1e-4, 0.05, 0.7] * 2)]
    want = run(plain, ps, params)
    before = self_draft.engine.stats.num_spec_accepted_tokens
    assert run(self_draft, ps, params) == want
    assert run(noisy, ps, params) == want
    assert self_draft.engine.stats.num_spec_accepted_tokens > before


def test_unseeded_sampling_draws_from_the_draft_and_the_target_as_its_draft_is_accepted(plain, self_draft):
    """Unseeded sampling: proposals drawn from the draft's distribution are accepted with
    probability sum min(p, q), about 1 where the draft is the target; the greedy draft's argmax
    only with p(argmax), small on this random model at temperature 1. Each emitted token's
    logprob is the target's (rescored by the plain engine's prompt_logprobs)."""
    ps = prompts(4, seed=5)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, logprobs=0, ignore_eos=True)
    eng = self_draft.engine
    rates = {}
    for mode in (False, True):
        eng.spec.draft.sample_drafts = mode
        before = (eng.stats.num_spec_draft_tokens, eng.stats.num_spec_accepted_tokens)
        outs = self_draft.generate(ps, params)
        proposed = eng.stats.num_spec_draft_tokens - before[0]
        rates[mode] = (eng.stats.num_spec_accepted_tokens - before[1]) / proposed
        assert proposed > 40 and all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    print("acceptance (drawn, argmax):", rates)
    assert rates[True] > 0.95 and rates[False] < 0.5, rates
    for p, o in zip(ps, outs):  # (the drawn mode's outputs)
        ref = plain.generate([p + o.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        want = ref.prompt_logprobs[len(p):]
        assert [e["token_id"] for e in o.logprobs] == [w["token_id"] for w in want] == o.token_ids
        assert [e["logprob"] for e in o.logprobs] == pytest.approx([w["logprob"] for w in want], abs=1e-4)
    assert draft_pool(self_draft)[0] == draft_pool(self_draft)[1] and not eng.spec.draft.seqs


def test_a_verification_that_fails_fails_its_request_alone(self_draft):
    """A drawn request whose verification raises (its draft rows broken here: 5 wide instead of
    the vocabulary) ends with an error; the other request of the batch finishes, nothing leaks."""
    draft = self_draft.engine.spec.draft
    ps = prompts(2, seed=11)
    propose = draft.propose
    broken: list[str] = []

    def spy(wants, structured):
        found = propose(wants, structured)
        for r, _ in wants:
            if r.prompt_token_ids == ps[0] and r.request_id in draft.draft_probs:
                broken.append(r.request_id)
                draft.draft_probs[r.request_id] = draft.draft_probs[r.request_id][:, :5]
        return found

    draft.propose = spy
    try:
        outs = self_draft.generate(ps, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    finally:
        del draft.propose
    assert len(broken) == 1  # (its first verification failed it)
    assert outs[0].finish_reason == "error" and outs[1].finish_reason == "length" and len(outs[1].token_ids) == 12
    assert draft_pool(self_draft)[0] == draft_pool(self_draft)[1]
    assert self_draft.engine.kv.num_free_blocks == self_draft.engine.kv.pool.num_blocks


def test_structured_outputs_equal_no_speculation(plain, self_draft):
    grammars = [{"regex": r"(ab|cd)( (ab|cd)){10,30}"}, {"choice": ["alpha beta alpha beta", "gamma"]},
                {"json": {"type": "array", "items": {"enum": ["x", "yz"]}, "minItems": 6, "maxItems": 12},
                 "disable_any_whitespace": True}]
    ps = prompts(6, seed=6)
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=g) for g in grammars * 2]
    before = self_draft.engine.stats.num_spec_draft_tokens
    assert run(self_draft, ps, params) == run(plain, ps, params)
    assert self_draft.engine.stats.num_spec_draft_tokens > before  # (proposals the grammar allows)


def test_a_different_smaller_model_drafts_and_the_load_rule_switches_it_off(model_dirs, plain, llama_dir):
    ps = prompts(4, seed=4)
    want = run(plain, ps, want_params(24))
    other = model_dirs("mistral")  # 2 layers, other weights, the same tokenizer and vocabulary
    with LLM(llama_dir, seed=0, speculative_config=draft_cfg(other, acceptance_floor=0.3, probe_interval=8)) as llm:
        assert run(llm, ps, want_params(24)) == want
        s = llm.engine.stats
        assert 0 < s.num_spec_drafts <= 4 * 8  # low acceptance: each request soon stops proposing, probing rarely
        assert draft_pool(llm)[0] == draft_pool(llm)[1]
    with LLM(llama_dir, seed=0, speculative_config=draft_cfg(llama_dir, disable_by_batch_size=3)) as llm:
        assert run(llm, ps, want_params(24)) == want
        assert llm.engine.stats.num_spec_drafts == 0 and llm.engine.spec.draft.num_forwards == 0  # batch 4 > 3
        assert run(llm, ps[:3], want_params(24)) == want[:3]
        assert llm.engine.stats.num_spec_accepted_tokens > 0


def test_preemption_and_a_small_draft_pool_give_every_block_back(llama_dir, plain, noisy_dir):
    ps = prompts(8, seed=5)
    ps = ps + [p + [5, 6, 7] for p in ps[:2]]
    params = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
    want = run(plain, ps, params)
    cfg = draft_cfg(noisy_dir, acceptance_floor=0.0, draft_kv_cache_fraction=0.5)
    with LLM(llama_dir, seed=0, speculative_config=cfg, max_num_batched_tokens=24, block_size=4,
             num_gpu_blocks_override=48) as llm:
        assert draft_pool(llm) == (24, 24)
        assert run(llm, ps, params) == want
        s = llm.engine.stats
        assert s.num_preemptions > 0 and s.num_spec_accepted_tokens > 0
        assert llm.engine.kv.num_free_blocks == 48 and draft_pool(llm) == (24, 24)


def test_finish_and_abort_free_the_drafts_blocks(self_draft):
    eng = self_draft.engine
    draft = eng.spec.draft
    free, total = draft_pool(self_draft)
    assert free == total
    reqs = [eng.add_request(p, SamplingParams(max_tokens=6 + 20 * i, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts(3, seed=8))]
    while not (reqs[0].finish_reason and all(len(r.output_token_ids) > 8 for r in reqs[1:])):
        eng.step()
    assert reqs[0].request_id not in draft.seqs and draft.kv.tables.get(reqs[0].request_id) is None  # finished
    assert {r.request_id for r in reqs[1:]} <= set(draft.seqs) and draft.kv.num_free_blocks < total
    held, free = len(draft.kv.tables[reqs[1].request_id]), draft.kv.num_free_blocks
    assert held > 0 and eng.abort_request(reqs[1].request_id)  # aborted
    assert reqs[1].request_id not in draft.seqs and draft.kv.num_free_blocks == free + held
    assert eng.abort_request(reqs[2].request_id)
    eng.release(reqs[0].request_id)
    assert draft.kv.num_free_blocks == total and not draft.seqs and not eng.has_unfinished()


@pytest.mark.parametrize("extra,field", [
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": "2"}, "speculative_config.num_speculative_tokens"),
    ({"model": None}, "speculative_config.model"),
    ({"model": "/nonexistent/draft"}, "speculative_config.model"),
    ({"model": 3}, "speculative_config.model"),
    ({"draft_tensor_parallel_size": 2}, "speculative_config.draft_tensor_parallel_size"),
    ({"draft_kv_cache_fraction": 0}, "speculative_config.draft_kv_cache_fraction"),
    ({"draft_kv_cache_fraction": 1.5}, "speculative_config.draft_kv_cache_fraction"),
    ({"prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
    ({"method": "medusa"}, "speculative_config.method"),
    ({"draft_sampling": "nucleus"}, "speculative_config.draft_sampling"),
    ({"draft_prompt_kv": "both"}, "speculative_config.draft_prompt_kv"),
])
def test_bad_draft_config_is_refused_naming_the_field(llama_dir, extra, field):
    raw = {**draft_cfg(llama_dir), **extra}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_speculative_config(raw)


def test_draft_sampling_is_probabilistic_by_default_and_only_for_model_methods(llama_dir):
    assert parse_speculative_config(draft_cfg(llama_dir)).draft_sampling == "probabilistic"
    assert parse_speculative_config(draft_cfg(llama_dir, draft_sampling="greedy")).draft_sampling == "greedy"
    with pytest.raises(ConfigError, match=r"speculative_config\.draft_sampling is for methods"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "draft_sampling": "greedy"})


def test_the_method_is_inferred_as_vllm_does(llama_dir, tmp_path):
    cfg = parse_speculative_config({"model": llama_dir, "num_speculative_tokens": 2})
    assert cfg is not None and (cfg.method, cfg.model) == ("draft_model", llama_dir)
    cfg = parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2})
    assert cfg is not None and (cfg.method, cfg.model) == ("ngram", None)
    with pytest.raises(ConfigError, match=r"speculative_config\.model .*not 'ngram'"):
        parse_speculative_config({"method": "ngram", "model": llama_dir, "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"speculative_config\.model='.*' is not a model.*config\.json is missing"):
        parse_speculative_config(draft_cfg(str(tmp_path)))  # a directory, but no model in it


def test_the_engine_refuses_a_draft_of_another_vocabulary_before_loading(llama_dir, tmp_path):
    other = make_model(str(tmp_path / "v"), ModelSpec(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1,
                                                      intermediate_size=64, vocab_size=32016))
    with pytest.raises(ConfigError, match=r"speculative_config\.model=.*vocab_size 32016 is not the target "
                                          r"model's 32000"):
        LLM(llama_dir, speculative_config=draft_cfg(other))


def test_a_remote_requests_draft_reservation_moves_with_the_targets(llama_dir):
    """``draft_prompt_kv: prefill``: a remote request's reservation holds blocks of the draft's
    pool for every prompt position beside the target's; a quarantine (abort, a new attempt, a
    fallback that keeps the blocks) takes them too, `free` gives both back; a fallback that does
    not quarantine releases them; and a request whose notice says no draft KV was written gives
    them back and has its draft compute the prompt, with output unchanged."""
    from pdserve.engine import LLMEngine
    from pdserve.engine.config import EngineConfig

    eng = LLMEngine(EngineConfig.from_kwargs(llama_dir, speculative_config=draft_cfg(llama_dir,
                                                                                     draft_prompt_kv="prefill")))
    try:
        conn, draft = eng.connector, eng.spec.draft
        full = draft.kv.pool.num_blocks
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        prompt = prompts(1, seed=3)[0] * 3  # 60 tokens: 4 blocks of 16

        def reserve(rid: str):
            res = conn.reserve(eng.make_request(list(prompt), params, request_id=rid))
            assert res is not None and len(res.draft_block_ids) == -(-len(prompt) // 16)
            assert list(res.draft_block_ids) == draft.kv.block_ids(rid)
            return res

        reserve("a")
        assert conn.abort("a", quarantine_as="q-a")  # a late write may still land: both kept
        assert "a" not in draft.kv.tables and len(draft.kv.tables["q-a"]) == 4 and "q-a" in eng.kv.tables
        conn.free("q-a")
        assert draft.kv.num_free_blocks == full and "q-a" not in eng.kv.tables
        old = reserve("b")
        new = conn.replace("b", "q-b")  # a new attempt: fresh blocks, the old ones quarantined
        assert new is not None and set(new.draft_block_ids).isdisjoint(old.draft_block_ids)
        assert draft.kv.tables["q-b"] and draft.kv.block_ids("b") == list(new.draft_block_ids)
        conn.fall_back("b")  # no quarantine: its draft blocks go at once
        assert "b" not in draft.kv.tables
        conn.free("q-b")
        while eng.has_work():
            eng.step()
        eng.release("b")
        assert draft.kv.num_free_blocks == full
        # The target's pages "written" (not checked here: tests/e2e/test_spec_decode_pd.py), and
        # the notice says no draft KV: the reservation goes back and the draft computes the prompt.
        reserve("c")
        conn.remote_ready("c", 5, draft_tokens=0)
        assert "c" not in draft.kv.tables and "c" not in draft.seqs
        before = draft.num_tokens
        eng.step()
        assert draft.num_tokens - before >= len(prompt)  # its catch-up computed the prompt
        # The whole prompt's draft KV written: adopted, proposing goes on from there.
        reserve("d")
        conn.remote_ready("d", 5, draft_tokens=len(prompt))
        assert draft.seqs["d"].valid == len(prompt) and len(draft.kv.tables["d"]) == 4
        for rid in ("c", "d"):
            eng.abort_request(rid)
            eng.release(rid)
        assert draft.kv.num_free_blocks == full and not draft.seqs
    finally:
        eng.close()


def test_auto_ships_the_drafts_prompt_kv_only_while_other_streams_decode(llama_dir):
    """``draft_prompt_kv: auto``: a remote prompt's draft KV is asked of the prefill
    worker only when a stream decodes on this worker (computed here it would stall it); on an
    idle worker the draft computes it (`ship_prompt_kv`)."""
    from pdserve.engine import LLMEngine
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.spec_draft import ship_prompt_kv

    assert [ship_prompt_kv(m, d) for m in ("auto", "prefill", "decode") for d in (0, 1, 5)] == \
        [False, True, True, True, True, True, False, False, False]
    assert parse_speculative_config(draft_cfg(llama_dir)).draft_prompt_kv == "decode"  # (the default: opt in)
    eng = LLMEngine(EngineConfig.from_kwargs(llama_dir, speculative_config=draft_cfg(llama_dir,
                                                                                     draft_prompt_kv="auto")))
    try:
        conn, draft = eng.connector, eng.spec.draft
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        idle = conn.reserve(eng.make_request(prompts(1, seed=4)[0], params, request_id="idle"))
        assert idle is not None and idle.draft_block_ids == () and draft.prompts_kept == 1
        eng.add_request(prompts(1, seed=5)[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                        request_id="local")
        for _ in range(3):  # its prompt, then it decodes
            eng.step()
        busy = conn.reserve(eng.make_request(prompts(1, seed=6)[0], params, request_id="busy"))
        assert busy is not None and len(busy.draft_block_ids) > 0 and draft.prompts_kept == 1
    finally:
        eng.close()


def test_auto_stops_asking_while_no_prefill_worker_ships_the_drafts_kv_and_probes(llama_dir):
    """``auto`` learns from arrivals whether its prefill workers run the draft: after
    AUTO_GIVE_UP remote prompts in a row whose reserved draft blocks arrived empty it reserves
    none (the prompts' draft KV is computed here) but for one prompt in AUTO_PROBE_EVERY; one
    prompt that arrives with its draft KV has it ask for every prompt again. ``prefill`` always
    asks."""
    from pdserve.engine import LLMEngine
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.spec_ship import AUTO_GIVE_UP, AUTO_PROBE_EVERY

    eng = LLMEngine(EngineConfig.from_kwargs(llama_dir, speculative_config=draft_cfg(llama_dir,
                                                                                     draft_prompt_kv="auto")))
    try:
        conn, draft = eng.connector, eng.spec.draft
        eng.add_request(prompts(1, seed=5)[0], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                        request_id="stream")
        for _ in range(3):  # a stream decoding: auto's rule asks
            eng.step()
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = prompts(1, seed=6)[0]

        def ask(i: int, written: bool | None) -> bool:
            """One remote prompt: whether draft blocks were reserved; then its arrival, with its
            draft KV written into them or not (None: no arrival)."""
            rid = f"r{i}"
            res = conn.reserve(eng.make_request(list(prompt), params, request_id=rid))
            assert res is not None
            if written is not None:
                conn.remote_ready(rid, 5, draft_tokens=len(prompt) if written and res.draft_block_ids else 0)
            conn.abort(rid)
            eng.release(rid)
            return bool(res.draft_block_ids)

        assert all(ask(i, False) for i in range(AUTO_GIVE_UP))  # asked, never answered
        asked = [ask(100 + i, False) for i in range(2 * AUTO_PROBE_EVERY)]
        assert sum(asked) == 2 and asked[AUTO_PROBE_EVERY - 1] and asked[-1]  # a probe in 16
        assert not ask(200, None)  # (33rd since it gave up: no probe)
        probe = next(i for i in range(AUTO_PROBE_EVERY) if ask(300 + i, True))
        assert probe == AUTO_PROBE_EVERY - 2  # the 48th: a probe, answered ...
        assert all(ask(400 + i, False) for i in range(AUTO_GIVE_UP))  # ... so every prompt is asked again
        draft.prompt_kv = "prefill"
        assert all(ask(500 + i, False) for i in range(3 * AUTO_GIVE_UP))  # prefill: always
        assert draft.kv.tables.keys() <= {"stream"}
    finally:
        eng.close()
