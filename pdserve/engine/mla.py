"""DeepSeek's multi-head latent attention (MLA) over the paged pool, in its absorbed form.

The numbers are HF `transformers`' ``DeepseekV3Attention``'s; the order of the products is not:

- the query: ``q_b_proj(q_a_layernorm(q_a_proj(h)))`` (or ``q_proj(h)`` when ``q_lora_rank`` is
  null), per head ``qk_nope_head_dim`` then ``qk_rope_head_dim`` columns;
- one latent per token: ``kv_a_proj_with_mqa(h)`` is ``[c_kv, k_pe]``; ``c_kv`` goes through
  ``kv_a_layernorm`` (both small norms use HF's default eps 1e-6, not ``rms_norm_eps``), ``k_pe``
  and each head's rope part are rotated (HF's interleaved pairs when ``rope_interleave``, else
  rotate-half; the rotated values are HF's bit for bit);
- the pool holds the latent, not per-head K/V: to the attention backends MLA is multi-query
  attention with ONE KV head of ``kv_lora_rank + qk_rope_head_dim``: ``K = [c_kv, k_pe]``,
  ``V = [c_kv, 0]``. So the pool, the prefix cache, the KV handoff and tensor parallelism work
  unchanged (one KV head is replicated over the TP ranks, engine/tensor_parallel.py);
- absorbed attention: ``kv_b_proj``'s rows are per head ``W_UK`` (``qk_nope_head_dim`` rows) and
  ``W_UV`` (``v_head_dim`` rows) over the latent. ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, so
  each head's query becomes ``[W_UK^T q_nope, q_pe]`` and attends the latent; the output's first
  ``kv_lora_rank`` columns times ``W_UV`` are the head's value, then ``o_proj``. The softmax
  scale is the model's (``ModelConfig.softmax_scale``: ``qk_head_dim ** -0.5``, with yarn's
  mscale squared), which the backends take as given.

Tensor parallelism: a rank holds its query heads' rows of ``q_b_proj`` (or ``q_proj``) and
``kv_b_proj`` and their columns of ``o_proj`` (row-parallel: one all-reduce, rank 0's bias);
``q_a_proj``, ``kv_a_proj_with_mqa`` and the norms are replicated, so every rank computes the same
latent and writes it into its own replica of the one KV head.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from .attention_base import AttentionBackend
from .config import MLAConfig, ModelConfig, RopeConfig
from .moe import Put, Take
from .tensor_parallel import Shard

# HF's DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm are built without the config's eps.
LATENT_NORM_EPS = 1e-6

Norm = Callable[[int, float], nn.Module]


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Yarn's inverse frequencies over ``dim`` rotary dimensions (HF `_compute_yarn_parameters`):
    extrapolated (plain) above the ramp, interpolated (divided by ``factor``) below it."""
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on ``x [T, heads, r]`` with ``cos``/``sin`` ``[T, 1, r]`` (``cat(freqs, freqs)``), as
    HF computes it: interleaved pairs ``(x0, x1), (x2, x3), ...`` come out in rotate-half order
    (first the pairs' first elements), which is how HF's q and k meet; else rotate-half."""
    half = x.shape[-1] // 2
    if interleave:
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]],
                     dim=-1)


class MLAttention(nn.Module):
    """One layer's latent attention (this rank's heads); returns ``o_proj``'s partial output."""

    def __init__(self, cfg: ModelConfig, shard: Shard, norm: Norm):
        super().__init__()
        assert cfg.mla is not None
        m: MLAConfig = cfg.mla
        self.mla = m
        self.num_heads = len(shard.q_heads)
        hidden = cfg.hidden_size
        q_out = self.num_heads * m.qk_head_dim
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: nn.Module | None = None
        self.q_proj: nn.Linear | None = None
        if m.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = norm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.cache_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = norm(m.kv_lora_rank, LATENT_NORM_EPS)
        # kv_b_proj split per head: W_UK [h, nope, c] and W_UV [h, v, c] (not nn.Linear: used absorbed).
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, m.qk_nope_head_dim, m.kv_lora_rank), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, m.v_head_dim, m.kv_lora_rank), requires_grad=False)
        self.o_proj = nn.Linear(self.num_heads * m.v_head_dim, hidden, bias=cfg.attention_bias and shard.is_root)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv,
                backend: AttentionBackend, meta) -> torch.Tensor:
        m, t = self.mla, h.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(h)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q_nope, q_pe = q.view(t, self.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(h).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = rotate(q_pe, cos, sin, m.rope_interleave)
        k_pe = rotate(k_pe[:, None, :], cos, sin, m.rope_interleave)
        # Absorb W_UK into the query: [h, t, nope] @ [h, nope, c] -> [t, h, c].
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat([q_lat, q_pe], dim=-1)
        key = torch.cat([c_kv[:, None, :], k_pe], dim=-1)
        value = torch.cat([c_kv[:, None, :], torch.zeros_like(k_pe)], dim=-1)
        out = backend.forward(layer_kv, query, key, value, meta)  # [t, h, c + r]
        # The value: the output's latent columns times W_UV: [h, t, c] @ [h, c, v] -> [t, h, v].
        o = torch.bmm(out[..., : m.kv_lora_rank].transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(o.reshape(t, self.num_heads * m.v_head_dim))


def load_mla(attn: MLAttention, prefix: str, shard: Shard, take: Take, put: Put,
             tensors: dict[str, torch.Tensor]) -> None:
    """One layer's attention weights (``prefix`` ends in ``self_attn.``), this rank's heads."""
    m = attn.mla
    heads = shard.q_heads

    def head_rows(w: torch.Tensor, per: int) -> torch.Tensor:
        return w[heads.start * per:heads.stop * per]

    if attn.q_proj is not None:
        put(attn.q_proj.weight, head_rows(take(prefix + "q_proj.weight"), m.qk_head_dim), prefix + "q_proj.weight")
    else:
        assert attn.q_a_proj is not None and attn.q_a_layernorm is not None
        put(attn.q_a_proj.weight, take(prefix + "q_a_proj.weight"), prefix + "q_a_proj.weight")
        if attn.q_a_proj.bias is not None:
            put(attn.q_a_proj.bias, take(prefix + "q_a_proj.bias"), prefix + "q_a_proj.bias")
        put(attn.q_a_layernorm.weight, take(prefix + "q_a_layernorm.weight"), prefix + "q_a_layernorm.weight")
        put(attn.q_b_proj.weight, head_rows(take(prefix + "q_b_proj.weight"), m.qk_head_dim),
            prefix + "q_b_proj.weight")
    put(attn.kv_a_proj_with_mqa.weight, take(prefix + "kv_a_proj_with_mqa.weight"), prefix + "kv_a_proj_with_mqa")
    if attn.kv_a_proj_with_mqa.bias is not None:
        put(attn.kv_a_proj_with_mqa.bias, take(prefix + "kv_a_proj_with_mqa.bias"), prefix + "kv_a_proj_with_mqa.bias")
    put(attn.kv_a_layernorm.weight, take(prefix + "kv_a_layernorm.weight"), prefix + "kv_a_layernorm.weight")
    per = m.qk_nope_head_dim + m.v_head_dim
    kv_b = head_rows(take(prefix + "kv_b_proj.weight"), per)
    want = (attn.num_heads * per, m.kv_lora_rank)
    if tuple(kv_b.shape) != want:
        put(torch.empty(want), kv_b, prefix + "kv_b_proj.weight")  # raises naming the weight and both shapes
    w_uk, w_uv = kv_b.view(attn.num_heads, per, m.kv_lora_rank).split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
    put(attn.w_uk, w_uk, prefix + "kv_b_proj.weight (W_UK)")
    put(attn.w_uv, w_uv, prefix + "kv_b_proj.weight (W_UV)")
    put(attn.o_proj.weight, attn_cols(take(prefix + "o_proj.weight"), heads, m.v_head_dim), prefix + "o_proj.weight")
    if attn.o_proj.bias is not None:
        put(attn.o_proj.bias, take(prefix + "o_proj.bias"), prefix + "o_proj.bias")
    else:
        tensors.pop(prefix + "o_proj.bias", None)  # rank 0 adds the row-parallel bias


def attn_cols(w: torch.Tensor, heads: range, per: int) -> torch.Tensor:
    return w[:, heads.start * per:heads.stop * per]
