"""A request resumed from the tokens another worker already generated (a migrated stream)
continues exactly as the uninterrupted run: greedy, seeded sampling, penalties, stop
strings and text alike; what cannot be resumed is refused by name."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=256)


def prompt(n=20, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


def run(llm, ids, params, resume=None, rid="r"):
    """Step one request to its end; (new token ids, new text, finish reason)."""
    eng = llm.engine
    eng.add_request(ids, params, request_id=rid, resume_ids=resume)
    toks, text, finish = [], "", None
    for _ in range(400):
        for d in eng.step():
            toks += d.new_token_ids
            text += d.text
            finish = d.finish_reason or finish
        if not eng.has_unfinished() or finish:
            break
    eng.release(rid)
    assert not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    return toks, text, finish


PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=1234, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, seed=-7, frequency_penalty=1.5, presence_penalty=0.5,
                   repetition_penalty=1.3, ignore_eos=True),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded", "penalties"])
@pytest.mark.parametrize("cut", [1, 9, 23])
def test_a_resumed_request_continues_the_uninterrupted_run(llm, params, cut):
    ids = prompt(seed=cut)
    whole, text, finish = run(llm, ids, params)
    assert len(whole) == 24 and finish == "length"
    rest, rest_text, rest_finish = run(llm, ids, params, resume=whole[:cut])
    assert whole[:cut] + rest == whole
    assert rest_finish == finish
    head = llm.engine.tokenizer.stream(ids, params.skip_special_tokens)
    head_text = "".join(head.push(t)[0] for t in whole[:cut])
    assert head_text + rest_text == text


def test_a_stop_string_after_the_cut_still_ends_the_resumed_request(llm):
    ids = prompt(seed=5)
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    whole, text, _ = run(llm, ids, base)
    # a 3-character piece of the greedy text from its second half, with something besides spaces
    starts = [i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].strip()]
    assert starts, f"the greedy text has no stop string candidate: {text!r}"
    stop = text[starts[0]:starts[0] + 3]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    cut_toks, cut_text, cut_finish = run(llm, ids, params)
    assert cut_finish == "stop"
    resumed, resumed_text, resumed_finish = run(llm, ids, params, resume=cut_toks[:2])
    assert resumed_finish == "stop" and cut_toks[:2] + resumed == cut_toks
    head = llm.engine.tokenizer.stream(ids)
    head.set_stops([stop])
    head_text = "".join(head.push(t)[0] for t in cut_toks[:2])
    assert head_text + resumed_text == cut_text


@pytest.mark.parametrize("resume,params,match", [
    ([5] * 8, SamplingParams(max_tokens=8), "nothing would be left"),
    ([5, 10 ** 9], SamplingParams(max_tokens=8), "not a token id"),
    ("abc", SamplingParams(max_tokens=8), "must be a list"),
    ([7, 2, 7], SamplingParams(max_tokens=8, stop_token_ids=[2]), "already stopped at resumed token 1"),
    ([5] * 240, SamplingParams(max_tokens=250), "no room below max_model_len"),
])
def test_what_cannot_be_resumed_is_refused_by_name(llm, resume, params, match):
    with pytest.raises(InvalidRequestError, match=match) as ei:
        llm.engine.add_request(prompt(), params, request_id="bad", resume_ids=resume)
    assert ei.value.field == "resume_token_ids"
    assert not llm.engine.requests
