"""FlashInfer backend vs the torch reference path (CUDA only)."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(rng.randint(1, 230))] for _ in range(n)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flashinfer_greedy_matches_torch_backend(llama_dir, dtype):
    pytest.importorskip("flashinfer")
    prompts = _prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ref = LLM(llama_dir, device="cuda", dtype=dtype, attention_backend="torch").generate(prompts, params)
    llm = LLM(llama_dir, device="cuda", dtype=dtype, attention_backend="flashinfer")
    assert llm.engine.runner.backend.name == "flashinfer"
    outs = llm.generate(prompts, params)
    agree = [o.token_ids == r.token_ids for o, r in zip(outs, ref)]
    if dtype == "float32":
        assert all(agree)
    else:  # bf16 kernels round differently; the first tokens must still agree
        assert all(o.token_ids[:4] == r.token_ids[:4] for o, r in zip(outs, ref))


def test_flashinfer_chunked_prefill_and_prefix_cache(llama_dir):
    pytest.importorskip("flashinfer")
    shared = _prompts(1, seed=3)[0][:200]
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    ref = LLM(llama_dir, device="cuda", dtype="float32", attention_backend="torch",
              enable_prefix_caching=False).generate(prompts, params)
    llm = LLM(llama_dir, device="cuda", dtype="float32", attention_backend="flashinfer",
              max_num_batched_tokens=32)
    outs = [llm.generate([p], params)[0] for p in prompts]
    assert outs[1].num_cached_tokens >= 192
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_auto_backend_picks_flashinfer_on_cuda(llama_dir):
    pytest.importorskip("flashinfer")
    assert LLM(llama_dir, device="cuda").engine.runner.backend.name == "flashinfer"
