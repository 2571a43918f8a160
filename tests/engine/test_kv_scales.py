"""FP8 KV scales (engine/kv_scales.py, engine/kv_scale_calibration.py; docs/kv_cache.md "Scales").

Scales from the checkpoint, per tensor and per KV head, are what the pool is written with (its
stored values are the K/V divided by them, read back multiplied); computed scales are powers of
two that put each layer's (head's) calibration maximum within half the format's range, the
same on every engine of the model and at TP 1 and 2, and leave the pool empty; a pair whose
scales differ refuses naming the layer; bad checkpoints and arguments are refused naming the
tensor or the field. Remote = local with computed scales is in tests/engine/test_fp8_kv.py.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.config import ConfigError, EngineConfig
from pdserve.engine.kv_quant import FP8_MAX
from pdserve.engine.kv_scales import record, scales_from_amax
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer.nixl import KVLayout, LayoutMismatchError

PROMPT = [(i * 7919) % 31000 + 3 for i in range(40)]


def engine(model: str, **args) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model, num_gpu_blocks_override=64, max_num_batched_tokens=512,
                                              kv_cache_dtype="fp8_e4m3", **args))


def with_scales(src: str, dst, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of model ``src`` (links) with ``tensors`` in a second safetensors file."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), os.path.join(dst, name))
    save_file(tensors, os.path.join(dst, "kv_scales.safetensors"))
    return str(dst)


def layer0_pages(eng: LLMEngine) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's stored K and V of ``PROMPT`` (its first 32 tokens: two whole blocks), as float
    ``[tokens, heads, head_dim]``; the engine has run only that prompt."""
    eng.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0.0), request_id="p")
    eng.step()  # the prompt's prefill
    blocks = eng.kv.block_ids("p")[:2]
    assert len(blocks) == 2
    while eng.has_work():
        eng.step()
    pool = eng.runner.kv_cache[0, blocks].float()  # [2, 2 (K/V), block, heads, dim] (NHD)
    return pool[:, 0].reshape(-1, *pool.shape[-2:]), pool[:, 1].reshape(-1, *pool.shape[-2:])


def test_checkpoint_scales_per_tensor_and_per_head_are_what_the_pool_is_written_with(llama_dir, tmp_path):
    unit = engine(llama_dir)
    layers, heads = unit.model_config.num_layers, unit.model_config.num_kv_heads
    k1, v1 = layer0_pages(unit)
    per_tensor = {f"model.layers.{i}.self_attn.{n}": torch.tensor(s) for i in range(layers)
                  for n, s in (("k_scale", 1 / 64), ("v_scale", 1 / 32))}
    eng = engine(with_scales(llama_dir, tmp_path / "tensor", per_tensor))
    assert eng.connector.layout_info()["kv_scales"] == [[1 / 64, 1 / 32]] * layers
    k, v = layer0_pages(eng)
    # Layer 0 reads the same embeddings: the stored values are the unit scale's divided by the
    # scale, up to float8 rounding (3 mantissa bits), away from the subnormals.
    normal = k1.abs() > 0.05
    assert torch.allclose(k[normal] / 64, k1[normal], rtol=1 / 8) and not torch.equal(k, k1)
    assert torch.allclose(v[v1.abs() > 0.05] / 32, v1[v1.abs() > 0.05], rtol=1 / 8)

    per_head = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor([1 / 16 * 2 ** -h for h in range(heads)])
                for i in range(layers)}
    eng = engine(with_scales(llama_dir, tmp_path / "head", per_head))
    want = [1 / 16 * 2 ** -h for h in range(heads)]
    assert eng.connector.layout_info()["kv_scales"] == [[want, want]] * layers
    k, _ = layer0_pages(eng)
    for h in range(heads):
        n = k1[:, h].abs() > 0.05
        assert torch.allclose(k[:, h][n] * want[h], k1[:, h][n], rtol=1 / 8)
    out = LLM(with_scales(llama_dir, tmp_path / "head2", per_head), kv_cache_dtype="fp8").generate(
        [PROMPT], SamplingParams(max_tokens=6, temperature=0.0))
    assert len(out[0].token_ids) == 6


def test_computed_scales_are_powers_of_two_within_half_the_range_and_the_same_on_every_engine(llama_dir):
    a = engine(llama_dir, calculate_kv_scales=True)
    b = engine(llama_dir, calculate_kv_scales=True)
    q = a.runner.kv_quant
    assert torch.equal(q.scales, b.runner.kv_quant.scales)
    assert a.runner.kv_cache.float().abs().sum() == 0 and a.kv.num_free_blocks == a.runner.num_blocks
    scales = q.scales.flatten().tolist()
    assert all(s == 2.0 ** round(math.log2(s)) for s in scales) and any(s != 1.0 for s in scales)
    # per head: the scales differ between heads (the record lists them); per tensor: one value
    assert any(isinstance(half, list) for layer in a.connector.layout_info()["kv_scales"] for half in layer)
    t = engine(llama_dir, calculate_kv_scales=True, kv_scale_granularity="tensor")
    assert all(isinstance(half, float) for layer in t.connector.layout_info()["kv_scales"] for half in layer)
    assert torch.equal(t.runner.kv_quant.scales, q.scales.amax(dim=2, keepdim=True).expand_as(q.scales))
    # the stored values of a real prompt stay inside the format's range
    k, v = layer0_pages(a)
    assert 0 < float(k.abs().max()) <= FP8_MAX[torch.float8_e4m3fn]


def test_scales_from_amax_map_the_maximum_into_the_upper_half_of_the_range():
    amax = torch.tensor([[[1.77, 0.3], [100.0, 0.0]]])
    s = scales_from_amax(amax, 448.0, "head")
    for a, scale in zip(amax.flatten().tolist(), s.flatten().tolist()):
        if a == 0:
            assert scale == 1.0
        else:
            assert 448 / 4 < a / scale <= 448 / 2
    assert record(scales_from_amax(amax, 448.0, "tensor")) == [[2 ** math.ceil(math.log2(1.77 / 224)),
                                                                  2 ** math.ceil(math.log2(100 / 224))]]


@pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")
def test_computed_scales_are_the_same_at_tp_2_as_at_tp_1(llama_dir):
    one = engine(llama_dir, calculate_kv_scales=True)
    two = engine(llama_dir, calculate_kv_scales=True, tensor_parallel_size=2)
    try:
        assert two.connector.layout_info()["kv_scales"] == one.connector.layout_info()["kv_scales"]
        # each rank reads its own heads' columns (tokens at TP 2 against TP 1 with these scales:
        # the (2,1) remote pair in tests/engine/test_fp8_kv.py)
        assert two.runner.kv_quant.heads == range(0, 1)
        full = one.runner.kv_quant.scales
        assert two.runner.kv_quant.layer_scales(0) == (float(full[0, 0, 0]), float(full[0, 1, 0]))
    finally:
        two.close()


def test_a_scales_mismatch_names_the_first_layer_that_differs():
    base = KVLayout("m", "float8_e4m3fn", 3, 8, 16, 2, 64, kv_cache_dtype="fp8_e4m3",
                    kv_scales=((1.0, 1.0), (0.5, [0.25, 0.125]), (1.0, 1.0)))
    assert KVLayout.from_dict(base.to_dict()) == base
    other = KVLayout("m", "float8_e4m3fn", 3, 8, 16, 2, 64, kv_cache_dtype="fp8_e4m3",
                     kv_scales=((1.0, 1.0), (0.5, [0.25, 0.25]), (1.0, 1.0)))
    with pytest.raises(LayoutMismatchError, match="at layer 1") as info:
        base.check_compatible(other)
    assert info.value.field == "kv_scales" and "calculate_kv_scales" in str(info.value)
    with pytest.raises(ValueError, match="kv_scales"):
        KVLayout("m", "float8_e4m3fn", 1, 8, 16, 2, 64, kv_scales=((1.0, []),))


def test_bad_scale_arguments_and_checkpoints_are_refused_naming_them(llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        EngineConfig.from_kwargs(llama_dir, calculate_kv_scales=True)  # kv_cache_dtype auto
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        EngineConfig.from_kwargs(llama_dir, kv_cache_dtype="fp8", calculate_kv_scales="yes")
    with pytest.raises(ConfigError, match="kv_scale_granularity"):
        EngineConfig.from_kwargs(llama_dir, kv_cache_dtype="fp8", kv_scale_granularity="channel")
    with pytest.raises(ConfigError, match="calculate_kv_scales"):  # 8 blocks of 16 < 512 calibration tokens
        LLMEngine(EngineConfig.from_kwargs(llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=True,
                                           num_gpu_blocks_override=8))
    partial = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(0.5)}
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.k_scale"):
        engine(with_scales(llama_dir, tmp_path / "partial", partial))
    wrong = {"model.layers.0.self_attn.kv_scale": torch.ones(5)}
    with pytest.raises(ConfigError, match="kv_scale has 5 values"):
        engine(with_scales(llama_dir, tmp_path / "wrong", wrong))
    negative = {"model.layers.0.self_attn.kv_scale": torch.tensor(-1.0)}
    with pytest.raises(ConfigError, match="finite and positive"):
        engine(with_scales(llama_dir, tmp_path / "negative", negative))
