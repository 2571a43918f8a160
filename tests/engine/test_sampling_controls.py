"""The sampling controls vLLM users pass: allowed_token_ids, bad_words, min_tokens, logit_bias
and min_p (engine/logits_controls.py, engine/sampler.py).

Each against HF transformers' logits processor of the same meaning, or exact expectations on
crafted logits; then greedy end to end on the tiny model, across the msgpack wire and across
the prefill/decode hop (the prefill worker's first token, prefill/batch.py), and the errors
that name the field.
"""

from __future__ import annotations

import msgpack
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.logits_controls import (
    apply_logits_controls,
    apply_min_p,
    bad_words_token_ids,
    prepare_controls,
)
from pdserve.engine.request import InvalidRequestError, Request
from pdserve.engine.sampler import Sampler, SamplingError
from pdserve.kvtransfer import PrefillTask
from pdserve.prefill.batch import PrefillBatch
from pdserve.prefill.values import PrefillStats

NEG = float("-inf")
PROBS = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])


class FakeTokenizer:
    """Words to token ids, as given (the tokenization rule's cases)."""

    def __init__(self, table: dict[str, list[int]]):
        self.table = table

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.table[text]


def request(params: SamplingParams, output=(), prompt=(1,), tokenizer=None, eos=()) -> Request:
    r = Request("r", list(prompt), params)
    r.output_token_ids = list(output)
    prepare_controls(r, tokenizer, eos, None)
    return r


def controlled(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    out, failed = apply_logits_controls(logits, reqs)
    assert not failed
    return out


# -- each control against its reference -------------------------------------------------------
@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.37, 0.9, 1.0])
def test_min_p_matches_hf_min_p_warper(min_p):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=g) * 4
    want = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), logits.clone()) if min_p else logits
    got = apply_min_p(logits, torch.full((4,), min_p))
    assert torch.equal(got, want)
    assert (torch.isfinite(got).sum(-1) >= 1).all()


def test_min_p_acts_after_temperature_in_the_sampler():
    """probabilities 0.30 0.25 0.15 0.10 ...: min_p 0.5 keeps those >= 0.15 at temperature 1;
    at temperature 2 (probabilities ~ sqrt) those >= 0.5 x 0.548, five tokens."""
    def seen(temperature, n=3000):
        reqs = [Request(f"r{i}", [1], SamplingParams(temperature=temperature, min_p=0.5)) for i in range(n)]
        return [r.token_id for r in Sampler(0)(PROBS.log().repeat(n, 1), reqs)]

    t1 = seen(1.0)
    assert set(t1) == {0, 1, 2}
    assert abs(t1.count(0) / len(t1) - 0.30 / 0.70) < 0.04  # renormalised over what is kept
    assert set(seen(2.0)) == {0, 1, 2, 3, 4}


def test_bad_words_match_hf_no_bad_words_processor():
    table = {"a": [7], " a": [7], "b c": [3, 4], " b c": [3, 4], "d e f": [1, 2, 5], " d e f": [1, 2, 5],
             "g g": [9, 9], " g g": [9, 9]}
    tok = FakeTokenizer(table)
    words = ["a", "b c", "d e f", "g g"]
    ids = [[7], [3, 4], [1, 2, 5], [9, 9]]
    assert bad_words_token_ids(tok, words) == ids
    hf = NoBadWordsLogitsProcessor(ids)
    g = torch.Generator().manual_seed(5)
    for output in ([], [3], [0, 3], [3, 0], [1, 2], [2, 1, 2], [9], [9, 9], [1, 2, 3], [0, 1]):
        logits = torch.randn(1, 12, generator=g)
        got = controlled(logits, [request(SamplingParams(bad_words=words), output, tokenizer=tok)])
        # HF looks at the whole sequence; vLLM (and we) at the output only: give HF the output
        want = hf(torch.tensor([output or [11]]), logits.clone()) if output else \
            logits.masked_fill(torch.arange(12) == 7, NEG)
        assert torch.equal(got, want), output


def test_bad_words_are_tokenized_alone_and_after_a_space_as_vllm_does():
    tok = FakeTokenizer({"x": [10], " x": [11],  # another first token, same length: both kept
                         "y": [12, 13], " y": [12, 14],  # the same first token: the plain form only
                         "z": [15], " z": [16, 17],  # another length: the plain form only
                         "big": [40], " big": [41]})
    assert bad_words_token_ids(tok, ["x", "  y", "z"]) == [[10], [11], [12, 13], [15]]
    with pytest.raises(InvalidRequestError) as e:
        bad_words_token_ids(tok, ["big"], vocab_size=32)
    assert e.value.field == "bad_words"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_matches_hf_min_new_tokens_processor(ignore_eos):
    """EOS ids (2, 3) and stop_token_ids (9) are masked while the output is shorter than
    min_tokens; with ignore_eos EOS ends nothing, so only the stop ids are (vLLM)."""
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[9], ignore_eos=ignore_eos)
    hf = MinNewTokensLengthLogitsProcessor(len(prompt), 4, [9] if ignore_eos else [2, 3, 9])
    g = torch.Generator().manual_seed(6)
    for n in range(7):
        output = [11] * n
        logits = torch.randn(1, 12, generator=g)
        got = controlled(logits, [request(params, output, prompt, eos={2, 3})])
        want = hf(torch.tensor([prompt + output]), logits.clone())
        assert torch.equal(got, want), n
        assert bool(torch.isinf(got[0, 9])) == (n < 4)


def test_logit_bias_matches_hf_sequence_bias():
    bias = {0: 3.5, 4: -100.0, 7: 100.0, 11: -0.25}
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(7))
    got = controlled(logits, [request(SamplingParams(logit_bias=bias)), request(SamplingParams())])
    want = hf(torch.zeros(1, 1, dtype=torch.long), logits[:1].clone())
    assert torch.allclose(got[:1], want) and torch.equal(got[1], logits[1])


def test_allowed_token_ids_and_the_order_of_the_controls():
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(8))
    p = SamplingParams(max_tokens=8, allowed_token_ids=[1, 2, 5, 6], bad_words=["w"], min_tokens=2,
                       stop_token_ids=[6], logit_bias={2: 1.5, 3: 50.0})
    got = controlled(logits, [request(p, [0], tokenizer=FakeTokenizer({"w": [5], " w": [5]}))])
    want = torch.full((1, 10), NEG)
    want[0, 1] = logits[0, 1]
    want[0, 2] = logits[0, 2] + 1.5  # 3's bias cannot bring back a token allowed_token_ids masked
    assert torch.equal(got, want)


def test_no_control_means_no_copy_and_no_change():
    logits = torch.randn(3, 10)
    reqs = [request(SamplingParams(temperature=t)) for t in (0.0, 0.7, 1.0)]
    out, failed = apply_logits_controls(logits, reqs)
    assert out is logits and not failed


def test_greedy_rows_take_the_argmax_after_the_controls_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(5, 1)
    raw = torch.log_softmax(logits[0], -1)
    tok = FakeTokenizer({"one": [1], " one": [1], "two": [2], " two": [2]})
    params = [SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=0, allowed_token_ids=[3, 4]),
              SamplingParams(temperature=0.0, logprobs=0, bad_words=["one", "two"]),
              SamplingParams(temperature=0.0, logprobs=0, logit_bias={5: 4.5}),
              SamplingParams(temperature=0.0, logprobs=0, min_tokens=1)]  # EOS (1 here) masked
    reqs = [request(p, [], prompt=[1, 4], tokenizer=tok, eos={1}) for p in params]
    out = Sampler(0)(logits, reqs)
    assert [r.token_id for r in out] == [1, 3, 3, 5, 2]
    for r in out:  # the model's distribution, before the controls
        assert r.logprob == pytest.approx(float(raw[r.token_id]))


def test_a_penalty_never_brings_back_a_masked_token():
    """A huge repetition penalty clamps a seen token's negative logit to -LOGIT_BOUND; a seen
    token a control masked stays at -inf, below it, instead of tying with it at the bound."""
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    p = SamplingParams(temperature=0.0, allowed_token_ids=[1, 3], bad_words=["one"], repetition_penalty=1e30)
    req = request(p, [], prompt=[1, 3], tokenizer=FakeTokenizer({"one": [1], " one": [1]}))
    assert Sampler(0)(logits, [req])[0].token_id == 3


def test_a_row_the_controls_leave_nothing_fails_alone():
    """Controls that can never leave a token are refused when the request is made
    (test_controls_that_leave_no_token_are_refused_before_any_step); these leave none only
    after the output has grown: the bad word "ab" bans 3, the one token allowed, after a 1."""
    logits = torch.randn(4, 10)
    words = FakeTokenizer({"ab": [1, 3], " ab": [1, 3]})
    none_left = dict(max_tokens=5, allowed_token_ids=[3], bad_words=["ab"])
    reqs = [request(SamplingParams(temperature=0.0, **none_left), output=[1], tokenizer=words),
            request(SamplingParams(temperature=1.0, **none_left), output=[1], tokenizer=words),
            request(SamplingParams(temperature=0.0, allowed_token_ids=[4])),
            request(SamplingParams(temperature=1.0, allowed_token_ids=[4]))]
    out = Sampler(0)(logits, reqs)
    assert isinstance(out[0], SamplingError) and isinstance(out[1], SamplingError)
    assert [r.token_id for r in out[2:]] == [4, 4]


def test_bad_words_need_the_engine_tokenizer_else_that_row_fails():
    reqs = [Request("a", [1], SamplingParams(bad_words=["x"])), Request("b", [1], SamplingParams(temperature=0))]
    out = Sampler(0)(torch.randn(2, 10), reqs)
    assert isinstance(out[0], SamplingError) and "bad_words" in str(out[0]) and out[1].token_id >= 0


# -- end to end on the tiny model -------------------------------------------------------------
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir)


@pytest.fixture(scope="module")
def base(llm):
    return llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]


def test_allowed_token_ids_restrict_the_output(llm, base):
    allowed = [1000, 1001, 2000, 2001, 3000]
    for p in (SamplingParams(max_tokens=12, temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(max_tokens=12, temperature=1.0, seed=5, allowed_token_ids=allowed)):
        out = llm.generate([PROMPT], p)[0]
        assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)


def test_min_tokens_delays_eos_and_stop_token_ids(llm, base):
    eos = next(iter(llm.engine.eos_token_ids))
    p = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0})
    assert llm.generate([PROMPT], p)[0].token_ids == [eos]
    out = llm.generate([PROMPT], SamplingParams(**{**p.to_dict(), "min_tokens": 4}))[0]
    assert len(out.token_ids) == 5 and eos not in out.token_ids[:4] and out.token_ids[4] == eos
    assert out.finish_reason == "stop" and out.stop_reason == eos
    stop = base.token_ids[0]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, logit_bias={stop: 100.0},
                                                stop_token_ids=[stop], min_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and stop not in out.token_ids[:3] and out.stop_reason == stop


def test_stop_strings_count_only_after_min_tokens(llm, base):
    """vLLM's rule: the first min_tokens tokens cannot end the output, a stop string neither;
    the text they make is all returned (nothing held back as a possible stop's start)."""
    whole = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    tok = llm.tokenizer
    first = tok.decode(whole.token_ids[:1])
    assert first.strip()
    stop = first.strip()[:2]
    cut = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert len(cut.token_ids) == 1 and cut.stop_reason == stop  # without min_tokens: the first token stops
    late = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop],
                                                 min_tokens=5))[0]
    assert late.token_ids[:5] == whole.token_ids[:5] and len(late.token_ids) > 5
    five = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert stop in five.text and late.text.startswith(five.text)  # the stop inside them did not cut them
    if late.finish_reason == "stop":  # a later occurrence stopped it: never inside the first 5 tokens' text
        assert late.stop_reason == stop
    else:
        assert late.token_ids == whole.token_ids and stop not in tok.decode(whole.token_ids[5:])


def test_bad_words_never_appear(llm, base):
    tok = llm.tokenizer
    ids = base.token_ids
    # a single-token word and a two-token word of the greedy output, as the tokenizer gives them back
    single = next(tok.decode([t]).strip() for t in ids if [t] in bad_words_token_ids(tok, [tok.decode([t])]))
    pair = next((ids[i], ids[i + 1]) for i in range(len(ids) - 1)
                if [ids[i], ids[i + 1]] in bad_words_token_ids(tok, [tok.decode(ids[i:i + 2])]))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                bad_words=[single, tok.decode(list(pair))]))[0]
    banned = {t for w in bad_words_token_ids(tok, [single]) for t in w}
    assert banned and not banned & set(out.token_ids) and out.token_ids != ids
    assert all((a, b) != pair for a, b in zip(out.token_ids, out.token_ids[1:]))


def test_logit_bias_moves_the_greedy_choice(llm, base):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                logit_bias={base.token_ids[0]: -100.0, 4242: 100.0}))[0]
    assert out.token_ids == [4242] * 3


def test_the_controls_survive_the_wire():
    p = SamplingParams(max_tokens=9, min_p=0.2, min_tokens=3, logit_bias={5: 1.5, 31999: -100.0},
                       allowed_token_ids=[5, 6, 7], bad_words=["foo", "bar baz"], stop_token_ids=[6])
    wire = msgpack.unpackb(msgpack.packb(p.to_dict()))  # strict_map_key: string keys only
    back = SamplingParams.from_dict(wire)
    assert back == p and back.logit_bias == {5: 1.5, 31999: -100.0}
    back.validate(32000)


@pytest.mark.parametrize("params", [
    dict(temperature=0.0, min_tokens=4, logit_bias={"EOS": 100.0}),
    dict(temperature=0.0, min_tokens=1, logit_bias={"EOS": 100.0}),
    dict(temperature=0.9, seed=11, min_p=0.05, min_tokens=3, allowed_token_ids=list(range(2, 400)),
         bad_words=["the"], logit_bias={"EOS": 6.0}),
], ids=["greedy-min4", "greedy-min1", "seeded"])
def test_prefill_first_token_then_decode_equals_one_engine(llama_dir, llm, params):
    """The prefill worker samples the first token (max_tokens 1, min_tokens min(.., 1): no EOS
    first) from the params as the wire carries them; the decode worker counts that token
    towards min_tokens and goes on: the tokens one engine gives."""
    eos = next(iter(llm.engine.eos_token_ids))
    params = {**params, "logit_bias": {eos: params["logit_bias"]["EOS"]}, "max_tokens": 10}
    sp = SamplingParams(**params)
    prompt = llm.tokenizer.encode(PROMPT)
    local = llm.generate([prompt], sp)[0]
    if params["temperature"] == 0.0:
        assert local.token_ids[-1] == eos and len(local.token_ids) == max(params["min_tokens"], 1) + 1
    prefill, decode = LLM(llama_dir, enable_prefix_caching=False).engine, LLM(llama_dir).engine
    dreq = decode.make_request(prompt, sp)
    targets = decode.connector.reserve(dreq).block_ids
    batch = PrefillBatch("p0", prefill, None, PrefillStats(), transfer_timeout_s=5.0,  # type: ignore[arg-type]
                         layerwise=False, poll=lambda: None)
    task = PrefillTask("x", 1, prompt, 0, "d0", targets, msgpack.unpackb(msgpack.packb(sp.to_dict())))
    rid = batch._admit(task)
    first = prefill.step()[0]
    assert first.request_id == rid and first.new_token_ids[0] != eos
    decode.runner.kv_cache[:, targets] = prefill.runner.kv_cache[:, prefill.connector.export_blocks(
        rid, 0, len(targets))]
    prefill.connector.release_export(rid)
    decode.connector.remote_ready(dreq.request_id, first.new_token_ids[0])
    for _ in range(50):
        if dreq.finish_reason is not None:
            break
        decode.step()
    assert dreq.output_token_ids == local.token_ids and dreq.finish_reason == local.finish_reason


@pytest.mark.parametrize("field,params", [
    ("logit_bias", dict(logit_bias={32000: 1.0})),
    ("logit_bias", dict(logit_bias={"x": 1.0})),
    ("logit_bias", dict(logit_bias={5: 100.5})),
    ("logit_bias", dict(logit_bias={5: float("nan")})),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[3, 32000])),
    ("min_tokens", dict(max_tokens=4, min_tokens=5)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_p", dict(min_p=1.5)),
    ("bad_words", dict(bad_words=[""])),
    ("bad_words", dict(bad_words="word")),
    ("prompt_logprobs", dict(prompt_logprobs=21)),  # (its other bounds: tests/engine/test_prompt_logprobs.py)
])
def test_bad_values_are_refused_naming_the_field(llm, field, params):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.make_request(PROMPT, SamplingParams(**params))
    assert e.value.field == field
    assert not llm.engine.requests


@pytest.mark.parametrize("field,params", [
    ("min_tokens", dict(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=1)),
    ("min_tokens", dict(allowed_token_ids=[2], min_tokens=3)),  # 2: the tiny model's end-of-sequence
    ("allowed_token_ids", dict(allowed_token_ids=[7], bad_words=["zebra"])),
])
def test_controls_that_leave_no_token_are_refused_before_any_step(llm, field, params):
    if "bad_words" in params:  # allowed: exactly the bad word's one-token forms
        one = [w[0] for w in bad_words_token_ids(llm.tokenizer, ["the"], None) if len(w) == 1]
        assert one
        params = {**params, "allowed_token_ids": one, "bad_words": ["the"]}
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.make_request(PROMPT, SamplingParams(**params))
    assert e.value.field == field and "nothing can be generated" in str(e.value)
    # the same controls with a token left are served
    ok = {**params, "allowed_token_ids": params["allowed_token_ids"] + [11]}
    assert llm.generate([PROMPT], SamplingParams(**ok, max_tokens=4))[0].finish_reason in ("stop", "length")


def test_a_first_token_task_with_a_bad_min_tokens_names_it(llm):
    batch = PrefillBatch("p0", llm.engine, None, PrefillStats(), transfer_timeout_s=5.0,  # type: ignore[arg-type]
                         layerwise=False, poll=lambda: None)
    for bad in ("3", -2, True):
        with pytest.raises(InvalidRequestError) as e:
            batch._admit(PrefillTask("x", 1, [1, 2, 3], 0, "d0", [0], {"min_tokens": bad}))
        assert e.value.field == "min_tokens"
    assert not llm.engine.requests


@pytest.mark.gpu
def test_the_controls_on_the_device_are_the_controls_on_the_host():
    """CUDA logits: every control (index tensors, the allowed mask, min_p's per-row floor) on
    the logits' device, the same logits and tokens as on the host."""
    logits = torch.randn(5, 4096, generator=torch.Generator().manual_seed(12)) * 3
    tok = FakeTokenizer({"w": [7], " w": [8]})
    params = [SamplingParams(temperature=0.0, allowed_token_ids=list(range(100, 300))),
              SamplingParams(temperature=0.0, bad_words=["w"], logit_bias={9: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, logit_bias={2: 100.0}),
              SamplingParams(temperature=0.7, seed=3, min_p=0.1, allowed_token_ids=[5, 6, 7]),
              SamplingParams(temperature=0.0)]

    def reqs():
        return [request(p, [], tokenizer=tok, eos={2}) for p in params]

    host, dev = controlled(logits, reqs()), controlled(logits.cuda(), reqs())
    assert dev.is_cuda and torch.equal(dev.cpu(), host)
    want = [r.token_id for r in Sampler(0)(logits, reqs())]
    assert [r.token_id for r in Sampler(0)(logits.cuda(), reqs())] == want
    assert want[1] == 9 and want[2] != 2 and want[3] in (5, 6, 7)


@pytest.mark.parametrize("penalty", [5e-324, 1e-30, 1e4])
def test_a_masked_token_under_an_extreme_repetition_penalty_stays_masked_not_nan(llm, penalty):
    """allowed_token_ids masks every other token to -inf; a repetition penalty that rounds to
    0 in float32 (5e-324) once turned -inf x 0 into NaN for the prompt's tokens and failed the
    request (found by the API fuzzer). The allowed token is sampled, greedy and random."""
    prompt = llm.engine.tokenize_prompt("\u008c\u007f\r\u009e")
    for allowed in (prompt[-1], 31999):  # a token of the prompt (penalised) and one outside it
        for temperature in (0.0, 1.0):
            out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=temperature, seed=1,
                                                        allowed_token_ids=[allowed],
                                                        repetition_penalty=penalty))[0]
            assert out.finish_reason == "length" and out.token_ids == [allowed] * 3, (allowed, out)
