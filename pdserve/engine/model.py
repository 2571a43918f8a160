"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3)
over a flat, unpadded batch.

The numerics follow Hugging Face `transformers` step for step (RMSNorm in
float32, rotate-half RoPE with cos/sin computed in float32, SiLU-gated MLP; Qwen3's
per-head query/key RMSNorm before RoPE; the mixture-of-experts MLP of engine/moe.py; DeepSeek's
latent attention of engine/mla.py),
so greedy output matches `generate` token for token in float32 (docs/models.md).
"""

from __future__ import annotations

import glob
import math
import os

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .attention_base import AttentionBackend
from .config import ConfigError, ModelConfig, RopeConfig
from .config_mla import yarn_attention_factor
from .kv_ready import layer_ready
from .mla import MLAttention, load_mla, yarn_inv_freq
from .moe import Put, SparseMoE, Take, load_experts
from .tensor_parallel import Shard, whole


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, head_dim)
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths are divided by
        # `factor`, short ones kept, the band between interpolated smoothly.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place, HF's ``x * cos + rotate_half(x) * sin`` rounding for rounding.

    With ``x = [x1, x2]`` that is ``[x1*cos1 - x2*sin1, x2*cos2 + x1*sin2]``:
    negation is exact and ``a + (-b) == a - b``, so the values are HF's bit for
    bit, made with three half-size temporaries instead of five full-size ones
    (fresh multi-MB tensors cost page faults on CPU prefill).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    first = x1 * cos[..., :half]
    first.sub_(x2 * sin[..., :half])
    x1_sin = x1 * sin[..., half:]
    x2.mul_(cos[..., half:]).add_(x1_sin)
    x1.copy_(first)


def rope_tables(inv_freq: torch.Tensor, factor: float, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin [T, 1, D] of ``positions`` (broadcast over heads), times yarn's ``factor``."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # In place on a fresh tensor; weight * h == h * weight bit for bit.
        return h.to(dtype).mul_(self.weight)


class DecoderLayer(nn.Module):
    """One layer, or its tensor-parallel shard (engine/tensor_parallel.py): this rank's heads
    and intermediate rows; ``comm`` sums the row-parallel outputs over the ranks. Its MLP is
    dense (``gate_up_proj``, ``down_proj``) or, in a mixture-of-experts model's sparse layer,
    ``moe`` (engine/moe.py)."""

    def __init__(self, cfg: ModelConfig, shard: Shard, comm=None, index: int = 0):
        super().__init__()
        self.comm = comm
        self.num_heads = len(shard.q_heads)
        self.num_kv_heads = len(shard.kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        inter = len(shard.inter)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # DeepSeek's latent attention (engine/mla.py) in place of q/k/v and o_proj.
        self.mla = MLAttention(cfg, shard, RMSNorm) if cfg.mla is not None else None
        if self.mla is None:
            # q, k, v fused into one matmul; gate and up likewise. Row-parallel biases: rank 0's only.
            self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
            self.o_proj = nn.Linear(self.q_size, cfg.hidden_size,
                                    bias=cfg.attention_bias and cfg.architecture != "qwen2" and shard.is_root)
        # Qwen3: RMSNorm over each query and key head, before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.moe = (SparseMoE(cfg.hidden_size, cfg.moe, len(shard.moe_inter), shard.experts, len(shard.shared_inter))
                    if cfg.moe is not None and cfg.moe.is_sparse(index) else None)
        if self.moe is None:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
            self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias and shard.is_root)

    def forward(self, x, cos, sin, layer_kv, backend: AttentionBackend, meta) -> torch.Tensor:
        t = x.shape[0]
        h = self.input_layernorm(x)
        if self.mla is not None:
            return self._finish(self.mla(h, cos, sin, layer_kv, backend, meta), x)
        qkv = self.qkv_proj(h)
        # Views into qkv. RoPE rotates q and k together, in place (same heads' layout).
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q, k = self.q_norm(q), self.k_norm(k)  # fresh tensors, rotated in place below
            apply_rope_(q, cos, sin)
            apply_rope_(k, cos, sin)
        else:
            apply_rope_(qk, cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        attn = backend.forward(layer_kv, q, k, v, meta)
        # Residual adds and the MLP activation run in place on fresh matmul outputs
        # (a + b == b + a bit for bit) to avoid a new activation-sized tensor each.
        return self._finish(self.o_proj(attn.reshape(t, self.q_size)), x)

    def _finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention's output ``o`` (this rank's partial sum) onto the residual, then the MLP."""
        if self.comm is not None:
            self.comm.all_reduce_(o)
        x = o.add_(x)
        h = self.post_attention_layernorm(x)
        if self.moe is not None:
            d = self.moe(h)
        else:
            gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
            d = self.down_proj(F.silu(gate, inplace=True).mul_(up))
        if self.comm is not None:
            self.comm.all_reduce_(d)
        return d.add_(x)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (of one tensor-parallel rank when
    ``shard`` is given: a vocabulary slice of the embedding and LM head)."""

    def __init__(self, cfg: ModelConfig, shard: Shard | None = None, comm=None):
        super().__init__()
        self.cfg = cfg
        self.shard = shard or whole(cfg)
        self.comm = comm
        self.embed_tokens = nn.Embedding(self.shard.vocab_per_rank, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.shard, comm, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, self.shard.vocab_per_rank, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.rope_dim), persistent=False)
        self.rope_factor = yarn_attention_factor(cfg.rope)  # yarn's cos/sin factor (else 1)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_tables(self.inv_freq, self.rope_factor, positions, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: ids outside this rank's slice embed to zero; the sum has one term.
        local = input_ids - self.shard.vocab.start
        inside = (local >= 0) & (local < len(self.shard.vocab))
        x = self.embed_tokens(local.clamp_(0, self.shard.vocab_per_rank - 1))
        x.mul_(inside[:, None].to(x.dtype))
        return self.comm.all_reduce_(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the whole vocabulary (at rank 0; None on the other ranks)."""
        local = self.lm_head(x).float()
        if self.comm is None:
            return local
        parts = self.comm.gather(local)
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, : self.cfg.vocab_size]

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, backend, meta, logits_indices,
                layer_hook=None) -> torch.Tensor | None:
        """Return logits [len(logits_indices), vocab] in float32 (None on a rank other than 0).

        ``layer_hook(l, ready)``, when given, runs right after layer ``l`` was
        issued (used to stream pages layer by layer to a decode worker); its KV
        pages are final once ``ready`` says so (engine/kv_ready.py: a CUDA event
        recorded after the layer; on CPU always ready).
        """
        x = self.embed(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        kept: list[torch.Tensor] = []
        for l, layer in enumerate(self.layers):
            if l in self.capture_layers:
                kept.append(x)  # (layers never write their input in place)
            x = layer(x, cos, sin, kv_cache[l], backend, meta)
            if layer_hook is not None:
                layer_hook(l, layer_ready(x.device))
        if self.capture_layers or self.capture_final:
            self._capture(x, kept)
        return self.logits(self.norm(x[logits_indices]))

    # Hidden states kept for an EAGLE head (engine/spec_eagle.py), every position of a forward:
    # the residual stream after each of ``capture_layers`` layers (vLLM's aux layer ids: 0 the
    # embeddings, num_layers the last layer's output before the final norm), concatenated in
    # that order, or with ``capture_final`` the final norm's output. Read (and cleared) by the head.
    capture_layers: tuple[int, ...] = ()
    capture_final: bool = False
    captured: torch.Tensor | None = None

    def _capture(self, x: torch.Tensor, kept: list[torch.Tensor]) -> None:
        if self.capture_final:
            self.captured = self.norm(x)
            return
        if len(self.layers) in self.capture_layers:
            kept.append(x)
        self.captured = torch.cat(kept, dim=-1)


def _rows(t: torch.Tensor, part: range, per: int = 1) -> torch.Tensor:
    """Rows ``[part.start * per, part.stop * per)`` of ``t`` (dim 0)."""
    return t[part.start * per:part.stop * per]


def _cols(t: torch.Tensor, part: range, per: int = 1) -> torch.Tensor:
    return t[:, part.start * per:part.stop * per]


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, shard: Shard | None = None,
               comm=None) -> CausalLM:
    """Build the model (or one rank's shard of it) and load HF safetensors weights, fusing
    q/k/v and gate/up."""
    files = sorted(glob.glob(os.path.join(cfg.path, "*.safetensors")))
    if not files:
        raise ConfigError(f"model={cfg.path!r}: no *.safetensors weight files in that directory")
    shard = shard or whole(cfg)
    with torch.device("meta"):
        model = CausalLM(cfg, shard, comm)
    model = model.to_empty(device=device).to(dtype)
    model.inv_freq = rope_inv_freq(cfg.rope, cfg.rope_dim).to(device)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)

    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise ConfigError(f"model={cfg.path!r}: weight {name!r} is missing") from None

    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ConfigError(
                f"model={cfg.path!r}: weight {name} has shape {tuple(value.shape)}, "
                f"config.json implies {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(value.to(dtype))

    def vocab_rows(t: torch.Tensor, name: str) -> torch.Tensor:
        if t.shape[0] != cfg.vocab_size:
            raise ConfigError(f"model={cfg.path!r}: weight {name} has {t.shape[0]} rows, config.json "
                              f"says vocab_size={cfg.vocab_size}")
        part = _rows(t, shard.vocab)
        pad = shard.vocab_per_rank - part.shape[0]
        return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part

    put(model.embed_tokens.weight, vocab_rows(take("model.embed_tokens.weight"), "embed_tokens"),
        "model.embed_tokens.weight")
    put(model.norm.weight, take("model.norm.weight"), "model.norm.weight")
    if not cfg.tie_word_embeddings:
        put(model.lm_head.weight, vocab_rows(take("lm_head.weight"), "lm_head"), "lm_head.weight")
    else:
        model.lm_head.weight = model.embed_tokens.weight
        tensors.pop("lm_head.weight", None)
    for i, layer in enumerate(model.layers):
        load_layer(layer, f"model.layers.{i}.", cfg, shard, take, put, tensors)
    model.eval()
    return model


def load_layer(layer: DecoderLayer, p: str, cfg: ModelConfig, shard: Shard, take: Take, put: Put,
               tensors: dict[str, torch.Tensor]) -> None:
    """One decoder layer's weights, named ``p`` + HF's names (``model.layers.{i}.``; a DeepSeek
    MTP layer's block too, engine/spec_mtp_model.py), this rank's part."""
    for norm in ("input_layernorm", "post_attention_layernorm"):
        put(getattr(layer, norm).weight, take(p + norm + ".weight"), p + norm)
    if layer.mla is not None:
        load_mla(layer.mla, p + "self_attn.", shard, take, put, tensors)
    else:
        _load_attention(layer, p, shard, cfg.head_dim, take, put, tensors, cfg.path)
    if layer.moe is not None:
        load_experts(layer.moe, p, tensors, take, put, shard.moe_inter, shard.shared_inter)
        if layer.post_attention_layernorm.weight.device.type == "cuda":
            layer.moe.experts.stack_for_grouped_mm()
    else:
        _load_dense_mlp(layer, p, take, put, shard.inter)


def _load_attention(layer: DecoderLayer, p: str, shard: Shard, hd: int, take: Take, put: Put,
                    tensors: dict[str, torch.Tensor], path: str) -> None:
    """One layer's q/k/v (fused) and o_proj, this rank's heads; Qwen3's q/k norms."""
    heads = {"q": shard.q_heads, "k": shard.kv_heads, "v": shard.kv_heads}
    qkv = [_rows(take(p + f"self_attn.{n}_proj.weight"), heads[n], hd) for n in "qkv"]
    put(layer.qkv_proj.weight, torch.cat(qkv), p + "self_attn.qkv")
    if layer.qkv_proj.bias is not None:
        bias = [_rows(take(p + f"self_attn.{n}_proj.bias"), heads[n], hd) for n in "qkv"]
        put(layer.qkv_proj.bias, torch.cat(bias), p + "qkv.bias")
    put(layer.o_proj.weight, _cols(take(p + "self_attn.o_proj.weight"), shard.q_heads, hd), p + "self_attn.o_proj")
    o_bias = tensors.pop(p + "self_attn.o_proj.bias", None)
    if layer.o_proj.bias is not None:
        if o_bias is None:
            raise ConfigError(f"model={path!r}: weight {p}self_attn.o_proj.bias is missing")
        put(layer.o_proj.bias, o_bias, p + "o_proj.bias")
    if layer.q_norm is not None and layer.k_norm is not None:
        put(layer.q_norm.weight, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm")
        put(layer.k_norm.weight, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm")


def _load_dense_mlp(layer: DecoderLayer, p: str, take: Take, put: Put, inter: range) -> None:
    """A dense MLP's weights (this rank's intermediate rows ``inter``), gate and up fused."""
    gate, up = (_rows(take(p + f"mlp.{n}_proj.weight"), inter) for n in ("gate", "up"))
    put(layer.gate_up_proj.weight, torch.cat([gate, up]), p + "mlp.gate_up")
    put(layer.down_proj.weight, _cols(take(p + "mlp.down_proj.weight"), inter), p + "mlp.down_proj")
    if layer.gate_up_proj.bias is not None:
        gate_b, up_b = (_rows(take(p + f"mlp.{n}_proj.bias"), inter) for n in ("gate", "up"))
        put(layer.gate_up_proj.bias, torch.cat([gate_b, up_b]), p + "gate_up.bias")
        down_b = take(p + "mlp.down_proj.bias")
        if layer.down_proj.bias is not None:
            put(layer.down_proj.bias, down_b, p + "down.bias")
