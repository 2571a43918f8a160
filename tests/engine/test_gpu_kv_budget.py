"""The GPU KV pool budget (engine/runner.py gpu_kv_budget): a per-engine share of the device
that never takes what others hold, checked with device figures given by hand, and (on a GPU)
two engines at default settings in one process."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, ConfigError, EngineConfig, SamplingParams
from pdserve.engine.runner import GPU_ACTIVATION_RESERVE_BYTES, gpu_kv_budget

GIB = 1 << 30
RESERVE = GPU_ACTIVATION_RESERVE_BYTES


def cfg(**kw) -> EngineConfig:
    return EngineConfig(model="m", **kw)


def test_a_fresh_device_gives_the_share_less_weights_and_reserve():
    budget, field, how = gpu_kv_budget(cfg(gpu_memory_utilization=0.5), free=78 * GIB, total=80 * GIB,
                                       own_bytes=2 * GIB)
    assert budget == 40 * GIB - 2 * GIB - RESERVE
    assert field == "gpu_memory_utilization" and "share 0.5" in how


def test_a_second_engine_gets_what_the_first_left_not_a_negative_budget():
    # The first engine (0.85 of 80 GiB) holds 68 GiB; the old formula gave 68 - 68 - 2 - 2 < 0.
    budget, _, how = gpu_kv_budget(cfg(gpu_memory_utilization=0.85), free=10 * GIB, total=80 * GIB,
                                   own_bytes=2 * GIB)
    assert budget == 10 * GIB - RESERVE
    assert "free 10.00 GiB" in how


def test_two_workers_splitting_a_device_each_get_their_share():
    first, _, _ = gpu_kv_budget(cfg(gpu_memory_utilization=0.45), free=79 * GIB, total=80 * GIB, own_bytes=GIB)
    left = 79 * GIB - first - GIB  # the first worker's pool and weights are gone from free
    second, _, _ = gpu_kv_budget(cfg(gpu_memory_utilization=0.45), free=left, total=80 * GIB, own_bytes=GIB)
    assert first == second == int(80 * GIB * 0.45) - GIB - RESERVE


def test_an_explicit_pool_size_is_used_on_a_gpu_too_and_refused_when_it_cannot_fit():
    budget, field, _ = gpu_kv_budget(cfg(kv_cache_memory_bytes=3 * GIB), free=20 * GIB, total=80 * GIB,
                                     own_bytes=GIB)
    assert (budget, field) == (3 * GIB, "kv_cache_memory_bytes")
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes: 30.00 GiB asked.*lower kv_cache_memory_bytes"):
        gpu_kv_budget(cfg(kv_cache_memory_bytes=30 * GIB), free=20 * GIB, total=80 * GIB, own_bytes=GIB)


def test_a_small_device_keeps_a_tenth_back_not_two_gib():
    budget, _, _ = gpu_kv_budget(cfg(gpu_memory_utilization=1.0), free=4 * GIB, total=4 * GIB, own_bytes=0)
    assert budget == 4 * GIB - (4 * GIB) // 10


def test_a_full_device_is_refused_naming_what_to_change(monkeypatch, llama_dir):
    """The engine's own error when nothing is left: the runner reads the device through
    torch.cuda; here those readings are given by hand (only their figures matter)."""
    from pdserve.engine import runner as runner_mod

    model_cfg = LLM(llama_dir, kv_cache_memory_bytes=4 << 20).engine.model_config
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    runner = runner_mod.ModelRunner.__new__(runner_mod.ModelRunner)  # its budget step alone
    runner.device, runner.own_bytes, runner.block_size = torch.device("cuda"), 0, 16
    runner.dtype, runner.model_cfg, runner.num_kv_heads = torch.bfloat16, model_cfg, model_cfg.num_kv_heads
    runner.kv_dtype = torch.bfloat16  # (the pool's element type: kv_cache_dtype auto)
    with pytest.raises(ConfigError, match="gpu_memory_utilization: the KV budget .* other engines or processes"):
        runner._num_blocks(cfg())


@pytest.mark.gpu
def test_two_engines_at_default_settings_start_in_one_process(model_dirs):
    """The old budget subtracted what the first engine held from the second's share: negative."""
    import gc

    model = model_dirs("llama_gpu")
    try:
        first = LLM(model, device="cuda", dtype="bfloat16")
        second = LLM(model, device="cuda", dtype="bfloat16")
        free, total = torch.cuda.mem_get_info()
        assert first.engine.runner.num_blocks > second.engine.runner.num_blocks > 0
        assert free > 0
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outs = [llm.generate([[5, 6, 7, 8]], params)[0].token_ids for llm in (first, second)]
        assert outs[0] == outs[1] and len(outs[0]) == 4
    finally:  # the device share goes back to the other gpu tests
        first = second = None
        gc.collect()
        torch.cuda.empty_cache()
