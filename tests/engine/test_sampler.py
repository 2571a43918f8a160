"""Sampler: seeds, top-k/top-p exclusion, penalties, logprobs, stop conditions."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, filter_top_k_top_p, inverse_cdf

# A fixed 8-token distribution: probabilities 0.30 0.25 0.15 0.10 0.08 0.06 0.04 0.02.
PROBS = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
LOGITS = PROBS.log()


def draw(params: SamplingParams, n: int, logits=LOGITS, seed=0) -> list[int]:
    sampler = Sampler(seed)
    reqs = [Request(f"r{i}", [1], params) for i in range(n)]
    return [r.token_id for r in sampler(logits.repeat(n, 1), reqs)]


def test_top_k_never_emits_excluded_tokens():
    seen = set(draw(SamplingParams(temperature=1.0, top_k=3), 3000))
    assert seen == {0, 1, 2}


def test_top_p_never_emits_tokens_outside_the_nucleus():
    # Mass ahead of token 3 is 0.70 < 0.75, ahead of token 4 is 0.80 >= 0.75.
    seen = draw(SamplingParams(temperature=1.0, top_p=0.75), 4000)
    assert set(seen) == {0, 1, 2, 3}
    # Frequencies follow the renormalised nucleus (0.3/0.8 for token 0).
    assert abs(seen.count(0) / len(seen) - 0.375) < 0.04


def test_filter_keeps_the_top_token_even_with_tiny_top_p():
    out = filter_top_k_top_p(LOGITS[None], torch.tensor([0]), torch.tensor([1e-6]))
    assert torch.isfinite(out[0]).tolist() == [True] + [False] * 7


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    a = draw(SamplingParams(temperature=1.0, seed=42), 1) + draw(SamplingParams(temperature=1.0, seed=42), 1)
    p = SamplingParams(temperature=1.0, seed=42)
    r1, r2 = Request("a", [1], p), Request("b", [1], p)
    s = Sampler(0)
    seq1 = [s(LOGITS[None], [r1])[0].token_id for _ in range(50)]
    seq2 = [s(LOGITS[None], [r2])[0].token_id for _ in range(50)]
    assert seq1 == seq2 and a[0] == a[1]
    r3 = Request("c", [1], SamplingParams(temperature=1.0, seed=7))
    assert [s(LOGITS[None], [r3])[0].token_id for _ in range(50)] != seq1


def test_draws_follow_the_distribution_and_never_pick_a_zero_probability_token():
    """The inverse-CDF draw: frequencies within 3 standard errors of every probability, and a
    token of probability 0 (here every other one) is never drawn, whatever the uniform."""
    probs = torch.tensor([0.0, 0.30, 0.0, 0.25, 0.15, 0.0, 0.10, 0.08, 0.06, 0.04, 0.02, 0.0])
    n = 20000
    seen = draw(SamplingParams(temperature=1.0), n, logits=probs.log())
    counts = torch.bincount(torch.tensor(seen), minlength=len(probs)).double() / n
    assert all(counts[i] == 0 for i in range(len(probs)) if probs[i] == 0)
    se = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert bool(((counts - probs.double()).abs() <= 3 * se + 1e-12).all()), counts


def _one_level(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The definition: one float64 prefix sum per row, the first entry above u x total."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1]
    drawn = torch.searchsorted(cdf, (u * total).unsqueeze(1), right=True).squeeze(1)
    return torch.minimum(drawn, (cdf < total.unsqueeze(1)).sum(dim=-1))


def test_the_two_level_draw_is_the_one_level_draw_and_never_a_zero():
    """inverse_cdf over 8 slices of 256 against the one-level definition: rows with whole
    slices at zero (top-k / top-p masks), a single surviving token, mass at the very ends;
    uniforms at 0, at slice boundaries, just below 1, and random. Same token (a float64
    rounding tie at a boundary may move it to a neighbour of the same probability: none here
    on these rows), and never a token of probability 0."""
    g = torch.Generator().manual_seed(5)
    vocab = 2048
    rows = [torch.rand(vocab, generator=g)]
    masked = torch.rand(vocab, generator=g)
    masked[256:1024] = 0
    masked[1800:] = 0
    rows.append(masked)
    single = torch.zeros(vocab)
    single[1337] = 1.0
    rows.append(single)
    ends = torch.zeros(vocab)
    ends[0], ends[-1] = 0.5, 0.5
    rows.append(ends)
    sparse = torch.zeros(vocab)
    sparse[torch.randperm(vocab, generator=g)[:40]] = torch.rand(40, generator=g)
    rows.append(sparse)
    probs = torch.stack([r / r.sum() for r in rows])
    us = [0.0, 1e-12, 0.125, 0.5, 0.875, 1 - 1e-12, *torch.rand(200, generator=g, dtype=torch.float64).tolist()]
    for u in us:
        uu = torch.full((len(rows),), u, dtype=torch.float64)
        got, bad = inverse_cdf(probs, uu)
        want = _one_level(probs, uu)
        assert not bad.any()
        assert bool((probs[torch.arange(len(rows)), got] > 0).all()), (u, got)
        assert got.tolist() == want.tolist(), (u, got.tolist(), want.tolist())
    nan = probs.clone()
    nan[1, 5] = float("nan")
    _, bad = inverse_cdf(torch.cat([nan, torch.zeros(1, vocab)]), torch.full((len(rows) + 1,), 0.5, dtype=torch.float64))
    assert bad.tolist() == [False, True, False, False, False, True]


def test_draws_over_a_large_vocabulary_follow_the_distribution():
    """Through the Sampler, a 4096-token vocabulary (16 slices) whose mass sits in 6 tokens
    spread over the slices: frequencies within 3 standard errors, nothing else drawn."""
    probs = torch.zeros(4096)
    hot = [3, 700, 701, 2048, 3000, 4095]
    probs[hot] = torch.tensor([0.3, 0.2, 0.15, 0.15, 0.1, 0.1])
    n = 12000
    seen = draw(SamplingParams(temperature=1.0), n, logits=probs.log())
    counts = torch.bincount(torch.tensor(seen), minlength=4096).double() / n
    assert set(seen) <= set(hot)
    se = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert bool(((counts - probs.double()).abs() <= 3 * se + 1e-12).all())


def test_a_row_without_a_distribution_fails_alone_and_draws_consume_one_number_each():
    nan = torch.full((8,), float("nan"))
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0)) for i in range(3)]
    out = Sampler(0)(torch.stack([LOGITS, nan, LOGITS]), reqs)
    assert isinstance(out[1], RuntimeError) and "cannot sample" in str(out[1])
    assert out[0].token_id in range(8) and out[2].token_id in range(8)
    # skip_draw advances a seeded generator exactly as one drawn token does
    p = SamplingParams(temperature=1.0, seed=3)
    a, b = Request("a", [1], p), Request("b", [1], p)
    s = Sampler(0)
    s(LOGITS[None], [a])
    Sampler.skip_draw(b)
    assert [s(LOGITS[None], [a])[0].token_id for _ in range(20)] == [s(LOGITS[None], [b])[0].token_id for _ in range(20)]


def test_penalties_push_repeated_tokens_down():
    req = Request("r", [0], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    assert Sampler()(LOGITS[None], [req])[0].token_id == 1  # token 0 is in the prompt
    req = Request("r", [5], SamplingParams(temperature=0.0, presence_penalty=2.0))
    req.output_token_ids = [0, 1]
    assert Sampler()(LOGITS[None], [req])[0].token_id == 2


def test_logprobs_are_raw_log_softmax_with_top_n():
    req = Request("r", [1], SamplingParams(temperature=0.0, logprobs=2))
    res = Sampler()(LOGITS[None], [req])[0]
    assert res.token_id == 0
    assert res.logprob == pytest.approx(float(PROBS[0].log()), abs=1e-5)
    assert list(res.top_logprobs) == [0, 1]


def test_seeded_generation_reproducible_end_to_end(llama_dir):
    llm = LLM(llama_dir)
    p = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=123)
    a = llm.generate(["Once upon a time"], p)[0].token_ids
    b = llm.generate(["Once upon a time"], p)[0].token_ids
    assert a == b and len(a) == 20


def test_stop_token_ids_and_stop_strings(llama_dir):
    llm = LLM(llama_dir)
    base = llm.generate(["Once upon a time"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_tok = base.token_ids[5]
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok]))[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # A stop string taken from the middle of the greedy text.
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 3]
    assert stop.strip(), "greedy text too short for this test"
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.gpu
def test_the_draw_on_the_device_is_the_draw_on_the_host():
    """On CUDA, inverse_cdf (searchsorted, the slice sums, the int8 argmax) gives the host's
    tokens for the same probabilities and uniforms, and the Sampler serves greedy, random,
    seeded and top-k/top-p rows of one batch there without a host copy of the logits."""
    g = torch.Generator().manual_seed(11)
    probs = torch.rand(6, 4096, generator=g)
    probs[2, 1000:3000] = 0
    probs = probs / probs.sum(-1, keepdim=True)
    u = torch.rand(6, generator=g, dtype=torch.float64)
    host, _ = inverse_cdf(probs, u)
    dev, bad = inverse_cdf(probs.cuda(), u.cuda())
    assert dev.tolist() == host.tolist() and not bad.any().item()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=1.0, top_k=5, top_p=0.9)]
    reqs = [Request(f"r{i}", [1], p) for i, p in enumerate(params)]
    logits = torch.randn(len(reqs), 4096, generator=g) * 3
    out = Sampler(0)(logits.cuda(), reqs)
    assert out[0].token_id == int(logits[0].argmax())
    top5 = set(logits[3].topk(5).indices.tolist())
    assert out[3].token_id in top5 and all(0 <= r.token_id < 4096 for r in out)
    seeded = [Request("a", [1], params[2]), Request("b", [1], params[2])]
    assert Sampler(0)(logits[2:3].cuda(), seeded[:1])[0].token_id == Sampler(5)(logits[2:3], seeded[1:])[0].token_id
