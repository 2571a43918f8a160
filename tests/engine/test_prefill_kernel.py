"""The tiled causal kernel for long fresh prompts (engine/prefill_native.py,
engine/csrc/prefill_attn.c): against a float64 reference, inside a mixed step, in the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine import LLM, SamplingParams, native, prefill_native
from pdserve.engine.attention import make_backend
from pdserve.engine.attention_base import BatchLayout
from pdserve.engine.torch_attention import NATIVE_MAX_QUERY, PREFILL_MIN_QUERY, TorchAttention

CPU = torch.device("cpu")
paged = native.load()
lib = prefill_native.load(64)
needs_kernel = pytest.mark.skipif(lib is None or paged is None,
                                  reason="the tiled prefill kernel needs AVX-512 and a C compiler here")


def reference(q, k, v, scale):
    """float64 causal softmax(q K^T * scale) V, GQA as HF's repeat_kv."""
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (4, 4, 32), (8, 1, 128), (3, 1, 64)])
@pytest.mark.parametrize("t", [1, 7, 8, 9, 16, 17, 100, 301])
def test_the_kernel_matches_a_float64_reference_on_views_into_qkv(hq, hkv, d, t):
    assert prefill_native.load(d) is not None
    g = torch.Generator().manual_seed(t * 7 + d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2  # the engine's fused projection
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    out = torch.full((t, hq, d), float("nan"))
    prefill_native.prefill_attention(lib, q, k, v, out, d ** -0.5)
    want = reference(q, k, v, d ** -0.5)
    # float32 rounding of the order torch's own float32 SDPA shows on the same inputs (its exp and
    # summation order differ: measured up to 2.5x SDPA's largest error, about 1e-6 of the values)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=d ** -0.5,
                                                            enable_gqa=True).squeeze(0).transpose(0, 1)
    err, sdpa_err = (out.double() - want).abs().max().item(), (sdpa.double() - want).abs().max().item()
    assert err <= max(4 * sdpa_err, 2e-6), (err, sdpa_err)


@needs_kernel
@needs_kernel
@pytest.mark.parametrize("offset,t", [(1, 8), (33, 300), (500, 17), (16, 16)])
def test_a_chunk_after_earlier_tokens_attends_them_all_and_itself_causally(offset, t):
    g = torch.Generator().manual_seed(offset + t)
    hq, hkv, d = 6, 2, 64
    q_all = torch.randn(offset + t, hq, d, generator=g)
    k, v = torch.randn(offset + t, hkv, d, generator=g), torch.randn(offset + t, hkv, d, generator=g)
    out = torch.full((t, hq, d), float("nan"))
    prefill_native.prefill_attention(lib, q_all[offset:], k, v, out, d ** -0.5, q_offset=offset)
    want = reference(q_all, k, v, d ** -0.5)[offset:]  # the whole prompt's causal attention, the chunk's rows
    assert (out.double() - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="disagree"):
        prefill_native.prefill_attention(lib, q_all[offset:], k[:-1], v[:-1], out, d ** -0.5, q_offset=offset)


@needs_kernel
def test_other_layouts_are_copied_and_a_bad_output_is_refused():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 40, 64, generator=g).transpose(0, 1)  # [40, 6, 64], heads not adjacent
    k, v = (torch.randn(40, 2, 64, generator=g) for _ in range(2))
    out = torch.empty(40, 6, 64)
    prefill_native.prefill_attention(lib, q, k, v, out, 0.125)
    assert torch.allclose(out.double(), reference(q, k, v, 0.125), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="out has an unexpected layout"):
        prefill_native.prefill_attention(lib, q, k, v, torch.empty(6, 40, 64).transpose(0, 1), 0.125)
    with pytest.raises(TypeError, match="float32"):
        prefill_native.prefill_attention(lib, q.double(), k, v, out, 0.125)


def test_sdpa_is_kept_when_asked_or_when_the_vector_path_does_not_serve_the_head_size(monkeypatch):
    assert prefill_native.load(36) is None  # not a multiple of 16
    monkeypatch.setenv(prefill_native.ENV, "sdpa")
    assert prefill_native.load(64) is None


@needs_kernel
def test_a_mixed_step_sends_only_long_fresh_prompts_to_it_and_attends_as_the_torch_path():
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, bs = 6, 2, 64, 16
    ctx = np.array([40, 0, 0, 33, 70, 20], dtype=np.int64)
    # decode, short fresh, long fresh, two long chunks after context, a short one
    new = np.array([1, 12, PREFILL_MIN_QUERY + 9, 300, NATIVE_MAX_QUERY + 20, 100], dtype=np.int64)
    qsl = np.concatenate(([0], np.cumsum(new)))
    need = [-(-(c + n) // bs) for c, n in zip(ctx, new)]
    width, start, rows = max(need), 0, []
    for n in need:
        rows.append(list(range(start, start + n)) + [0] * (width - n))
        start += n
    tables = np.array(rows, dtype=np.int64)
    seq = np.repeat(np.arange(len(new)), new)
    pos = np.arange(qsl[-1]) - np.repeat(qsl[:-1] - ctx, new)
    slots = tables[seq, pos // bs] * bs + pos % bs
    layout = BatchLayout(qsl, ctx, tables, torch.from_numpy(slots), bs)
    t = int(qsl[-1])
    q, k, v = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    base = torch.randn(start, 2, bs, hkv, d, generator=g)
    tiled = TorchAttention(d ** -0.5, native=paged, prefill=lib)
    meta = tiled.plan(layout, CPU)
    assert meta.fresh == [(int(qsl[2]), int(qsl[3]))]  # the long fresh prompt
    assert [(gr.context, gr.q0, gr.q1) for gr in meta.paged] == [(33, int(qsl[3]), int(qsl[4])),
                                                                 (70, int(qsl[4]), int(qsl[5]))]  # the long chunks
    assert len(meta.native.qidx) == int(new[0] + new[1] + new[5])  # the rest: the paged kernel
    got = tiled.forward(base.clone(), q, k, v, meta)
    plain = TorchAttention(d ** -0.5)
    want = plain.forward(base.clone(), q, k, v, plain.plan(layout, CPU))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@needs_kernel
def test_the_native_backend_takes_it_and_greedy_tokens_match_the_torch_path(llama_dir):
    backend = make_backend("native", device=CPU, scale=64 ** -0.5, num_heads=6, num_kv_heads=2, head_dim=64,
                           dtype=torch.float32)
    assert backend.prefill is not None
    prompts = [[(7 * i + 3 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((PREFILL_MIN_QUERY + 1, 700))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for attn in ("native", "torch"):
        llm = LLM(llama_dir, attention_backend=attn, enable_prefix_caching=False)
        assert (llm.engine.runner.backend.prefill is not None) == (attn == "native")
        got[attn] = [o.token_ids for o in llm.generate(prompts, params)]
        # a long prompt in chunks of 400: the later ones attend the earlier through the kernel too
        chunked = LLM(llama_dir, attention_backend=attn, enable_prefix_caching=False, max_num_batched_tokens=400)
        got[attn].append(chunked.generate([[(5 * j) % 997 + 3 for j in range(1200)]], params)[0].token_ids)
    assert got["native"] == got["torch"]
