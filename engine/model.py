"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat, unpadded batch.

The numerics follow Hugging Face `transformers` step for step (RMSNorm in
float32, rotate-half RoPE with cos/sin computed in float32, SiLU-gated MLP),
so greedy output matches `generate` token for token in float32.
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
from .kv_ready import layer_ready


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # q, k, v fused into one matmul; gate and up likewise.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.architecture != "qwen2")
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x, cos, sin, layer_kv, backend: AttentionBackend, meta) -> torch.Tensor:
        t = x.shape[0]
        h = self.input_layernorm(x)
        qkv = self.qkv_proj(h)
        # Views into qkv. RoPE rotates q and k together, in place (same heads' layout).
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        apply_rope_(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        attn = backend.forward(layer_kv, q, k, v, meta)
        # Residual adds and the MLP activation run in place on fresh matmul outputs
        # (a + b == b + a bit for bit) to avoid a new activation-sized tensor each.
        x = self.o_proj(attn.reshape(t, self.q_size)).add_(x)
        h = self.post_attention_layernorm(x)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up)).add_(x)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        # [T, 1, D]: broadcast over heads.
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, backend, meta, logits_indices,
                layer_hook=None) -> torch.Tensor:
        """Return logits [len(logits_indices), vocab] in float32.

        ``layer_hook(l, ready)``, when given, runs right after layer ``l`` was
        issued (used to stream pages layer by layer to a decode worker); its KV
        pages are final once ``ready`` says so (engine/kv_ready.py: a CUDA event
        recorded after the layer; on CPU always ready).
        """
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for l, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[l], backend, meta)
            if layer_hook is not None:
                layer_hook(l, layer_ready(x.device))
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build the model and load HF safetensors weights, fusing q/k/v and gate/up."""
    files = sorted(glob.glob(os.path.join(cfg.path, "*.safetensors")))
    if not files:
        raise ConfigError(f"model={cfg.path!r}: no *.safetensors weight files in that directory")
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim).to(device)
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

    put(model.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
    put(model.norm.weight, take("model.norm.weight"), "model.norm.weight")
    if not cfg.tie_word_embeddings:
        put(model.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
    else:
        model.lm_head.weight = model.embed_tokens.weight
        tensors.pop("lm_head.weight", None)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            put(getattr(layer, norm).weight, take(p + norm + ".weight"), p + norm)
        qkv = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        put(layer.qkv_proj.weight, torch.cat(qkv), p + "self_attn.qkv")
        if layer.qkv_proj.bias is not None:
            put(layer.qkv_proj.bias, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]), p + "qkv.bias")
        put(layer.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj")
        if layer.o_proj.bias is not None:
            put(layer.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "o_proj.bias")
        gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
        put(layer.gate_up_proj.weight, torch.cat([gate, up]), p + "mlp.gate_up")
        put(layer.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj")
        if layer.gate_up_proj.bias is not None:
            put(layer.gate_up_proj.bias, torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]), p + "gate_up.bias")
            put(layer.down_proj.bias, take(p + "mlp.down_proj.bias"), p + "down.bias")
    model.eval()
    return model
