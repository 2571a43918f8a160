"""FlashInfer backend vs the torch reference path on the same GPU, in 16-bit (FlashInfer's
paged kernels have no float32 path).

Tolerance: both backends round to bfloat16/float16 between ops but accumulate in a different
order, so neither equals the float32 result. The bound is measured, not guessed: FlashInfer's
logits must stay within twice the torch path's own 16-bit error, both against the torch path
in float32 on the same inputs. Greedy tokens over a short run must then agree.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

DTYPES = ["bfloat16", "float16"]


def _prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(rng.randint(1, 230))] for _ in range(n)]


def _prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of one prompt's prefill step (its last position), float32."""
    eng = llm.engine
    captured = {}
    execute = eng.runner.execute

    def spy(scheduled, kv, layer_hook=None):
        logits, sampling = execute(scheduled, kv, layer_hook)
        captured.setdefault("logits", logits.float().clone())
        return logits, sampling

    eng.runner.execute = spy
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        eng.runner.execute = execute
    return captured["logits"][0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_flashinfer_logits_within_the_torch_paths_own_16bit_error(llama_dir, dtype):
    pytest.importorskip("flashinfer")
    ref32 = LLM(llama_dir, device="cuda", dtype="float32", attention_backend="torch")
    torch16 = LLM(llama_dir, device="cuda", dtype=dtype, attention_backend="torch")
    fi16 = LLM(llama_dir, device="cuda", dtype=dtype, attention_backend="flashinfer")
    assert fi16.engine.runner.backend.name == "flashinfer"
    for prompt in _prompts(4, seed=1):
        exact = _prefill_logits(ref32, prompt)
        err_torch = (_prefill_logits(torch16, prompt) - exact).abs().max().item()
        err_fi = (_prefill_logits(fi16, prompt) - exact).abs().max().item()
        print(f"{dtype} len={len(prompt)}: max |logit error| torch {err_torch:.4g}, flashinfer {err_fi:.4g}")
        assert err_fi <= 2 * err_torch + 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_flashinfer_greedy_matches_torch_backend(llama_dir, dtype):
    pytest.importorskip("flashinfer")
    prompts = _prompts()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref = LLM(llama_dir, device="cuda", dtype=dtype, attention_backend="torch").generate(prompts, params)
    outs = LLM(llama_dir, device="cuda", dtype=dtype, attention_backend="flashinfer").generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_flashinfer_chunked_prefill_and_prefix_cache(llama_dir):
    pytest.importorskip("flashinfer")
    shared = _prompts(1, seed=3)[0][:200]
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref = LLM(llama_dir, device="cuda", dtype="bfloat16", attention_backend="torch",
              enable_prefix_caching=False).generate(prompts, params)
    llm = LLM(llama_dir, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_num_batched_tokens=32)
    outs = [llm.generate([p], params)[0] for p in prompts]
    assert outs[1].num_cached_tokens >= 192
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_decode_cuda_graphs_match_eager(llama_dir):
    pytest.importorskip("flashinfer")
    prompts = _prompts(11, seed=4)  # 11 sequences: replays the 16-row graph with 5 padding rows
    params = SamplingParams(max_tokens=12, temperature=0.0)
    eager = LLM(llama_dir, device="cuda", dtype="bfloat16", attention_backend="flashinfer")
    graphs = LLM(llama_dir, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                 cuda_graphs=True, cuda_graph_max_batch=16)
    runner = graphs.engine.runner
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8, 16]
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda batch, size: replays.append(size) or run(batch, size)
    expected = eager.generate(prompts, params)
    outs = graphs.generate(prompts, params)
    assert 16 in replays
    assert [o.token_ids for o in outs] == [r.token_ids for r in expected]


def test_auto_backend_picks_flashinfer_on_cuda_in_16bit(llama_dir):
    pytest.importorskip("flashinfer")
    assert LLM(llama_dir, device="cuda", dtype="bfloat16").engine.runner.backend.name == "flashinfer"
    assert LLM(llama_dir, device="cuda", dtype="float32").engine.runner.backend.name == "torch"

