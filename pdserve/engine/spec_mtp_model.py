"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative proposer (``method: mtp``;
docs/speculative.md, "MTP"; the proposer that runs it is EAGLE's, engine/spec_eagle.py).

DeepSeek-V3 checkpoints carry ``num_nextn_predict_layers`` MTP layers after the model's own, as
``model.layers.{L}.*`` with ``L = num_hidden_layers`` (HF transformers ignores them; vLLM's
``deepseek_mtp.py`` reads the same names):

- ``enorm.weight`` and ``hnorm.weight``: RMSNorms of the token's embedding and of the hidden
  state it is paired with; ``eh_proj.weight`` [hidden, 2 x hidden] over their concatenation
  (embedding first);
- a decoder block of the model's own kind (latent attention, mixture-of-experts MLP) under the
  same prefix (``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``);
- ``shared_head.norm.weight`` and ``shared_head.head.weight``: the final norm and LM head of the
  layer's output; ``embed_tokens.weight``. A checkpoint without the head or the embedding under
  the layer's prefix shares the model's (``lm_head.weight``, ``model.embed_tokens.weight``), as
  the DeepSeek-V3 report describes them.

It is an EAGLE-1 head in all but its norms and its block, so it runs in EAGLE's proposer: row i
holds token i + 1 with the target's final hidden state (after the model's final norm, as vLLM
feeds it) at position i, and its logits propose token i + 2; a further proposal reads the layer's
own output of the row before (before ``shared_head.norm``). As vLLM does, the embedding of a row
at position 0 is zeroed. The first MTP layer proposes every position (vLLM cycles through the
layers when a checkpoint has several; DeepSeek-V3's has one).

Every refusal is a `ConfigError` naming ``speculative_config.model`` or ``speculative_config.method``.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import replace

import torch
from safetensors import safe_open
from torch import nn

from .config import ConfigError, ModelConfig
from .config_mla import yarn_attention_factor
from .model import DecoderLayer, RMSNorm, load_layer, rope_inv_freq, rope_tables
from .spec_eagle_model import HeadConfig, head_config, weight_io
from .tensor_parallel import whole

FIELD = "speculative_config.model"
METHOD = "mtp"
ALIASES = ("mtp", "deepseek_mtp")  # (vLLM's names for it: the second its older one)


def mtp_layers(path: str) -> int:
    """How many MTP layers ``path``'s config.json says the checkpoint holds."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{FIELD}={path!r}: config.json is not readable ({exc})") from None
    n = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) if isinstance(raw, dict) else 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"{FIELD}={path!r}: num_nextn_predict_layers={n!r} in config.json must be an integer >= 0")
    return n


def mtp_config(path: str | None, target: ModelConfig) -> HeadConfig:
    """The MTP layer's facts: its block is one of the target's (``path``: the checkpoint holding
    it, the target's own directory when None)."""
    path = path or target.path
    if target.architecture != "deepseek_v3":
        raise ConfigError(f"speculative_config.method='mtp': the target model is {target.architecture}; MTP "
                          "layers are read from DeepSeek-V3 checkpoints only (use eagle, eagle3, draft_model or ngram)")
    if not os.path.isdir(path):
        raise ConfigError(f"{FIELD}={path!r}: no such directory (the checkpoint with the MTP layer)")
    n = mtp_layers(path)
    if n < 1:
        raise ConfigError(f"{FIELD}={path!r}: config.json has num_nextn_predict_layers={n}: the checkpoint has no "
                          "MTP layer to propose with")
    if path != target.path:
        head = ModelConfig.from_dir(path)
        if (head.hidden_size, head.vocab_size, head.num_layers) != (target.hidden_size, target.vocab_size,
                                                                     target.num_layers):
            raise ConfigError(f"{FIELD}={path!r}: its hidden_size, vocab_size and num_hidden_layers "
                              f"{head.hidden_size, head.vocab_size, head.num_layers} are not the target's "
                              f"{target.hidden_size, target.vocab_size, target.num_layers}; an MTP layer "
                              "belongs to one model")
    model = replace(target, num_layers=1, path=path)
    return HeadConfig(METHOD, model, target.hidden_size, (), target.vocab_size, mtp_layer=target.num_layers)


def proposer_head_config(path: str | None, method: str, target: ModelConfig) -> HeadConfig:
    """The head of an EAGLE-kind method (``eagle``, ``eagle3``, ``mtp``), checked against the target."""
    if method == METHOD:
        return mtp_config(path, target)
    assert path is not None
    return head_config(path, method, target)


class MTPHead(nn.Module):
    """The MTP layer with the interface of `EagleHead` (engine/spec_eagle_model.py): `combine`
    (the target's final hidden state as is) and `forward` (logits at ``logits_indices`` and
    every row's output)."""

    identity_ids = True  # (its LM head is over the target's vocabulary, in its order)

    def __init__(self, hc: HeadConfig, target_vocab: int):
        super().__init__()
        cfg = hc.model
        h = cfg.hidden_size
        self.hc = hc
        self.target_vocab = target_vocab
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # (index: the checkpoint's, so a mixture-of-experts model's MTP block is sparse as it is there)
        self.layers = nn.ModuleList([DecoderLayer(cfg, whole(cfg), None, hc.mtp_layer)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)  # shared_head.norm
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)  # shared_head.head
        self.register_buffer("to_target", torch.arange(cfg.vocab_size), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.rope_dim), persistent=False)
        self.rope_factor = yarn_attention_factor(cfg.rope)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    @torch.inference_mode()
    def forward(self, input_ids, positions, hidden, kv_cache, backend, meta, logits_indices
                ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_tokens(input_ids)
        embeds[positions == 0] = 0  # (vLLM's: position 0 has no token before it to predict from)
        cos, sin = rope_tables(self.inv_freq, self.rope_factor, positions, embeds.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out = self.layers[0](x, cos, sin, kv_cache[0], backend, meta)
        return self.lm_head(self.norm(out[logits_indices])).float(), out


def _read(path: str, wanted) -> dict[str, torch.Tensor]:
    """The tensors of ``path``'s safetensors files whose names ``wanted`` accepts."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    if wanted(name):
                        out[name] = st.get_tensor(name)
        except Exception as exc:  # noqa: BLE001  (a corrupt file: the field's error)
            raise ConfigError(f"{FIELD}={path!r}: {os.path.basename(f)} is not a readable safetensors file "
                              f"({exc})") from None
    return out


def load_mtp_head(hc: HeadConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device) -> MTPHead:
    """The MTP layer with its weights; the model's embedding and LM head where the layer has none."""
    path, p = hc.model.path, f"model.layers.{hc.mtp_layer}."
    tensors = _read(path, lambda name: name.startswith(p))
    if not tensors:
        raise ConfigError(f"{FIELD}={path!r}: no weight named {p}* (the MTP layer config.json's "
                          f"num_nextn_predict_layers promises after the model's {hc.mtp_layer} layers)")
    shared = ("model.embed_tokens.weight", "lm_head.weight")
    if p + "embed_tokens.weight" not in tensors or p + "shared_head.head.weight" not in tensors:
        tensors.update(_read(target.path, lambda name: name in shared))
    with torch.device("meta"):
        head = MTPHead(hc, target.vocab_size)
    head = head.to_empty(device=device).to(dtype)
    cfg = hc.model
    head.inv_freq = rope_inv_freq(cfg.rope, cfg.rope_dim).to(device)
    head.to_target = torch.arange(cfg.vocab_size, device=device)

    take, put = weight_io(path, tensors, dtype)

    def either(own: str, model: str) -> torch.Tensor:
        value = tensors.pop(own, None)
        return take(model) if value is None else value

    embed = either(p + "embed_tokens.weight", "model.embed_tokens.weight")
    put(head.embed_tokens.weight, embed, p + "embed_tokens.weight")
    lm_head = tensors.pop(p + "shared_head.head.weight", None)
    if lm_head is None:
        lm_head = embed if cfg.tie_word_embeddings else take("lm_head.weight")
    put(head.lm_head.weight, lm_head, p + "shared_head.head.weight")
    for name, param in (("enorm", head.enorm.weight), ("hnorm", head.hnorm.weight),
                        ("eh_proj", head.eh_proj.weight), ("shared_head.norm", head.norm.weight)):
        put(param, take(p + name + ".weight"), p + name + ".weight")
    layer = head.layers[0]
    assert isinstance(layer, DecoderLayer)
    load_layer(layer, p, cfg, whole(cfg), take, put, tensors)
    head.eval()
    return head
