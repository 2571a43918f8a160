"""Speculative decoding (engine/spec_decode.py, engine/spec_step.py; docs/speculative.md):
greedy output with n-gram proposals equals the output without them, token for token (with
prefix caching, chunked prefill, preemption, logprobs, stop strings, grammars and TP=2); seeded
sampling too; the verification keeps the target distribution (chi-square over many draws on
crafted probabilities, through the real sampler); rejected positions' blocks go back; bad
config is refused naming the field."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ConfigError
from pdserve.engine.driver import EngineDriver
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.spec_config import parse_speculative_config
from pdserve.engine.spec_decode import SpecDecoder, emitted_tokens, ngram_propose, verify_draft_probs
from pdserve.engine.spec_step import draft_view

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    """Half repetitive (a phrase said again and again: proposals get accepted), half random."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, 900) for _ in range(rng.randrange(3, 10))]
        out.append(phrase * rng.randrange(2, 6) if i % 2 == 0 else [rng.randrange(3, 900) for _ in range(20)])
    return out


def run(llm: LLM, ps, params) -> list:
    return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(ps, params)]


@pytest.fixture(scope="module")
def plain(llama_dir):
    with LLM(llama_dir, seed=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec(llama_dir):
    with LLM(llama_dir, seed=0, speculative_config=NGRAM) as llm:
        yield llm


def test_greedy_equals_no_speculation_and_proposals_are_accepted(plain, spec):
    ps = prompts()
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    before = spec.engine.stats.num_spec_accepted_tokens
    assert run(spec, ps, params) == run(plain, ps, params)
    stats = spec.engine.stats
    assert stats.num_spec_accepted_tokens - before > 50  # speculation did happen, and paid
    assert stats.num_spec_draft_tokens >= stats.num_spec_accepted_tokens
    per = stats.spec_accepted_per_position
    assert len(per) == 4 and per[0] >= per[1] >= per[2] >= per[3] and sum(per) == stats.num_spec_accepted_tokens
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.pool.num_blocks  # nothing held after


def test_a_verifying_step_counts_as_decode_work(spec):
    """The step figures the cost model reads (engine/driver.py StepInfo): proposals verified
    are decode work (no prompt tokens, no attention pairs), and the tokens a stream got from
    the step count the accepted ones (the TPOT a speculating stream sees)."""
    eng = spec.engine
    driver = EngineDriver(eng)
    for i in range(2):
        eng.add_request([17 + i, 230, 41, 5, 88 + i] * 6, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                        request_id=f"acct-{i}")
    infos = []
    for _ in range(200):
        if not eng.has_work():
            break
        _, info = driver.step()
        if info is not None:
            infos.append(info)
    assert not eng.has_work()
    verifying = [i for i in infos if i.draft_tokens]
    assert verifying, "no step verified proposals: the accounting went unexercised"
    for info in verifying:
        assert info.num_decode_seqs == info.num_seqs and info.prefill_tokens == 0 and info.prefill_pairs == 0
        assert info.num_tokens == info.num_seqs + info.draft_tokens and 0 <= info.accepted_tokens <= info.draft_tokens
    assert any(i.emitted_per_stream > 1.0 for i in verifying)
    assert sum(i.accepted_tokens for i in infos) + sum(i.num_decode_seqs for i in infos) + 2 == 80
    assert infos[0].prefill_tokens == 60 and infos[0].draft_tokens == 0  # the prompts: prompt work


def test_logprobs_stop_strings_and_max_tokens_hold(plain, spec):
    ps = prompts(8, seed=1)
    want = plain.generate(ps, SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, ignore_eos=True))
    stops = [o.text[len(o.text) // 2:len(o.text) // 2 + 3] for o in want]  # some stop mid-way
    params = [SamplingParams(max_tokens=7 + i, temperature=0.0, logprobs=2, ignore_eos=True, stop=[s] if i % 2 else [])
              for i, s in enumerate(stops)]
    a, b = plain.generate(ps, params), spec.generate(ps, params)
    for x, y in zip(a, b):
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                         y.stop_reason)
        assert len(y.logprobs) == len(y.token_ids)
        for ex, ey in zip(x.logprobs, y.logprobs):
            assert ex["token_id"] == ey["token_id"] and set(ex["top_logprobs"]) == set(ey["top_logprobs"])
            assert ex["logprob"] == pytest.approx(ey["logprob"], abs=1e-4)
    assert {o.finish_reason for o in b} == {"stop", "length"}


def test_penalties_and_bad_words_see_the_proposals_before_them(plain, spec):
    ps = prompts(6, seed=2)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, min_tokens=20, logit_bias={7: 3.0})] * 2
    assert run(spec, ps, params) == run(plain, ps, params)


def test_seeded_sampling_equals_no_speculation_and_repeats(plain, spec):
    ps = prompts(4, seed=3) * 2  # the same prompt twice: n > 1 (different seeds)
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=0.9 if i % 3 else 1.0, top_k=20 if i % 4 == 1 else 0,
                             seed=100 + i, ignore_eos=True) for i, t in enumerate([1e-4, 0.05, 0.7, 1.5] * 2)]
    before = spec.engine.stats.num_spec_accepted_tokens
    first = run(spec, ps, params)
    assert first == run(spec, ps, params)
    assert first == run(plain, ps, params)
    assert spec.engine.stats.num_spec_accepted_tokens > before  # (the random tiny model is nearly flat: 1e-4 accepts)


def test_prefix_caching_chunked_prefill_and_preemption(llama_dir, plain):
    ps = prompts(12, seed=4)
    ps = ps + [p + [5, 6, 7] for p in ps[:4]]  # shared prefixes
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = run(plain, ps, params)
    with LLM(llama_dir, seed=0, speculative_config=NGRAM, max_num_batched_tokens=24, block_size=4,
             num_gpu_blocks_override=48) as llm:
        assert run(llm, ps, params) == want
        assert run(llm, ps, params) == want  # again, now from the prefix cache
        stats = llm.engine.stats
        assert stats.num_preemptions > 0 and stats.num_prompt_tokens_cached > 0 and stats.num_spec_accepted_tokens > 0
        assert llm.engine.kv.num_free_blocks == 48


def test_rejected_positions_give_their_blocks_back(llama_dir):
    with LLM(llama_dir, seed=0, block_size=4, speculative_config=NGRAM) as llm:
        eng = llm.engine
        reqs = [eng.add_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
                for p in prompts(6, seed=5)]
        while eng.has_unfinished():
            for d in eng.step():
                if d.finished:
                    eng.release(d.request_id)
            for r in reqs:
                if r.finish_reason is None and r.output_token_ids:
                    assert len(eng.kv.tables[r.request_id]) == -(-r.num_computed_tokens // 4)
                    assert r.num_computed_tokens == r.num_tokens - 1
        assert eng.stats.num_spec_draft_tokens > eng.stats.num_spec_accepted_tokens > 0  # some were rejected


def test_structured_outputs_equal_no_speculation(plain, spec):
    grammars = [{"regex": r"(ab|cd)( (ab|cd)){10,30}"}, {"choice": ["alpha beta alpha beta", "gamma"]},
                {"json": {"type": "array", "items": {"enum": ["x", "yz"]}, "minItems": 6, "maxItems": 12},
                 "disable_any_whitespace": True}]
    ps = prompts(6, seed=6)
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=g) for g in grammars * 2]
    before = spec.engine.stats.num_spec_accepted_tokens
    got = run(spec, ps, params)
    assert got == run(plain, ps, params)
    assert sum(reason == "stop" for _, _, reason in got) >= 4
    assert spec.engine.stats.num_spec_accepted_tokens > before


def test_tensor_parallel_two_ranks(model_dirs):
    ps = prompts(8, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(model_dirs("qwen2")) as llm:
        want = run(llm, ps, params)
    with LLM(model_dirs("qwen2"), tensor_parallel_size=2, tp_comm="gloo", speculative_config=NGRAM) as llm:
        assert run(llm, ps, params) == want
        assert llm.engine.stats.num_spec_accepted_tokens > 0


def test_proposals_are_dropped_before_anyone_is_preempted():
    from pdserve.engine.block_manager import KVCacheManager
    from pdserve.engine.request import RequestStatus
    from pdserve.engine.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=False)
    sch = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = (Request(rid, [1, 2], SamplingParams()) for rid in "ab")
    for r in (a, b):
        r.output_token_ids, r.num_computed_tokens, r.status = [4], 2, RequestStatus.RUNNING
        assert kv.allocate(r.request_id, 2)
        sch.running.append(r)
    a.spec_token_ids = [5, 6, 7, 8]  # 1 + 4 positions would need a block the pool does not have
    plan = sch.schedule()
    assert plan.preempted == [] and plan.scheduled == [(a, 1), (b, 1)] and a.spec_token_ids == []
    b.spec_token_ids = [5]  # this one fits: positions 2 and 3, in its block
    assert sch.schedule().scheduled == [(a, 1), (b, 2)]


# -- the verification's distribution ------------------------------------------------------

# chi-square critical values at p = 0.001 (degrees of freedom -> value), from the table
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_verification_keeps_the_target_distribution():
    """Two positions, a proposal at each: the first emitted token is distributed as p0 (the
    proposal accepted with probability p0[d0], else a token of p0 without d0), and the second,
    given the first proposal was accepted, as p1; through the real sampler's draws."""
    p0 = [0.4, 0.25, 0.2, 0.1, 0.05, 0.0]
    p1 = [0.1, 0.3, 0.3, 0.2, 0.1, 0.0]
    drafts = [1, 2]
    logits = torch.log(torch.tensor([p0, p1, p1], dtype=torch.float32))
    req = Request("r", [3, 4], SamplingParams(temperature=1.0))
    views = [draft_view(req, drafts[:j]) for j in range(3)]
    sampler = Sampler(seed=1234)
    n, batch = 20000, 1000  # a batch of verifications per sampler call
    rows, first, second, accepted, residual = [], [0] * 6, [0] * 6, 0, [0] * 6
    for _ in range(n // batch):
        tokens = [r.token_id for r in sampler(logits.repeat(batch, 1), views * batch)]
        rows += [tokens[3 * i:3 * i + 3] for i in range(batch)]
    for sampled in rows:
        out = emitted_tokens(drafts, sampled)
        first[out[0]] += 1
        if len(out) > 1:
            accepted += 1
            second[out[1]] += 1
        else:
            residual[out[0]] += 1
    assert first[5] == 0 and second[5] == 0
    assert chi_square(first, p0) < CHI2_999[4]
    assert chi_square(second, p1) < CHI2_999[4]
    assert abs(accepted / n - p0[1]) < 4 * (p0[1] * (1 - p0[1]) / n) ** 0.5
    rest = [0.0 if i == drafts[0] else p / (1 - p0[1]) for i, p in enumerate(p0)]  # max(0, p - q), normalised
    assert residual[drafts[0]] == 0 and chi_square(residual, rest) < CHI2_999[3]


def test_verification_with_the_drafts_distributions_keeps_the_target_distribution():
    """Proposals drawn from q and verified with it (`verify_draft_probs`): each emitted token
    is distributed as the target's row at its position (p0, p1, then p2 after both proposals),
    the first proposal is accepted with probability sum min(p0, q0), and a token q proposes but
    p never gives (5) is never emitted. Accepting every proposal would emit q instead: the
    same check tells that apart."""
    p = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05, 0.0], [0.1, 0.3, 0.3, 0.2, 0.1, 0.0],
                      [0.3, 0.1, 0.1, 0.2, 0.3, 0.0]])
    q = torch.tensor([[0.1, 0.4, 0.1, 0.2, 0.1, 0.1], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
    rng, gen, n = random.Random(3), torch.Generator().manual_seed(4), 10000
    at = [[0] * 6 for _ in range(3)]
    proposed_first, accepted = [0] * 6, 0
    for _ in range(n):
        drafts = [rng.choices(range(6), q[j].tolist())[0] for j in range(2)]
        proposed_first[drafts[0]] += 1
        out = verify_draft_probs(p, q, drafts, gen)
        assert None not in out and 1 <= len(out) <= 3 and out[:len(out) - 1] == drafts[:len(out) - 1]
        accepted += len(out) > 1
        for j, t in enumerate(out):
            at[j][t] += 1
    assert at[0][5] == at[1][5] == at[2][5] == 0
    for j in range(3):
        assert sum(at[j]) > 1000 and chi_square(at[j][:5], p[j, :5].tolist()) < CHI2_999[4], (j, at[j])
    overlap = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted / n - overlap) < 4 * (overlap * (1 - overlap) / n) ** 0.5
    assert chi_square(proposed_first[:5], p[0, :5].tolist()) > CHI2_999[4]


def test_the_check_can_fail():
    """The chi-square above tells a wrong distribution from the right one at this sample size."""
    rng = random.Random(0)
    wrong = [0.3, 0.35, 0.2, 0.1, 0.05]
    counts = [0] * 5
    for _ in range(20000):
        counts[rng.choices(range(5), wrong)[0]] += 1
    assert chi_square(counts, [0.4, 0.25, 0.2, 0.1, 0.05]) > CHI2_999[4]


def test_each_row_sees_the_proposals_before_it():
    """Penalties and min_tokens of row j count the first j proposals as generated."""
    logits = torch.zeros(3, 16)
    logits[:, 5] = 1.0  # token 5 leads by 1; a frequency penalty of 2 per occurrence undoes that
    req = Request("r", [1, 2], SamplingParams(temperature=0.0, frequency_penalty=2.0))
    req.output_token_ids = [9]
    rows = Sampler()(logits, [draft_view(req, [5, 5][:j]) for j in range(3)])
    assert [r.token_id for r in rows] == [5, 0, 0]
    req = Request("r", [1, 2], SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]))
    req.output_token_ids = [9]
    rows = Sampler()(logits, [draft_view(req, [7, 7][:j]) for j in range(3)])
    assert [r.token_id for r in rows] == [0, 0, 5]  # the stop token is allowed from the third token on


# -- the proposer, the load rule, the config ----------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_propose(toks, 1, 3, 2) == [7, 8]  # the latest earlier [1, 2, 3]
    assert ngram_propose(toks, 1, 3, 4) == [7, 8, 5, 1]  # (the latest one with 4 tokens after it)
    assert ngram_propose(toks[:-1] + [9, 1, 2, 3], 3, 3, 6) == [7, 8, 5, 1, 2, 9]  # the latest one with 6 after it
    assert ngram_propose([4, 5, 6, 4, 5], 2, 2, 3) == [6, 4, 5]
    assert ngram_propose([4, 5, 6, 7], 1, 3, 3) == []  # 7 never came before
    assert ngram_propose([4, 5, 6, 7, 5, 6], 3, 4, 3) == []  # no match of length >= 3
    # a short period: the continuation is copied over itself (the lookup repeated per token)
    assert ngram_propose([1, 1, 1], 1, 2, 4) == [1, 1, 1, 1]
    assert ngram_propose([5, 6, 5, 6], 2, 2, 4) == [5, 6, 5, 6]
    assert ngram_propose([7, 5, 6, 5, 6], 2, 2, 3) == [5, 6, 5]


def test_load_rule_batch_size_and_acceptance_floor():
    cfg = parse_speculative_config({**NGRAM, "disable_by_batch_size": 4, "acceptance_floor": 0.3,
                                    "probe_interval": 3})
    assert cfg is not None
    dec = SpecDecoder(cfg, max_model_len=1000)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=100))
    req.output_token_ids = [4]
    assert dec.k_for(req, 4) == 4 and dec.k_for(req, 5) == 0
    from pdserve.engine.engine_types import EngineStats
    stats = EngineStats()
    dec.record(req, 4, 0, stats)  # rate 0.5
    assert dec.k_for(req, 1) == 4
    dec.record(req, 4, 0, stats)  # rate 0.25 < 0.3: three steps without proposals, then a probe
    assert [dec.k_for(req, 1) for _ in range(4)] == [0, 0, 0, 4]
    req.params.max_tokens = 3  # two tokens left: one proposal at most
    assert dec.k_for(req, 1) == 1
    assert stats.num_spec_draft_tokens == 8 and stats.spec_accepted_per_position == [0, 0, 0, 0]


@pytest.mark.parametrize("raw,field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "suffix", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "medusa2", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min"),
    ({"num_speculative_tokens": 3, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
    ({"num_speculative_tokens": 3, "acceptance_floor": 2}, "speculative_config.acceptance_floor"),
    ({"num_speculative_tokens": 3, "draft_model": "x"}, "speculative_config.draft_model"),
    ({"num_speculative_tokens": 3, "draft_prompt_kv": "prefill"}, "speculative_config.draft_prompt_kv"),
    ("{not json", "speculative_config"),
    ([1], "speculative_config"),
])
def test_bad_config_is_refused_naming_the_field(raw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_speculative_config(raw)


def test_the_topology_checks_speculative_config_where_it_is_loaded(tmp_path):
    """`pdserve up` refuses a bad speculative_config before starting anything, naming the
    field; a draft model's directory is the workers' (read when each starts), not read here."""
    from pdserve.cluster.topology import TopologyError, load_topology
    from tests.cluster.test_topology import TP, write

    def topo(pe: str, de: str):
        return load_topology(write(tmp_path, TP.format(p=1, d=1, pe=pe, de=de)))

    ngram = topo("{}", '{speculative_config: {method: ngram, num_speculative_tokens: 4}}')
    assert ngram.engine_args("decode")["speculative_config"]["num_speculative_tokens"] == 4
    topo("{}", '{speculative_config: {model: /on/the/workers/draft, num_speculative_tokens: 3}}')
    with pytest.raises(TopologyError, match=r"roles\.decode\.engine\.speculative_config\.num_speculative_tokens"):
        topo("{}", '{speculative_config: {method: ngram, num_speculative_tokens: 0}}')
    with pytest.raises(TopologyError, match=r"roles\.decode\.engine\.speculative_config\.method"):
        topo("{}", '{speculative_config: {method: medusa, num_speculative_tokens: 3}}')
    with pytest.raises(TopologyError, match=r"roles\.prefill\.engine\.speculative_config: prefill workers"):
        topo('{speculative_config: {method: ngram, num_speculative_tokens: 4}}', "{}")
    # The decode workers' draft model on the prefill workers: they compute its prompt KV.
    draft = '{speculative_config: {model: /on/the/workers/draft, num_speculative_tokens: 3, draft_prompt_kv: auto}}'
    assert topo(draft, draft).engine_args("prefill")["speculative_config"]["num_speculative_tokens"] == 3
    with pytest.raises(TopologyError, match=r"roles\.prefill\.engine\.speculative_config: prefill workers"):
        topo('{speculative_config: {model: /d, num_speculative_tokens: 3}}', "{}")  # (draft_prompt_kv: decode)
    # An EAGLE head or MTP layer likewise: the prefill workers compute the head's rows of each prompt.
    for method, head in (("eagle3", "method: eagle3, model: /on/the/workers/head"), ("mtp", "method: mtp")):
        raw = '{speculative_config: {' + head + ', num_speculative_tokens: 3, draft_prompt_kv: prefill}}'
        assert topo(raw, raw).engine_args("prefill")["speculative_config"]["method"] == method
    with pytest.raises(TopologyError, match=r"roles\.prefill\.engine\.speculative_config\.draft_prompt_kv"):
        topo('{speculative_config: {model: /d, num_speculative_tokens: 3, draft_prompt_kv: both}}', "{}")


def test_the_engine_refuses_bad_config_before_loading(llama_dir):
    with pytest.raises(ConfigError, match=r"speculative_config\.method='medusa' \(not supported yet\)"):
        LLM(llama_dir, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"speculative_config\.method='mtp': the target model is llama"):
        LLM(llama_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    cfg = parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert cfg is not None and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)  # one sets both (vLLM)


def test_serve_decode_refuses_bad_speculative_config_before_starting(tmp_path):
    import argparse
    import logging

    from pdserve.decode import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve-decode", "--model", str(tmp_path), "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 99}'])
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with pytest.raises(ConfigError, match=r"speculative_config\.num_speculative_tokens=99"):
            cli._serve(args)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
