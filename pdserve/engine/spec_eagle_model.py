"""EAGLE heads, read in the layouts the published checkpoints use (docs/speculative.md, "EAGLE
heads"; the proposer that runs them is engine/spec_eagle.py).

A head's directory holds a ``config.json`` (a small Llama's: hidden size, heads, layers, RoPE)
and safetensors weights, named as vLLM's loaders read them (``llama_eagle.py``,
``llama_eagle3.py``):

- **EAGLE-1** (``method: eagle``): ``fc.weight`` [hidden, 2 x hidden] over the concatenation
  of the token's embedding and the target's last hidden state (after its final norm), then
  ``layers.{i}.*`` Llama decoder layers (layer 0 without ``input_layernorm``), and the logits
  of the last layer's output through ``lm_head``; ``embed_tokens.weight`` and
  ``lm_head.weight`` are the target's when the head has none (``fc.bias`` is taken when present).
- **EAGLE-3** (``method: eagle3``): ``fc.weight`` [hidden, n x target hidden] over the
  concatenation of n target hidden states (the residual stream after the layers listed in
  ``eagle_aux_hidden_state_layer_ids``, top level or under ``eagle_config``; vLLM's default
  (2, L // 2, L - 3) for a target of L layers, sorted and without repeats), one ``midlayer.*``
  decoder layer whose attention reads ``[input_layernorm(embedding), hidden_norm(hidden)]``
  (2 x hidden wide), its own ``norm.weight`` and ``lm_head.weight`` over ``draft_vocab_size``
  tokens, and ``d2t`` (draft id -> target id - draft id; required when the draft vocabulary is
  smaller, applied whenever present, as vLLM does: a head over the whole vocabulary may order it
  its own way; ``t2d`` is ignored). ``norm_before_fc`` (``input_norm.weight``),
  ``norm_before_residual`` and ``norm_output`` are read as vLLM reads them.

Every error is a `ConfigError` naming ``speculative_config.model``.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, replace

import torch
from safetensors import safe_open
from torch import nn

from .config import ConfigError, ModelConfig
from .model import DecoderLayer, RMSNorm, apply_rope_, rope_inv_freq
from .tensor_parallel import whole

FIELD = "speculative_config.model"


@dataclass(frozen=True)
class HeadConfig:
    """An EAGLE head's facts: its Llama shape (``model``) and what EAGLE adds to it."""

    method: str  # "eagle", "eagle3" or "mtp" (engine/spec_mtp_model.py)
    model: ModelConfig  # the head's decoder layers (a Llama of ``model.num_layers`` layers; MTP's: the target's)
    target_hidden_size: int  # the width of each target hidden state the head reads
    aux_layers: tuple[int, ...]  # EAGLE-3: the target's layers whose output it reads; () for EAGLE-1
    draft_vocab_size: int
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    mtp_layer: int = -1  # MTP: the layer's index in the checkpoint (``model.layers.{i}.``)

    @property
    def fc_in(self) -> int:
        if self.method in ("eagle", "mtp"):
            return 2 * self.model.hidden_size
        return len(self.aux_layers) * self.target_hidden_size


def _read_config(path: str) -> dict:
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ConfigError(f"{FIELD}={path!r}: no such directory (an EAGLE head's: config.json and safetensors)")
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{FIELD}={path!r}: config.json is missing in the EAGLE head's directory") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{FIELD}={path!r}: config.json is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{FIELD}={path!r}: config.json is not a JSON object")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ConfigError(f"{FIELD}={path!r}: no *.safetensors weight files in the EAGLE head's directory")
    return raw


def _flag(raw: dict, name: str) -> bool:
    eagle: dict = raw["eagle_config"] if isinstance(raw.get("eagle_config"), dict) else {}
    return bool(eagle.get(name, raw.get(name, False)))


def _aux_ids(raw: dict, path: str, target_layers: int) -> tuple[int, ...]:
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    eagle = raw.get("eagle_config")
    if not ids and isinstance(eagle, dict):
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [2, target_layers // 2, target_layers - 3]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{FIELD}={path!r}: eagle_aux_hidden_state_layer_ids={ids!r} must be a list of ints")
    out = tuple(sorted(set(ids)))
    if out[0] < 0 or out[-1] > target_layers:
        raise ConfigError(f"{FIELD}={path!r}: eagle_aux_hidden_state_layer_ids={list(out)} must lie in "
                          f"[0, {target_layers}] (the target model has {target_layers} layers)")
    return out


def check_head_dir(path: str, method: str) -> None:
    """What can be checked of a head without its target (when the config is parsed)."""
    head_config(path, method, None)


def head_config(path: str, method: str, target: ModelConfig | None) -> HeadConfig:
    """The head's config, checked against the target's (when given): its hidden size and
    vocabulary must be the target's."""
    raw = _read_config(path)
    try:
        mc = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]}, path)
    except ConfigError as exc:
        raise ConfigError(f"{FIELD}={path!r} is not an EAGLE head this engine reads: {exc}") from None
    if mc.attention_bias or mc.mlp_bias:
        raise ConfigError(f"{FIELD}={path!r}: attention_bias / mlp_bias heads are not supported")
    draft_vocab = raw.get("draft_vocab_size") or mc.vocab_size
    if method == "eagle3":
        if mc.num_layers != 1:
            raise ConfigError(f"{FIELD}={path!r}: num_hidden_layers={mc.num_layers}; an EAGLE-3 head has one layer")
        eagle: dict = raw["eagle_config"] if isinstance(raw.get("eagle_config"), dict) else {}
        if _flag(raw, "fc_norm") or eagle.get("use_aux_hidden_state", raw.get("use_aux_hidden_state")) is False:
            raise ConfigError(f"{FIELD}={path!r}: fc_norm and use_aux_hidden_state=false heads are not supported")
    target_hidden = int(raw.get("target_hidden_size") or mc.hidden_size) if method == "eagle3" else mc.hidden_size
    if target is not None:
        if mc.hidden_size != target.hidden_size or target_hidden != target.hidden_size:
            which = mc.hidden_size if mc.hidden_size != target.hidden_size else target_hidden
            raise ConfigError(f"{FIELD}={path!r}: the head's hidden size {which} is not the target model's "
                              f"{target.hidden_size}; an EAGLE head is trained for one target")
        if mc.vocab_size != target.vocab_size:
            raise ConfigError(f"{FIELD}={path!r}: its vocab_size {mc.vocab_size} is not the target model's "
                              f"{target.vocab_size}")
        # (EAGLE shares the target's positions: its RoPE table spans the target's length, as vLLM's)
        mc = replace(mc, max_position_embeddings=target.max_position_embeddings)
    aux = _aux_ids(raw, path, target.num_layers) if method == "eagle3" and target is not None else ()
    return HeadConfig(method, mc, target_hidden, aux, int(draft_vocab),
                      norm_before_fc=_flag(raw, "norm_before_fc"),
                      norm_before_residual=_flag(raw, "norm_before_residual"),
                      norm_output=_flag(raw, "norm_output"))


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's midlayer: a Llama layer whose attention reads the normed embedding and the
    normed hidden state side by side (its q/k/v projections are 2 x hidden wide)."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__(cfg, whole(cfg))
        self.qkv_proj = nn.Linear(2 * cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward_eagle(self, embeds, hidden, cos, sin, layer_kv, backend, meta) -> torch.Tensor:
        """The layer's output (before the head's final norm), residual added."""
        t = hidden.shape[0]
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        qkv = self.qkv_proj(torch.cat([self.input_layernorm(embeds), normed], dim=-1))
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        apply_rope_(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        attn = backend.forward(layer_kv, q, k, v, meta)
        x = self.o_proj(attn.reshape(t, self.q_size)).add_(residual)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate).mul_(up)).add_(x)


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head. `combine` turns the target's captured hidden states into the
    head's hidden input; `forward` runs the head's layers over (token, hidden) rows and returns
    the logits over the target's vocabulary at ``logits_indices`` and every row's hidden output
    (the next row's hidden input when the head proposes on from its own output)."""

    def __init__(self, hc: HeadConfig, target_vocab: int):
        super().__init__()
        cfg = hc.model
        self.hc = hc
        self.target_vocab = target_vocab
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(hc.fc_in, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            [Eagle3Layer(cfg, hc.norm_before_residual)] if hc.method == "eagle3"
            else [DecoderLayer(cfg, whole(cfg)) for _ in range(cfg.num_layers)])
        if hc.method == "eagle":
            self.layers[0].input_layernorm = nn.Identity()  # (vLLM's: layer 0 reads fc's output as is)
        self.input_norm = RMSNorm(hc.fc_in, cfg.rms_norm_eps) if hc.norm_before_fc else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if hc.method == "eagle3" else None
        self.lm_head = nn.Linear(cfg.hidden_size, hc.draft_vocab_size, bias=False)
        # The target id of each draft id (EAGLE-3's d2t; the identity otherwise).
        self.register_buffer("to_target", torch.arange(hc.draft_vocab_size), persistent=False)
        self.identity_ids = hc.draft_vocab_size == target_vocab  # (until a d2t says otherwise)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        if self.hc.method == "eagle":
            return target_hidden  # (fc runs in forward, over [embedding, hidden])
        if self.input_norm is not None:
            target_hidden = self.input_norm(target_hidden)
        return self.fc(target_hidden)

    @torch.inference_mode()
    def forward(self, input_ids, positions, hidden, kv_cache, backend, meta, logits_indices
                ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_tokens(input_ids)
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(embeds.dtype)[:, None, :], emb.sin().to(embeds.dtype)[:, None, :]
        if self.norm is None:  # EAGLE-1
            x = self.fc(torch.cat([embeds, hidden], dim=-1))
            for l, layer in enumerate(self.layers):
                x = layer(x, cos, sin, kv_cache[l], backend, meta)
            out, final = x, x
        else:
            layer = self.layers[0]
            assert isinstance(layer, Eagle3Layer)
            pre = layer.forward_eagle(embeds, hidden, cos, sin, kv_cache[0], backend, meta)
            final = self.norm(pre)
            out = final if self.hc.norm_output else pre
        rows = self.lm_head(final[logits_indices]).float()
        if self.identity_ids:  # draft id i is target id i
            return rows, out
        logits = rows.new_full((rows.shape[0], self.target_vocab), float("-inf"))
        logits[:, self.to_target] = rows
        return logits, out


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    out[name[len("model."):] if name.startswith("model.") else name] = st.get_tensor(name)
        except Exception as exc:  # noqa: BLE001  (a corrupt file: the field's error)
            raise ConfigError(f"{FIELD}={path!r}: {os.path.basename(f)} is not a readable safetensors file "
                              f"({exc})") from None
    return out


def _target_tensor(target: ModelConfig, names: tuple[str, ...]) -> torch.Tensor:
    """The first of ``names`` found in the target's weight files (the head shares it)."""
    for f in sorted(glob.glob(os.path.join(target.path, "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            for name in names:
                if name in st.keys():
                    return st.get_tensor(name)
    raise ConfigError(f"{FIELD}: the head has no {names[0].split('.')[-2]} and the target's "
                      f"{names[0]!r} was not found to share")


def weight_io(path: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
    """``take`` (pop a weight by name; missing: the field's error) and ``put`` (copy it into a
    parameter of the same shape; else the field's error) over a head's ``tensors``."""

    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise ConfigError(f"{FIELD}={path!r}: weight {name!r} is missing") from None

    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ConfigError(f"{FIELD}={path!r}: weight {name} has shape {tuple(value.shape)}; the head's "
                              f"config.json and the target imply {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value.to(dtype))

    return take, put


def load_eagle_head(hc: HeadConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The head with its weights (the target's embedding and, for EAGLE-1, LM head when the
    head's checkpoint has none)."""
    path = hc.model.path
    tensors = _tensors(path)
    with torch.device("meta"):
        head = EagleHead(hc, target.vocab_size)
    head = head.to_empty(device=device).to(dtype)
    cfg = hc.model
    head.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim).to(device)
    head.to_target = torch.arange(hc.draft_vocab_size, device=device)

    take, put = weight_io(path, tensors, dtype)
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is None:
        embed = _target_tensor(target, ("model.embed_tokens.weight",))
    put(head.embed_tokens.weight, embed, "embed_tokens.weight")
    put(head.fc.weight, take("fc.weight"), "fc.weight")
    fc_bias = tensors.pop("fc.bias", None)
    if fc_bias is not None:  # (some EAGLE-1 checkpoints have one)
        head.fc.bias = nn.Parameter(torch.empty(cfg.hidden_size, device=device, dtype=dtype), requires_grad=False)
        put(head.fc.bias, fc_bias, "fc.bias")
    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is None:
        if hc.method == "eagle3":
            raise ConfigError(f"{FIELD}={path!r}: weight 'lm_head.weight' is missing (an EAGLE-3 head has its own)")
        lm_head = _target_tensor(target, ("lm_head.weight", "model.embed_tokens.weight"))
    put(head.lm_head.weight, lm_head, "lm_head.weight")
    if head.input_norm is not None:
        put(head.input_norm.weight, take("input_norm.weight"), "input_norm.weight")
    if hc.method == "eagle3":
        _load_eagle3(head, hc, target, tensors, take, put)
    else:
        for i, layer in enumerate(head.layers):
            assert isinstance(layer, DecoderLayer)
            _load_layer(layer, f"layers.{i}.", take, put, norm_in=i > 0)
    head.eval()
    return head


def _load_eagle3(head: EagleHead, hc: HeadConfig, target: ModelConfig, tensors: dict, take, put) -> None:
    assert head.norm is not None
    put(head.norm.weight, take("norm.weight"), "norm.weight")
    layer = head.layers[0]
    assert isinstance(layer, Eagle3Layer)
    _load_layer(layer, "midlayer.", take, put, norm_in=True)
    put(layer.hidden_norm.weight, take("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight")
    d2t = tensors.pop("d2t", None)
    if d2t is None and hc.draft_vocab_size == target.vocab_size:
        return  # (as vLLM: no mapping, a head over the whole vocabulary proposes target ids)
    if d2t is None:
        raise ConfigError(f"{FIELD}={hc.model.path!r}: weight 'd2t' is missing (draft_vocab_size "
                          f"{hc.draft_vocab_size} is not the target's vocab_size {target.vocab_size})")
    if tuple(d2t.shape) != (hc.draft_vocab_size,) or d2t.dtype.is_floating_point:
        raise ConfigError(f"{FIELD}={hc.model.path!r}: weight d2t has shape {tuple(d2t.shape)} and dtype "
                          f"{d2t.dtype}; an integer vector of draft_vocab_size={hc.draft_vocab_size} expected")
    ids = torch.arange(hc.draft_vocab_size) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size or ids.unique().numel() != ids.numel():
        raise ConfigError(f"{FIELD}={hc.model.path!r}: d2t maps draft ids outside the target's vocabulary "
                          "or two draft ids to one target id")
    head.to_target = ids.to(head.to_target.device)
    head.identity_ids = bool(torch.equal(ids, torch.arange(target.vocab_size))) if len(ids) == target.vocab_size else False


def _load_layer(layer: DecoderLayer, p: str, take, put, norm_in: bool) -> None:
    """A Llama layer's weights, q/k/v and gate/up fused (``norm_in``: it has input_layernorm)."""
    if norm_in:
        put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
    put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"),
        p + "post_attention_layernorm.weight")
    qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
    put(layer.qkv_proj.weight, qkv, p + "self_attn.{q,k,v}_proj.weight")
    put(layer.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
    gate_up = torch.cat([take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    put(layer.gate_up_proj.weight, gate_up, p + "mlp.{gate,up}_proj.weight")
    put(layer.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
