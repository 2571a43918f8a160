"""FlashInfer backend vs the torch reference path on the same GPU, in 16-bit (FlashInfer's
paged kernels have no float32 path).

Models: FlashInfer's kernels take head_dim 64/128/256/512, so these tests use the suite's
`llama_gpu` (GQA 4:1: the decode wrapper on tensor cores) and `qwen2_gpu` (GQA 2:1: the
CUDA-core decode kernel) shapes.

Tolerance: both backends round to bfloat16/float16 between ops but accumulate in a different
order, so neither equals the float32 result. The bound is measured, not guessed: FlashInfer's
logits must stay within twice the torch path's own 16-bit error, both against the torch path
in float32 on the same inputs. Greedy runs must then agree token for token, except where the
two picks are a tie within that bound in float32 (random weights make near-ties common; a
different reduction order, e.g. split-KV under CUDA graphs, may then pick either).
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

DTYPES = ["bfloat16", "float16"]
KV = 1 << 30  # each test holds several engines at once: a fixed pool each, not a device share


def _prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(rng.randint(1, 230))] for _ in range(n)]


def _prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of one prompt's prefill step (its last position), float32."""
    eng = llm.engine
    captured = {}
    execute = eng.runner.execute

    def spy(scheduled, kv, layer_hook=None):
        logits, batch = execute(scheduled, kv, layer_hook)
        captured.setdefault("logits", logits.float().clone())
        return logits, batch

    eng.runner.execute = spy
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        eng.runner.execute = execute
    return captured["logits"][0]


MODELS = ["llama_gpu", "qwen2_gpu"]


def needs_flashinfer() -> None:
    """On a GPU machine a missing FlashInfer is a failure, never a skip (issue 31)."""
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"FlashInfer is not importable ({exc}): pip install '.[gpu]', or run make gpu-check")


def _errors(model: str, dtype: str, prompts) -> tuple[LLM, float]:
    """The float32 reference engine and the torch path's own 16-bit logit error on ``prompts``."""
    ref32 = LLM(model, device="cuda", kv_cache_memory_bytes=KV, dtype="float32", attention_backend="torch")
    torch16 = LLM(model, device="cuda", kv_cache_memory_bytes=KV, dtype=dtype, attention_backend="torch")
    err = max((_prefill_logits(torch16, p) - _prefill_logits(ref32, p)).abs().max().item() for p in prompts)
    return ref32, err


def _assert_same_or_tie(ref32: LLM, prompts, got, want, tol: float) -> None:
    """Greedy runs agree, or first differ where the two picks tie within ``tol`` in float32."""
    for prompt, a, b in zip(prompts, got, want):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            assert len(a) == len(b)
            continue
        logits = _prefill_logits(ref32, prompt + a[:k])
        gap = abs(logits[a[k]] - logits[b[k]]).item()
        assert gap <= tol, f"token {k} differs ({a[k]} vs {b[k]}) with a float32 logit gap {gap:.4g} > {tol:.4g}"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_flashinfer_logits_within_the_torch_paths_own_16bit_error(model_dirs, name, dtype):
    needs_flashinfer()
    model = model_dirs(name)
    prompts = _prompts(4, seed=1)
    ref32, err_torch = _errors(model, dtype, prompts)
    fi16 = LLM(model, device="cuda", kv_cache_memory_bytes=KV, dtype=dtype, attention_backend="flashinfer")
    assert fi16.engine.runner.backend.name == "flashinfer"
    err_fi = max((_prefill_logits(fi16, p) - _prefill_logits(ref32, p)).abs().max().item() for p in prompts)
    print(f"{name} {dtype}: max |logit error| vs float32: torch {err_torch:.4g}, flashinfer {err_fi:.4g}")
    assert err_fi <= 2 * err_torch + 1e-3


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_flashinfer_greedy_matches_torch_backend(model_dirs, name, dtype):
    needs_flashinfer()
    model = model_dirs(name)
    prompts = _prompts()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref32, err = _errors(model, dtype, prompts[:2])
    ref = LLM(model, device="cuda", kv_cache_memory_bytes=KV, dtype=dtype, attention_backend="torch").generate(prompts, params)
    outs = LLM(model, device="cuda", kv_cache_memory_bytes=KV, dtype=dtype, attention_backend="flashinfer").generate(prompts, params)
    _assert_same_or_tie(ref32, prompts, [o.token_ids for o in outs], [r.token_ids for r in ref], 4 * err)


def test_flashinfer_with_the_hnd_pool_layout_matches_the_torch_path(model_dirs):
    """kv_layout HND (head-major pages: what a handoff between TP sizes needs): FlashInfer's
    append and decode/prefill kernels read and write the pool in that order; greedy tokens are
    the torch path's on the same layout, or differ first at a float32 tie."""
    needs_flashinfer()
    model = model_dirs("llama_gpu")
    prompts = _prompts(6, seed=7)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref32, err = _errors(model, "bfloat16", prompts[:2])
    args = dict(device="cuda", kv_cache_memory_bytes=KV, dtype="bfloat16", kv_layout="HND")
    ref = LLM(model, attention_backend="torch", **args).generate(prompts, params)
    llm = LLM(model, attention_backend="flashinfer", **args)
    assert llm.engine.runner.backend.name == "flashinfer" and llm.engine.runner.backend.kv_layout == "HND"
    outs = llm.generate(prompts, params)
    _assert_same_or_tie(ref32, prompts, [o.token_ids for o in outs], [r.token_ids for r in ref], 4 * err)


def test_flashinfer_chunked_prefill_and_prefix_cache(model_dirs):
    needs_flashinfer()
    model = model_dirs("llama_gpu")
    rng = random.Random(3)
    shared = [rng.randrange(3, 32000) for _ in range(200)]  # 12 full blocks of 16 and 8 tokens
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref32, err = _errors(model, "bfloat16", prompts[:1])
    ref = LLM(model, device="cuda", kv_cache_memory_bytes=KV, dtype="bfloat16", attention_backend="torch",
              enable_prefix_caching=False).generate(prompts, params)
    llm = LLM(model, device="cuda", kv_cache_memory_bytes=KV, dtype="bfloat16", attention_backend="flashinfer", max_num_batched_tokens=32)
    outs = [llm.generate([p], params)[0] for p in prompts]
    assert outs[1].num_cached_tokens >= 192
    _assert_same_or_tie(ref32, prompts, [o.token_ids for o in outs], [r.token_ids for r in ref], 4 * err)


@pytest.mark.parametrize("name", MODELS)
def test_decode_cuda_graphs_match_eager(model_dirs, name):
    needs_flashinfer()
    model = model_dirs(name)
    prompts = _prompts(11, seed=4)  # 11 sequences: replays the 16-row graph with 5 padding rows
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ref32, err = _errors(model, "bfloat16", prompts[:2])
    eager = LLM(model, device="cuda", kv_cache_memory_bytes=KV, dtype="bfloat16", attention_backend="flashinfer")
    graphs = LLM(model, device="cuda", kv_cache_memory_bytes=KV, dtype="bfloat16", attention_backend="flashinfer",
                 cuda_graphs=True, cuda_graph_max_batch=16)
    runner = graphs.engine.runner
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8, 16]
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda batch, size: replays.append(size) or run(batch, size)
    expected = eager.generate(prompts, params)
    outs = graphs.generate(prompts, params)
    assert 16 in replays
    _assert_same_or_tie(ref32, prompts, [o.token_ids for o in outs], [r.token_ids for r in expected], 4 * err)


def test_auto_backend_picks_flashinfer_where_it_has_kernels(model_dirs, llama_dir):
    needs_flashinfer()
    gpu_model = model_dirs("llama_gpu")
    assert LLM(gpu_model, device="cuda", kv_cache_memory_bytes=KV, dtype="bfloat16").engine.runner.backend.name == "flashinfer"
    assert LLM(gpu_model, device="cuda", kv_cache_memory_bytes=KV, dtype="float32").engine.runner.backend.name == "torch"
    assert LLM(llama_dir, device="cuda", kv_cache_memory_bytes=KV, dtype="bfloat16").engine.runner.backend.name == "torch"  # head_dim 16

