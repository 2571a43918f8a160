"""The model families of issue 58 on a CUDA device (`gpu`-marked; bench/gpu_check.sh runs them):
Qwen3, Qwen3-MoE and Mixtral (their experts on the grouped-GEMM path, which the device takes
by default), DeepSeek-V3 (latent attention on the torch path): greedy output equals HF
transformers' in float32, batched and chunked, and again from the prefix cache; an FP8 KV pool
on the device is float8 and its output deterministic, with and without the prefix cache."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

from .test_hf_parity import hf_greedy
from .test_model_families import MAX_TOKENS, family_dirs, greedy, prompts_for  # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu

FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3_noq"]


def family_on_the_device_matches_hf(model_dir: str, name: str, device: str) -> None:
    """The check, with its device an argument (a CPU dry run calls it with "cpu")."""
    prompts = prompts_for(seed=len(name))
    llm = LLM(model_dir, device=device, dtype="float32", max_num_batched_tokens=64, gpu_memory_utilization=0.2)
    model = llm.engine.runner.model
    assert next(model.parameters()).device.type == torch.device(device).type
    moes = [layer.moe for layer in model.layers if layer.moe is not None]
    assert bool(moes) == (name != "qwen3")
    if device.startswith("cuda"):  # the device's expert path (engine/model.py stacks them at load)
        assert all(m.experts.path == "grouped" for m in moes), [m.experts.path for m in moes]
    ref = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert greedy(llm, prompts) == ref
    cached = llm.engine.stats.num_prompt_tokens_cached
    assert greedy(llm, prompts) == ref  # the full blocks from the prefix cache now
    assert llm.engine.stats.num_prompt_tokens_cached > cached


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_on_the_device_matches_hf(family_dirs, name):
    family_on_the_device_matches_hf(family_dirs(name), name, "cuda")


def fp8_on_the_device_is_deterministic(model_dir: str, device: str, dtype: str) -> None:
    prompts = prompts_for(seed=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    args = dict(device=device, dtype=dtype, kv_cache_dtype="fp8", max_num_batched_tokens=64, gpu_memory_utilization=0.2)
    llm = LLM(model_dir, **args)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == first  # prefixes from the cache
    fresh = LLM(model_dir, enable_prefix_caching=False, **args)
    assert [o.token_ids for o in fresh.generate(prompts, params)] == first
    assert all(len(t) == MAX_TOKENS for t in first)
    pool = llm.engine.runner.kv_cache
    assert pool.device.type == torch.device(device).type
    assert pool.dtype == torch.float8_e4m3fn and pool.float().abs().sum() > 0


@pytest.mark.parametrize("name,dtype", [("qwen3", "bfloat16"), ("deepseek_v3", "bfloat16")])
def test_an_fp8_pool_on_the_device_is_deterministic(family_dirs, name, dtype):
    """The torch attention path over a float8 pool on the device (FlashInfer's FP8 path is not
    wired: `auto` picks torch); DeepSeek's pool is its one latent head."""
    fp8_on_the_device_is_deterministic(family_dirs(name), "cuda", dtype)
