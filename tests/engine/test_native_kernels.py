"""The CPU fast paths of the engine: oneDNN-packed linears (engine/linear.py) and the native
paged decode kernel (engine/native.py, engine/csrc/paged_decode.c), against references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import LLM, SamplingParams, native
from pdserve.engine.attention import make_backend
from pdserve.engine.attention_base import BatchLayout
from pdserve.engine.config import ConfigError
from pdserve.engine.linear import PackedLinear, pack_linears, resolve_linear_backend
from pdserve.engine.torch_attention import NATIVE_MAX_QUERY, TorchAttention

CPU = torch.device("cpu")
lib = native.load()
needs_kernel = pytest.mark.skipif(lib is None, reason=f"native kernel unavailable: {native.why_unavailable()}")


def reference_decode(q, pool, tables, lens, qidx, scale):
    """float64 softmax(q K^T * scale) V over each sequence's blocks, GQA as HF's repeat_kv."""
    nb, _, bs, hkv, d = pool.shape
    hq = q.shape[1]
    out = {}
    for i, (n, row) in enumerate(zip(lens, qidx)):
        blocks = pool[torch.as_tensor(tables[i][: -(-n // bs)], dtype=torch.long)].double()
        k = blocks[:, 0].reshape(-1, hkv, d)[:n]
        v = blocks[:, 1].reshape(-1, hkv, d)[:n]
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,thd->ht", q[row].double(), k) * scale
        out[row] = torch.einsum("ht,thd->hd", s.softmax(-1), v)
    return out


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (4, 4, 32), (8, 1, 36), (2, 1, 128)])
def test_the_kernel_matches_a_float64_reference_on_shuffled_blocks(hq, hkv, d):
    g = torch.Generator().manual_seed(hq * 100 + d)
    bs, nb = 16, 40
    pool = torch.randn(nb, 2, bs, hkv, d, generator=g)
    lens = np.array([1, 15, 16, 17, 100, 161], dtype=np.int32)  # block edges, partial blocks
    rng = np.random.default_rng(d)
    width = -(-int(lens.max()) // bs)
    tables = np.stack([rng.permutation(nb)[:width] for _ in lens]).astype(np.int32)
    # q as the engine passes it: a strided view into a fused qkv projection, rows out of order.
    qkv = torch.randn(9, hq * d + 2 * hkv * d, generator=g)
    q = qkv[:, : hq * d].view(9, hq, d)
    qidx = np.array([8, 0, 3, 5, 1, 7], dtype=np.int64)
    out = torch.full((9, hq, d), float("nan"))
    scale = d ** -0.5
    native.paged_decode(lib, q, pool, out, qidx, lens, tables, scale)
    ref = reference_decode(q, pool, tables, lens, qidx, scale)
    for row, want in ref.items():
        assert torch.allclose(out[row].double(), want, atol=2e-6, rtol=1e-5), (row, (out[row] - want).abs().max())
    untouched = sorted(set(range(9)) - set(qidx.tolist()))
    assert torch.isnan(out[untouched]).all()  # rows of other tokens are left alone


@needs_kernel
def test_the_kernel_refuses_out_of_range_inputs_instead_of_reading_outside_the_pool():
    pool = torch.zeros(4, 2, 16, 1, 8)
    q = torch.zeros(1, 1, 8)
    out = torch.empty(1, 1, 8)
    ok = dict(qidx=np.array([0], dtype=np.int64), lens=np.array([20], dtype=np.int32),
              tables=np.array([[1, 3]], dtype=np.int32))
    native.paged_decode(lib, q, pool, out, scale=1.0, **ok)
    for field, bad in (("tables", np.array([[1, 4]], dtype=np.int32)), ("lens", np.array([33], dtype=np.int32)),
                       ("lens", np.array([0], dtype=np.int32)), ("qidx", np.array([1], dtype=np.int64))):
        with pytest.raises(ValueError, match="out of range"):
            native.paged_decode(lib, q, pool, out, scale=1.0, **{**ok, field: bad})
    with pytest.raises(TypeError, match="int32"):
        native.paged_decode(lib, q, pool, out, scale=1.0, **{**ok, "lens": np.array([20])})


@needs_kernel
def test_a_mixed_step_attends_the_same_with_and_without_the_kernel():
    """Decode tokens, a short fresh prefill and a chunk after cached context (kernel) and a
    long prompt (SDPA) in one step."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, bs = 6, 2, 64, 16
    ctx = np.array([40, 0, 33, 7, 0], dtype=np.int64)
    new = np.array([1, 12, 5, 1, NATIVE_MAX_QUERY + 8], dtype=np.int64)
    qsl = np.concatenate(([0], np.cumsum(new)))
    long_blocks = list(range(12, 12 + -(-(NATIVE_MAX_QUERY + 8) // bs)))
    tables = np.array([[5, 2, 9, 0], [11, 0, 0, 0], [1, 3, 7, 0], [4, 0, 0, 0]], dtype=np.int64)
    tables = np.concatenate([np.pad(tables, ((0, 0), (0, len(long_blocks) - 4))), [long_blocks]])
    seq = np.repeat(np.arange(len(new)), new)
    pos = np.arange(qsl[-1]) - np.repeat(qsl[:-1] - ctx, new)
    slots = tables[seq, pos // bs] * bs + pos % bs
    layout = BatchLayout(qsl, ctx, tables, torch.from_numpy(slots), bs)
    t = int(qsl[-1])
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    base = torch.randn(12 + len(long_blocks), 2, bs, hkv, d, generator=g)
    outs = []
    for backend in (TorchAttention(d ** -0.5), TorchAttention(d ** -0.5, native=lib)):
        pool = base.clone()
        meta = backend.plan(layout, CPU)
        if backend.native is not None:
            assert len(meta.native.qidx) == int(new[:4].sum()) and meta.fresh == [(int(qsl[4]), int(qsl[5]))]
            assert not meta.paged
        else:
            assert meta.native is None
        outs.append(backend.forward(pool, q, k, v, meta))
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5), (outs[0] - outs[1]).abs().max()


@needs_kernel
def test_greedy_tokens_are_the_same_through_the_kernel_and_the_torch_path(llama_dir):
    prompts = [[(7 * i + 3 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 40, 33))]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    got = {}
    for attn in ("native", "torch"):
        llm = LLM(llama_dir, attention_backend=attn, linear_backend="torch", enable_prefix_caching=False)
        assert llm.engine.runner.backend.name == attn
        got[attn] = [o.token_ids for o in llm.generate(prompts, params)]
    assert got["native"] == got["torch"]


def test_auto_keeps_the_torch_path_and_says_why_when_no_compiler_is_found(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert make_backend("auto", device=CPU, scale=1.0, num_heads=2, num_kv_heads=1, head_dim=8,
                        dtype=torch.float32).name == "torch"
    assert "no C compiler" in native.why_unavailable()
    with pytest.raises(ValueError, match="attention_backend='native': no C compiler"):
        make_backend("native", device=CPU, scale=1.0, num_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)


def test_native_attention_is_refused_outside_float32_on_the_cpu():
    with pytest.raises(ValueError, match="float32 on the CPU"):
        make_backend("native", device=CPU, scale=1.0, num_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16)


@needs_kernel
def test_the_kernel_is_built_once_into_the_cache_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    path = native._build(native._compiler())
    assert path.startswith(str(tmp_path)) and path.endswith(".so")
    stamp = (tmp_path / path.rsplit("/", 1)[1]).stat().st_mtime_ns
    assert native._build(native._compiler()) == path
    assert (tmp_path / path.rsplit("/", 1)[1]).stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.rsplit("/", 1)[1]]  # no temporary left


def test_a_packed_linear_computes_the_linear_layer():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(48, 80, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 48, generator=g))
        lin.bias.copy_(torch.randn(80, generator=g))
    packed = PackedLinear(lin)
    for rows in (1, 4, 33):
        x = torch.randn(rows, 48, generator=g)
        want = F.linear(x.double(), lin.weight.double(), lin.bias.double())
        assert torch.allclose(packed(x).double(), want, atol=1e-4 * math.sqrt(48), rtol=1e-5)


def test_linear_backends_resolve_and_refuse_with_the_setting_named():
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"
    assert resolve_linear_backend("auto", CPU, torch.bfloat16) == "torch"
    with pytest.raises(ConfigError, match="linear_backend='onednn'.*float32 on the CPU"):
        resolve_linear_backend("onednn", CPU, torch.bfloat16)
    with pytest.raises(ConfigError, match="linear_backend='fast'; use auto, torch or onednn"):
        resolve_linear_backend("fast", CPU, torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False)))
    assert pack_linears(model, CPU, torch.float32, "torch") == "torch"
    assert isinstance(model[0], torch.nn.Linear)
    if resolve_linear_backend("auto", CPU, torch.float32) == "onednn":
        assert pack_linears(model, CPU, torch.float32, "auto") == "onednn"
        assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
