"""The native paged decode kernel over a float8 pool (csrc/paged_decode.c, engine/native.py).

Every finite float8 byte of both formats widens to exactly torch's value (the vector path and the
scalar tail); the kernel over a float8 pool with per-head scales gives what it gives over the
same pool dequantized to float32, NHD and HND, grouped-query; an FP8 engine on the native
backend generates the tokens of the torch path, with the prefix cache and per-head computed
scales; bad scales are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine import LLM, SamplingParams, native

FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)

lib = native.load()
pytestmark = pytest.mark.skipif(lib is None, reason=f"native kernels unavailable: {native.why_unavailable()}")


def finite_bytes(fmt: torch.dtype) -> torch.Tensor:
    b = torch.arange(256, dtype=torch.int32)
    nan_or_inf = (b & 0x7F) == 0x7F if fmt == torch.float8_e4m3fn else ((b >> 2) & 0x1F) == 0x1F
    return b[~nan_or_inf].to(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_finite_byte_widens_to_torchs_value(fmt):
    values = finite_bytes(fmt)
    d = 12  # 8 lanes through the vector path, 4 through the scalar one
    rows = -(-len(values) // d)
    padded = torch.zeros(rows * d, dtype=torch.uint8)
    padded[:len(values)] = values
    # block r holds row r as its token 0's V (one KV head); K is zero: weight 1 on that token
    pool = torch.zeros(rows, 2, 16, 1, d, dtype=torch.uint8)
    pool[:, 1, 0, 0] = padded.view(rows, d)
    pool = pool.view(fmt)
    q = torch.randn(rows, 1, d)
    out = torch.zeros(rows, 1, d)
    f = native.FP8_FACTOR[fmt]
    native.paged_decode(lib, q, pool, out, np.arange(rows, dtype=np.int64), np.ones(rows, dtype=np.int32),
                        np.arange(rows, dtype=np.int32)[:, None].copy(), 0.1,
                        fp8_scales=(np.array([f], np.float32), np.array([0.5 * f], np.float32)))
    want = padded.view(fmt).float().view(rows, d) * 0.5
    assert torch.equal(out[:, 0], want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_kernel_over_float8_equals_it_over_the_dequantized_pool(fmt, layout):
    torch.manual_seed(1)
    blocks, bs, kv_heads, heads, d = 6, 16, 2, 6, 32
    raw = (torch.randn(blocks, 2, bs, kv_heads, d) * 4).clamp(-400, 400).to(fmt)
    k_scale, v_scale = np.array([0.25, 2.0], np.float32), np.array([1.0, 0.125], np.float32)
    deq = raw.float()
    deq[:, 0] *= torch.from_numpy(k_scale)[:, None]
    deq[:, 1] *= torch.from_numpy(v_scale)[:, None]
    if layout == "HND":  # the kernel takes the transposed view of a contiguous HND pool
        raw = raw.transpose(2, 3).contiguous().transpose(2, 3)
        deq = deq.transpose(2, 3).contiguous().transpose(2, 3)
    q = torch.randn(5, heads, d)
    lens = np.array([1, 15, 16, 17, 70], dtype=np.int32)
    tables = np.array([[5, 0, 3, 1, 2], [4, 0, 0, 0, 0], [1, 0, 0, 0, 0], [2, 3, 0, 0, 0], [3, 1, 0, 2, 5]], np.int32)
    qidx = np.array([4, 0, 2, 1, 3], dtype=np.int64)
    want, got = torch.zeros(5, heads, d), torch.zeros(5, heads, d)
    native.paged_decode(lib, q, deq, want, qidx, lens, tables, d ** -0.5)
    f = native.FP8_FACTOR[fmt]
    native.paged_decode(lib, q, raw, got, qidx, lens, tables, d ** -0.5, fp8_scales=(k_scale * f, v_scale * f))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6) and want.abs().sum() > 0
    with pytest.raises(TypeError, match="scales"):
        native.paged_decode(lib, q, raw, got, qidx, lens, tables, 0.1)
    with pytest.raises(ValueError, match="fp8_scales"):
        native.paged_decode(lib, q, raw, got, qidx, lens, tables, 0.1, fp8_scales=(k_scale[:1], v_scale[:1]))


@pytest.mark.parametrize("args", [{"kv_cache_dtype": "fp8_e4m3"},
                                  {"kv_cache_dtype": "fp8_e5m2", "kv_layout": "HND"},
                                  {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True}])
def test_an_fp8_engine_on_the_native_kernel_generates_the_torch_paths_tokens(llama_dir, args):
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 32000, 40).tolist()
    ps = [shared + rng.integers(3, 32000, n).tolist() for n in (3, 30)] + [rng.integers(3, 32000, 9).tolist()]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    fast = LLM(llama_dir, attention_backend="native", **args)
    assert fast.engine.runner.backend.name == "native"
    got = [o.token_ids for o in fast.generate(ps, params)]
    want = [o.token_ids for o in LLM(llama_dir, attention_backend="torch", **args).generate(ps, params)]
    assert got == want
    assert [o.token_ids for o in fast.generate(ps, params)] == want  # again, the shared prefix from the cache
