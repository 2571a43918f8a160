"""Prompt logprobs (vLLM's ``prompt_logprobs``; engine/prompt_logprobs.py): each prompt token's
logprob and rank and the N most likely tokens at its position, against HF transformers' logits
on the same model directory (float32), through chunked prefill, a prefix the pool has cached,
preemption in the middle of the prompt, and the errors that name the field."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import InvalidRequestError

TOP = 3


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 2, 17, 40, 97)]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_num_batched_tokens=32)  # chunks of 32: the longer prompts span several steps


@pytest.fixture(scope="module")
def hf_logprobs(llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return run


def check_against_hf(entries: list[dict], ids: list[int], ref: torch.Tensor) -> None:
    assert len(entries) == len(ids)
    assert entries[0] == {"token_id": ids[0], "logprob": None, "rank": None, "top_logprobs": {}}
    for p, e in enumerate(entries[1:]):  # entry p + 1: token p + 1, from position p's logits
        row, tok = ref[p], ids[p + 1]
        assert e["token_id"] == tok
        assert e["logprob"] == pytest.approx(float(row[tok]), abs=1e-4), f"position {p + 1}"
        # the random model's distribution is flat: ranks and the top tokens are compared up to
        # values within the float32 tolerance of each other
        assert rank_range(row, float(row[tok]))[0] <= e["rank"] <= rank_range(row, float(row[tok]))[1]
        assert list(e["top_logprobs"].values()) == pytest.approx(row.topk(TOP).values.tolist(), abs=1e-4)
        for t, v in e["top_logprobs"].items():
            assert float(row[t]) == pytest.approx(v, abs=1e-4)


def rank_range(row: torch.Tensor, value: float, tol: float = 1e-4) -> tuple[int, int]:
    """The ranks a logprob of ``value`` can have among ``row``'s, given the tolerance."""
    return int((row > value + tol).sum()) + 1, int((row > value - tol).sum()) + 1


def test_prompt_logprobs_match_hf_through_chunked_prefill(llm, hf_logprobs):
    ps = prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(ps, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP))
    for ids, out in zip(ps, outs):
        check_against_hf(out.prompt_logprobs, ids, hf_logprobs(ids))
    # the generated tokens are those of a request that did not ask (the sampling rows are untouched)
    plain = llm.generate(ps, SamplingParams(max_tokens=3, temperature=0.0))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_zero_gives_the_prompt_token_and_its_rank_only(llm, hf_logprobs):
    ids = prompts(llm.engine.model_config.vocab_size)[3]
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    ref = hf_logprobs(ids)
    assert all(e["top_logprobs"] == {} for e in out.prompt_logprobs)
    for p, e in enumerate(out.prompt_logprobs[1:]):
        lo, hi = rank_range(ref[p], float(ref[p][ids[p + 1]]))
        assert lo <= e["rank"] <= hi


def test_a_cached_prefix_is_computed_again_and_reported_the_same(llm):
    eng = llm.engine
    ids = prompts(eng.model_config.vocab_size)[4]
    sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    first = llm.generate([ids], sp)[0]
    computed = eng.stats.num_prompt_tokens_computed
    again = llm.generate([ids], sp)[0]
    assert again.num_cached_tokens == 0  # every position ran: its logits are reported
    assert eng.stats.num_prompt_tokens_computed - computed == len(ids)
    assert again.prompt_logprobs == first.prompt_logprobs and again.token_ids == first.token_ids
    # the pool did hold the prefix: a request that does not ask uses it
    assert llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0))[0].num_cached_tokens > 0


def test_preempted_in_the_middle_of_its_prompt_it_reports_each_position_once(llm):
    eng = llm.engine
    ids = prompts(eng.model_config.vocab_size)[4]
    sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    ref = llm.generate([ids], sp)[0]
    req = eng.add_request(ids, sp, request_id="preempted")
    eng.step()  # its first chunk of 32
    assert req.num_computed_tokens == 32 and len(req.prompt_logprobs) == 32
    eng.scheduler._preempt(req)  # as the scheduler does when the pool runs short
    while req.finish_reason is None:
        eng.step()
    out = eng.release("preempted")
    assert req.num_preemptions == 1 and out.num_cached_tokens == 0
    assert out.prompt_logprobs == ref.prompt_logprobs and out.token_ids == ref.token_ids


def test_the_first_token_delta_carries_them_once(llm):
    eng = llm.engine
    ids = prompts(eng.model_config.vocab_size)[2]
    eng.add_request(ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
                    request_id="streamed")
    carried = []
    while "streamed" in eng.requests and eng.requests["streamed"].finish_reason is None:
        carried += [d.prompt_logprobs for d in eng.step() if d.request_id == "streamed"]
    eng.release("streamed")
    assert len(carried) == 3 and len(carried[0]) == len(ids) and carried[1:] == [None, None]


@pytest.mark.parametrize("value", [-1, 21, "1", True, 1.5])
def test_bad_values_name_the_field(llm, value):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.make_request([5, 6, 7], SamplingParams(prompt_logprobs=value))
    assert e.value.field == "prompt_logprobs"
    assert not llm.engine.requests


def test_tensor_parallel_ranks_compute_the_prompt_rows_too(llama_dir, llm, hf_logprobs):
    """At TP=2 the prompt positions' rows cross to rank 1 with the step (engine/tp_step.py) and
    its logits slice joins rank 0's."""
    ps = prompts(llm.engine.model_config.vocab_size)[2:4]
    sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    with LLM(llama_dir, tensor_parallel_size=2, max_num_batched_tokens=32) as tp:
        outs = tp.generate(ps, sp)
    for ids, out in zip(ps, outs):
        check_against_hf(out.prompt_logprobs, ids, hf_logprobs(ids))
