"""No request can take the engine down: bad numbers are refused by name, tiny ones are
sampled safely, and a request that fails inside a running batch fails alone."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdserve.engine import LLM, InvalidRequestError, SamplingParams, StepError
from pdserve.engine.request import GREEDY_TEMPERATURE

FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=256)


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(n)] for n in lengths]


def assert_no_leak(llm):
    eng = llm.engine
    assert not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused_by_name(name, value):
    with pytest.raises(InvalidRequestError, match=f"^{name}: must be a finite number"):
        SamplingParams(**{name: value}).validate(32000)


@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "7"}, "max_tokens"),
    ({"max_tokens": 7.0}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": True}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"stop": ["ok", "x\ud800y"]}, "stop"),
    ({"stop": ["s"] * 65}, "stop"),
    ({"stop": ["s" * 1025]}, "stop"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
])
def test_wrong_types_and_ranges_are_refused_by_name(kwargs, name):
    with pytest.raises(InvalidRequestError, match=f"^{name}:"):
        SamplingParams(**kwargs).validate(32000)


def test_extreme_but_valid_values_pass_validation():
    SamplingParams(temperature=1e-40, repetition_penalty=1e-40, seed=2**64 - 1, top_k=2**40).validate(32000)
    SamplingParams(seed=-(2**63)).validate(32000)


def test_tiny_temperature_samples_greedily(llm):
    prompts = prompts_of([12, 40], seed=1)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for t in (1e-40, GREEDY_TEMPERATURE / 2):
        tiny = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=t, ignore_eos=True))
        assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]
    assert_no_leak(llm)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiny_repetition_penalty_is_sampled_safely(llm, temperature):
    outs = llm.generate(prompts_of([10, 30], seed=2), SamplingParams(
        max_tokens=10, temperature=temperature, repetition_penalty=1e-40, top_p=0.9, seed=3, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outs)
    assert_no_leak(llm)


def _run_batch(llm, prompts, params, sabotage):
    """Step a batch to the end; ``sabotage(engine, step_number)`` runs before each step."""
    eng = llm.engine
    reqs = [eng.add_request(p, params, request_id=f"iso-{i}") for i, p in enumerate(prompts)]
    finish, step = {}, 0
    while eng.has_unfinished() and step < 200:
        sabotage(eng, step)
        for d in eng.step():
            if d.finished:
                finish[d.request_id] = (d.finish_reason, d.error)
        step += 1
    outs = {r.request_id: eng.release(r.request_id) for r in reqs}
    return outs, finish


def test_a_detokenizer_failure_inside_a_running_batch_fails_that_request_only(llm):
    prompts = prompts_of([8, 25, 60, 17], seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]

    def sabotage(eng, step):
        if step == 5:  # mid-decode: the victim already streamed tokens
            def boom(token_id, stops_on=True):
                raise TypeError("injected detokenizer failure")
            eng._detok["iso-2"].push = boom

    outs, finish = _run_batch(llm, prompts, params, sabotage)
    assert finish["iso-2"][0] == "error" and "injected detokenizer failure" in finish["iso-2"][1]
    for i in (0, 1, 3):
        assert finish[f"iso-{i}"][0] == "length"
        assert outs[f"iso-{i}"].token_ids == ref[i]
    assert llm.engine.stats.num_failed >= 1
    assert_no_leak(llm)


def test_a_row_that_cannot_be_sampled_fails_alone(llm, monkeypatch):
    """NaN logits in one sampled row (a broken model output, say) fail that request; the
    greedy and sampled neighbours in the same batch go on exactly."""
    prompts = prompts_of([9, 33, 21], seed=5)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, greedy)]
    eng = llm.engine
    runner_execute = eng.runner.execute

    def execute(scheduled, kv, hook):
        logits, batch = runner_execute(scheduled, kv, hook)
        logits = logits.clone()  # the runner's output is an inference tensor
        for row, req in enumerate(batch.sampling):
            if req.request_id == "iso-1":
                logits[row] = float("nan")
        return logits, batch

    monkeypatch.setattr(eng.runner, "execute", execute)
    victim = SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
    reqs = [eng.add_request(p, greedy if i != 1 else victim, request_id=f"iso-{i}") for i, p in enumerate(prompts)]
    finish = {}
    for _ in range(100):
        if not eng.has_unfinished():
            break
        for d in eng.step():
            if d.finished:
                finish[d.request_id] = (d.finish_reason, d.error)
    outs = {r.request_id: eng.release(r.request_id) for r in reqs}
    assert finish["iso-1"][0] == "error" and "sample" in finish["iso-1"][1]
    assert outs["iso-0"].token_ids == ref[0] and outs["iso-2"].token_ids == ref[2]
    assert_no_leak(llm)


def test_a_failed_forward_pass_raises_a_step_error_and_commits_nothing(llm, monkeypatch):
    eng = llm.engine
    req = eng.add_request(prompts_of([20], seed=6)[0], SamplingParams(max_tokens=4, temperature=0.0),
                          request_id="iso-step")

    def execute(scheduled, kv, hook):
        raise torch.cuda.OutOfMemoryError("injected OOM")

    monkeypatch.setattr(eng.runner, "execute", execute)
    with pytest.raises(StepError, match="injected OOM") as info:
        eng.step()
    assert info.value.request_ids == ["iso-step"]
    assert req.num_computed_tokens == 0 and not req.output_token_ids
    monkeypatch.undo()
    assert eng.abort_request("iso-step")
    assert_no_leak(llm)
