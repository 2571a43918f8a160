"""Structured outputs in the engine (engine/structured.py, engine/structured_state.py): every
grammar kind yields output of its grammar; a constrained row never samples a token its mask
refuses; bad grammars are refused by name at the edge; a slow compile holds back only its own
request; preemption, siblings, seeded sampling and a first token sampled on another engine
give exactly the one-engine tokens."""

from __future__ import annotations

import json
import random
import re
import threading

import pytest
import torch

from pdserve.engine import LLM, InvalidRequestError, SamplingParams, parse_structured_outputs
from pdserve.engine.structured import choice_grammar, xgrammar_reason
from pdserve.kvtransfer import PrefillTask
from pdserve.prefill.batch import PrefillBatch
from pdserve.prefill.values import PrefillStats

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                    "maxItems": 2},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "tags", "n"]}
GRAMMAR = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c]{1,3}'
LARK = 'start: "<" WORD ">"\nWORD: /[xyz]{1,4}/'
TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "ok:"}, {"type": "json_schema", "json_schema": {"enum": ["a", "b"]}}]}}
KINDS = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "json_str": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True},
    "regex": {"regex": r"[a-z]{2,8}-[0-9]{1,3}"},
    "choice": {"choice": ["alpha", "beta", "gamma delta", 'quote"d']},
    "grammar": {"grammar": GRAMMAR},
    "lark": {"grammar": LARK},
    "structural_tag": {"structural_tag": json.dumps(TAG)},
    "json_object": {"json_object": True, "disable_any_whitespace": True},
}


def holds(spec: dict, text: str) -> bool:
    """``text`` is a complete sentence of the grammar ``spec`` describes."""
    if "json" in spec:
        v = json.loads(text)
        return (set(v) == {"name", "tags", "n"} and isinstance(v["name"], str) and len(v["name"]) <= 6
                and isinstance(v["tags"], list) and len(v["tags"]) <= 2
                and all(isinstance(t, str) and len(t) <= 3 for t in v["tags"])
                and type(v["n"]) is int and 0 <= v["n"] <= 99)
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    if "choice" in spec:
        return text in spec["choice"]
    if "grammar" in spec:
        patterns = {GRAMMAR: r"\([a-c]{1,3}(,[a-c]{1,3}){0,3}\)", LARK: r"<[xyz]{1,4}>"}
        pattern = patterns.get(spec["grammar"], r"[0-9]{40}\.")
        return re.fullmatch(pattern, text) is not None
    if "structural_tag" in spec:
        return text in ('ok:"a"', 'ok:"b"')
    return isinstance(json.loads(text), dict)


def prompts(n: int, seed: int = 0, length: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir, max_model_len=512) as llm:
        yield llm


def assert_masked_path(eng, spec: dict, tokens: list[int]) -> None:
    """Every token was allowed by the grammar when it was sampled (a fresh matcher, step by step)."""
    import xgrammar as xgr

    compiled = eng.grammars.compile(parse_structured_outputs(spec))
    m = xgr.GrammarMatcher(compiled)
    bm = xgr.allocate_token_bitmask(1, eng.model_config.vocab_size)
    for i, t in enumerate(tokens):
        m.fill_next_token_bitmask(bm)
        assert (int(bm[0, t // 32]) >> (t % 32)) & 1, f"token {i} ({t}) was masked by the grammar"
        assert m.accept_token(t)


def no_leak(eng) -> None:
    assert not eng.requests and eng.kv.tables == {}
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    assert not eng.structured.pending


# -- every kind -------------------------------------------------------------------------------
def test_every_kind_yields_a_sentence_of_its_grammar(llm):
    names = list(KINDS)
    specs = [KINDS[k] for k in names]
    ps = prompts(len(specs), seed=1)
    greedy = [SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=s) for s in specs]
    seeded = [SamplingParams(max_tokens=96, temperature=1.0, seed=7 + i, structured_outputs=s)
              for i, s in enumerate(specs)]
    outs = llm.generate(ps + ps, greedy + seeded)
    for name, spec, o in zip(names + names, specs + specs, outs):
        assert_masked_path(llm.engine, spec, o.token_ids)
        if name == "json_object" and o.finish_reason == "length":
            continue  # any object: a random model may not close it within max_tokens (a prefix of one)
        assert o.finish_reason == "stop", (name, o.text, o.finish_reason)
        assert holds(spec, o.text), (name, o.text)
        assert o.stop_reason in llm.engine.eos_token_ids  # the grammar ended, then EOS was its only token
    no_leak(llm.engine)


def test_unconstrained_rows_beside_constrained_ones_are_untouched(llm):
    """The mask goes on the constrained rows only: a free request's tokens are those it gets alone."""
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ps = prompts(3, seed=2)
    alone = llm.generate([ps[0]], free)[0].token_ids
    mixed = llm.generate(ps, [SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=KINDS["regex"]),
                              free, SamplingParams(max_tokens=12, temperature=0.0,
                                                   structured_outputs=KINDS["choice"])])
    assert llm.generate([ps[1]], free)[0].token_ids == mixed[1].token_ids
    assert llm.generate([ps[0]], free)[0].token_ids == alone


def test_sampled_rows_never_take_a_masked_token_and_logprobs_are_constrained(llm):
    """High-temperature draws stay inside the mask, and the logprobs reported are those of the
    constrained distribution: the alternatives are allowed tokens, and a token the grammar
    allows alone (EOS once the grammar is complete) has probability 1."""
    import xgrammar as xgr

    specs = [{"regex": r"(yes|no|maybe)( (yes|no|maybe)){0,3}"}] * 4 + [{"choice": ["yes", "no way"]}] * 2
    ps = prompts(6, seed=3)
    params = [SamplingParams(max_tokens=40, temperature=1.5, seed=100 + i, logprobs=3, structured_outputs=spec)
              for i, spec in enumerate(specs)]
    eng = llm.engine
    bm = xgr.allocate_token_bitmask(1, eng.model_config.vocab_size)
    for spec, o in zip(specs, llm.generate(ps, params)):
        assert o.finish_reason == "stop" and holds(spec, o.text), o.text
        assert_masked_path(eng, spec, o.token_ids)
        m = xgr.GrammarMatcher(eng.grammars.compile(parse_structured_outputs(spec)))
        for t, entry in zip(o.token_ids, o.logprobs):
            m.fill_next_token_bitmask(bm)
            bits = (bm[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
            allowed = set(bits.flatten()[:eng.model_config.vocab_size].nonzero().flatten().tolist())
            finite = {k: v for k, v in entry["top_logprobs"].items() if v > float("-inf")}
            assert set(finite) <= allowed and entry["logprob"] > float("-inf")
            if len(allowed) <= 3:  # the top 3 are every allowed token: their mass is all of it
                assert abs(sum(torch.tensor(list(finite.values())).exp().tolist()) - 1.0) < 1e-3
            m.accept_token(t)
        assert o.token_ids[-1] in eng.eos_token_ids
        if "choice" in spec:  # a complete choice allows EOS alone
            assert abs(o.logprobs[-1]["logprob"]) < 1e-4


def test_stop_strings_and_length_cut_the_output_as_without_a_grammar(llm):
    """A stop string or max_tokens may end the output before the grammar does (vLLM's behaviour)."""
    p = prompts(1, seed=4)[0]
    cut = llm.generate([p], SamplingParams(max_tokens=3, temperature=0.0, structured_outputs=KINDS["json"]))[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith("{")
    stopped = llm.generate([p], SamplingParams(max_tokens=64, temperature=0.0, stop=['"name"'],
                                               structured_outputs=KINDS["json"]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"name"' and stopped.text == "{"


# -- the edge check -------------------------------------------------------------------------
@pytest.mark.parametrize("field,spec", [
    ("structured_outputs.json", {"json": {"type": 5}}),
    ("structured_outputs.json", {"json": {"type": "integer", "minimum": 5, "maximum": 2}}),
    ("structured_outputs.json", {"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}),
    ("structured_outputs.json", {"json": "{not json"}),
    ("structured_outputs.json", {"json": "[1, 2]"}),
    ("structured_outputs.json", {"json": 7}),
    ("structured_outputs.regex", {"regex": "(ab"}),
    ("structured_outputs.regex", {"regex": ""}),
    ("structured_outputs.grammar", {"grammar": "root ::= foo"}),
    ("structured_outputs.grammar", {"grammar": "start: undefined_rule"}),
    ("structured_outputs.choice", {"choice": []}),
    ("structured_outputs.choice", {"choice": ["a", 3]}),
    ("structured_outputs.json_object", {"json_object": "yes"}),
    ("structured_outputs.structural_tag", {"structural_tag": '{"bad": 1}'}),
    ("structured_outputs.structural_tag", {"structural_tag": "nope"}),
    ("structured_outputs", {"json": {"type": "object"}, "regex": "a"}),
    ("structured_outputs", {}),
    ("structured_outputs", {"json_object": False}),
    ("structured_outputs", ["json"]),
    ("structured_outputs.jsn", {"jsn": {}}),
    ("structured_outputs.disable_any_whitespace", {"json_object": True, "disable_any_whitespace": "no"}),
    ("structured_outputs.whitespace_pattern", {"json_object": True, "whitespace_pattern": r"[ ]?"}),
    ("structured_outputs.regex", {"regex": "a" * ((1 << 17) + 1)}),
    ("structured_outputs.choice", {"choice": ["a"] * 1025}),
    ("structured_outputs.regex", {"regex": "\ud800"}),
])
def test_a_bad_grammar_is_refused_by_name_before_it_is_queued(llm, field, spec):
    eng = llm.engine
    with pytest.raises(InvalidRequestError) as err:
        eng.validate_input([5, 6, 7], SamplingParams(structured_outputs=spec))
    assert err.value.field == field, str(err.value)
    assert "/project/" not in str(err.value) and ".cc:" not in str(err.value)  # xgrammar's C++ prefix is gone
    assert not eng.requests


def test_a_grammar_that_fails_in_the_engine_ends_its_request_alone(llm):
    """make_request does not compile on the engine thread: a bad grammar that got past the edge
    ends its request with an error naming the field; the others run; nothing leaks."""
    eng = llm.engine
    ps = prompts(2, seed=5)
    bad = eng.add_request(ps[0], SamplingParams(max_tokens=8, structured_outputs={"regex": "[z-a]"}))
    ok = eng.add_request(ps[1], SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=KINDS["choice"]))
    deltas = []
    for _ in range(200):
        deltas += eng.step()
        if bad.finish_reason and ok.finish_reason:
            break
    errors = [d for d in deltas if d.request_id == bad.request_id and d.finish_reason == "error"]
    assert len(errors) == 1 and "structured_outputs.regex" in errors[0].error
    assert ok.finish_reason == "stop"
    eng.release(bad.request_id)
    eng.release(ok.request_id)
    no_leak(eng)


def test_the_cache_counts_hits_misses_and_errors(llm):
    eng = llm.engine
    before = eng.grammar_stats()
    spec = {"regex": r"cache-[0-9]{3}"}
    eng.validate_input([5], SamplingParams(structured_outputs=spec))
    eng.validate_input([5], SamplingParams(structured_outputs=dict(spec)))
    with pytest.raises(InvalidRequestError):
        eng.validate_input([5], SamplingParams(structured_outputs={"regex": "(("}))
    after = eng.grammar_stats()
    assert after["misses"] - before["misses"] == 2 and after["hits"] - before["hits"] == 1
    assert after["compile_errors"] - before["compile_errors"] == 1
    assert after["entries"] >= 1 and after["bytes"] > 0 and after["compile_seconds"] > 0
    # the same schema as a dict or as a JSON string is one entry; its keys' order is part of it
    # (properties are generated in the order the schema lists them)
    a = parse_structured_outputs({"json": {"b": 1, "a": [2]}})
    b = parse_structured_outputs({"json": '{"b": 1,  "a": [2]}'})
    c = parse_structured_outputs({"json": '{"a": [2], "b": 1}'})
    assert a is not None and b is not None and c is not None and a.key == b.key != c.key


def test_a_grammar_compiled_for_this_request_tells_the_router_its_compile_time_once(llm):
    """`fresh_compile_ms`: the edge's compile of a grammar new here (the router adds it to a
    remote prefill's prediction); once anything asks for the grammar again, it is cached: 0."""
    eng = llm.engine
    spec = parse_structured_outputs({"regex": r"fresh-[0-9]{4}"})
    assert spec is not None and eng.grammars.fresh_compile_ms(spec) == 0.0  # never compiled
    eng.validate_input([5], SamplingParams(structured_outputs={"regex": r"fresh-[0-9]{4}"}))
    first = eng.grammars.fresh_compile_ms(spec)
    assert first > 0.0 and eng.grammars.fresh_compile_ms(spec) == first  # reading it changes nothing
    eng.validate_input([5], SamplingParams(structured_outputs={"regex": r"fresh-[0-9]{4}"}))  # a cache hit
    assert eng.grammars.fresh_compile_ms(spec) == 0.0


def test_cache_bounds_evict_least_recently_used(llama_dir):
    with LLM(llama_dir, max_model_len=128, structured_outputs_cache_entries=2) as small:
        eng = small.engine
        for i in range(4):
            eng.validate_input([5], SamplingParams(structured_outputs={"regex": f"e{i}[0-9]"}))
        s = eng.grammar_stats()
        assert s["entries"] == 2 and s["evictions"] == 2 and s["misses"] == 4


def test_choice_grammar_escapes_and_reasons_lose_their_prefix():
    assert choice_grammar(['a"b', "c\\d", "e\nf"]) == 'root ::= "a\\"b" | "c\\\\d" | "e\\x0af"'
    assert xgrammar_reason(RuntimeError("[11:47:32] /project/cpp/regex_converter.cc:94: Regex parsing error"))\
        == "Regex parsing error"


# -- a slow compile ---------------------------------------------------------------------------
def test_a_request_waiting_for_its_grammar_does_not_hold_back_the_others(llama_dir):
    with LLM(llama_dir, max_model_len=256, structured_outputs_timeout_s=30.0) as slow_llm:
        eng = slow_llm.engine
        gate = threading.Event()
        slow_spec = {"regex": r"slow-[0-9]{2}"}
        eng.grammars.before_compile = lambda spec: gate.wait(20) if spec.source == slow_spec["regex"] else None
        ps = prompts(2, seed=6)
        slow = eng.add_request(ps[0], SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=slow_spec))
        free = eng.add_request(ps[1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        for _ in range(100):
            eng.step()
            if free.finish_reason:
                break
        assert free.finish_reason == "length"
        assert slow.first_scheduled_time is None and slow.grammar is not None and not slow.grammar.ready
        assert slow.request_id not in eng.kv.tables  # not admitted: no blocks
        eng.release(free.request_id)
        gate.set()
        for _ in range(200):
            eng.step()
            if slow.finish_reason:
                break
        assert slow.finish_reason == "stop" and holds(slow_spec, eng.release(slow.request_id).text)
        no_leak(eng)


def test_a_grammar_past_its_time_bound_fails_its_request_without_leaks(llama_dir):
    with LLM(llama_dir, max_model_len=256, structured_outputs_timeout_s=0.3) as t_llm:
        eng = t_llm.engine
        gate = threading.Event()
        eng.grammars.before_compile = lambda spec: gate.wait(20)
        try:
            with pytest.raises(InvalidRequestError, match="did not compile within 0.3 s") as err:
                eng.validate_input([5, 6], SamplingParams(structured_outputs={"regex": "edge-[0-9]"}))
            assert err.value.field == "structured_outputs"
            req = eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, structured_outputs={"regex": "t[0-9]"}))
            deltas = []
            for _ in range(100):
                deltas += eng.step()
                if req.finish_reason:
                    break
            assert [d.finish_reason for d in deltas] == ["error"] and "did not compile" in deltas[0].error
            eng.release(req.request_id)
            no_leak(eng)
            assert eng.grammar_stats()["timeouts"] == 2
        finally:
            gate.set()


# -- preemption, siblings, seeds, resumption ---------------------------------------------------
def test_preemption_keeps_the_matcher_and_the_tokens(llama_dir):
    """Preemption recomputes a request's KV and keeps its output tokens, so its matcher stays
    where it was: the tokens are those of an engine with room for every request."""
    ps = prompts(4, seed=8, length=30)
    specs = [{"regex": r"[0-9]{40}"}, {"regex": r"[0-9]{36}x"}, {"choice": ["1" * 38, "2" * 38]},
             {"grammar": 'root ::= [0-9]{40} "."'}]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=s) for s in specs]
    with LLM(llama_dir, enable_prefix_caching=False, max_model_len=256) as ref_llm:
        ref = ref_llm.generate(ps, params)
    # 10 blocks of 16 tokens hold the four prompts, not their 40-token outputs as well
    with LLM(llama_dir, num_gpu_blocks_override=10, max_model_len=128) as tight:
        outs = tight.generate(ps, params)
        assert tight.engine.stats.num_preemptions > 0
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        for spec, o in zip(specs, outs):
            assert o.finish_reason == "stop" and holds(spec, o.text), o.text
        no_leak(tight.engine)


def test_siblings_have_their_own_matchers_and_seeds_reproduce(llm):
    spec = KINDS["json"]
    p = prompts(1, seed=9)[0]
    same = SamplingParams(max_tokens=96, temperature=1.0, seed=42, structured_outputs=spec)
    outs = llm.generate([p] * 4, [same, same, SamplingParams(**{**same.to_dict(), "seed": 43}),
                                  SamplingParams(**{**same.to_dict(), "seed": None})])
    assert outs[0].token_ids == outs[1].token_ids
    for o in outs:
        assert o.finish_reason == "stop" and holds(spec, o.text), o.text
    again = llm.generate([p], same)[0]
    assert again.token_ids == outs[0].token_ids


@pytest.mark.parametrize("cut", [1, 5])
def test_a_resumed_stream_continues_its_grammar(llm, cut):
    eng = llm.engine
    p = prompts(1, seed=10)[0]
    params = SamplingParams(max_tokens=64, temperature=0.7, seed=5, structured_outputs=KINDS["json"])
    whole = llm.generate([p], params)[0]
    assert whole.finish_reason == "stop" and len(whole.token_ids) > cut
    req = eng.add_request(p, params, resume_ids=whole.token_ids[:cut])
    while not req.finish_reason:
        eng.step()
    assert req.output_token_ids == whole.token_ids
    eng.release(req.request_id)
    with pytest.raises(InvalidRequestError) as err:  # the grammar cannot have produced this
        eng.make_request(p, params, resume_ids=[eng.tokenizer.encode("zz", add_special_tokens=False)[0]])
    assert err.value.field == "resume_token_ids"
    no_leak(eng)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 77)])
def test_first_token_sampled_on_the_prefill_engine_then_decoded_equals_one_engine(llama_dir, llm, temperature,
                                                                                   seed):
    """The prefill batch samples the first token under the grammar (max_tokens 1); the decode
    engine's matcher takes it (waiting for its own compile, held back here) and goes on: the
    tokens one engine gives."""
    spec = {"json": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                      "w": {"type": "string", "maxLength": 5}},
                     "required": ["ok", "w"]}, "disable_any_whitespace": True}
    sp = SamplingParams(max_tokens=48, temperature=temperature, seed=seed, structured_outputs=spec)
    p = prompts(1, seed=11, length=30)[0]
    local = llm.generate([p], sp)[0]
    assert local.finish_reason == "stop" and json.loads(local.text)["ok"] in (True, False)
    with LLM(llama_dir, enable_prefix_caching=False, max_model_len=512) as pre, \
            LLM(llama_dir, max_model_len=512) as dec:
        prefill, decode = pre.engine, dec.engine
        gate = threading.Event()
        decode.grammars.before_compile = lambda spec: gate.wait(20)
        dreq = decode.make_request(p, sp)
        targets = decode.connector.reserve(dreq).block_ids
        batch = PrefillBatch("p0", prefill, None, PrefillStats(), transfer_timeout_s=5.0,  # type: ignore[arg-type]
                             layerwise=False, poll=lambda: None)
        rid = batch._admit(PrefillTask("x", 1, p, 0, "d0", targets, sp.to_dict()))
        first = []
        for _ in range(200):
            first = [d for d in prefill.step() if d.request_id == rid]
            if first:
                break
        assert first and first[0].new_token_ids == local.token_ids[:1]
        decode.runner.kv_cache[:, targets] = prefill.runner.kv_cache[:, prefill.connector.export_blocks(
            rid, 0, len(targets))]
        prefill.connector.release_export(rid)
        assert not dreq.grammar.ready
        threading.Timer(0.2, gate.set).start()  # the decode side's compile finishes while it waits
        decode.connector.remote_ready(dreq.request_id, first[0].new_token_ids[0])
        for _ in range(100):
            if dreq.finish_reason is not None:
                break
            decode.step()
        assert dreq.output_token_ids == local.token_ids and dreq.finish_reason == "stop"
        decode.release(dreq.request_id)
        no_leak(decode)


def test_a_checker_without_an_engine_compiles_with_its_own_compiler(llama_dir):
    """A gateway's `PromptChecker` (tokenizer only) refuses bad grammars the same way."""
    from pdserve.engine.prompts import PromptChecker
    from pdserve.engine.tokenizer import Tokenizer

    checker = PromptChecker(Tokenizer(llama_dir), 512, 32000)
    try:
        ids, _, _ = checker.validate_input("hello", SamplingParams(structured_outputs=KINDS["choice"]))
        assert ids
        with pytest.raises(InvalidRequestError) as err:
            checker.validate_input("hello", SamplingParams(structured_outputs={"grammar": "root ::= x"}))
        assert err.value.field == "structured_outputs.grammar"
        assert checker.grammars.stats()["misses"] == 2
    finally:
        checker.grammars.close()


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 3], [4]], ids=["every-row", "some", "last"])
def test_the_cpu_mask_equals_xgrammars_kernel(rows):
    """`add_bitmask` (the CPU path: a byte-table lookup and one add) masks exactly what
    xgrammar's own kernel masks, on every row asked and on no other, for a vocabulary that is
    not a multiple of 32."""
    import xgrammar as xgr

    from pdserve.engine.structured_state import add_bitmask

    g = torch.Generator().manual_seed(len(rows))
    vocab = 1000 + 7
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    bitmask[0] = -1  # every token allowed on one row
    logits = torch.randn(5, vocab, generator=g)
    want, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows)
    add_bitmask(got, bitmask, rows, vocab)
    assert torch.equal(got, want)
    assert torch.isinf(got).any() and not torch.isnan(got).any()


def test_compiles_run_at_the_configured_niceness(llama_dir):
    """The compile threads lower their own CPU priority (so a step's threads keep the cores)."""
    import os

    from pdserve.engine import GrammarCompiler
    from pdserve.engine.tokenizer import Tokenizer

    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[int] = []
    gc = GrammarCompiler(Tokenizer(llama_dir), 32000, [2], nice=min(19, base + 7))
    gc.before_compile = lambda spec: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    try:
        gc.compile(parse_structured_outputs({"regex": "nice-[0-9]"}))
    finally:
        gc.close()
    assert seen == [min(19, base + 7)] and os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's is untouched


def test_the_table_mask_without_the_native_kernel_equals_xgrammars_kernel():
    """The fallback of `add_bitmask` (no C compiler, or logits not float32): bfloat16 logits."""
    import xgrammar as xgr

    from pdserve.engine.structured_state import add_bitmask

    g = torch.Generator().manual_seed(3)
    vocab = 1000 + 7
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(4, vocab, generator=g).to(torch.bfloat16)
    want, got = logits.float(), logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=[0, 2])
    add_bitmask(got, bitmask, [0, 2], vocab)
    assert torch.equal(got.float(), want.to(torch.bfloat16).float())


@pytest.mark.parametrize("kind", ["regex", "choice", "grammar", "lark", "json_object"])
def test_every_kind_resumes_where_its_stream_was_cut(llm, kind):
    """A migrated stream of each grammar kind (the gateway resends the tokens already streamed
    as resume_ids) continues with the tokens of the run that was never cut."""
    eng = llm.engine
    p = prompts(1, seed=40)[0]
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=9, structured_outputs=KINDS[kind])
    whole = llm.generate([p], params)[0]
    assert len(whole.token_ids) >= 2, whole
    req = eng.add_request(p, params, resume_ids=whole.token_ids[:1])
    while not req.finish_reason:
        eng.step()
    assert req.output_token_ids == whole.token_ids and req.finish_reason == whole.finish_reason
    eng.release(req.request_id)
    no_leak(eng)
