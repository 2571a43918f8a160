"""DeepSeek-V3's `config.json` read as HF `DeepseekV3Config` reads it: the latent attention
(`MLAConfig`), the routed and shared experts (`MoEConfig`), and yarn RoPE.

`engine/config.py` calls it for the ``deepseek_v3`` family and builds its dataclasses from the
fields returned here (this module does not import it: no cycle); every refusal is a `ConfigError`
naming the field. Missing fields take `DeepseekV3Config`'s defaults, as transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from .config_base import ConfigError


class YarnRope(Protocol):
    """What the yarn functions read of a `RopeConfig` (engine/config.py)."""

    rope_type: str
    factor: float
    mscale: float
    mscale_all_dim: float
    attention_factor: float | None

# DeepseekV3Config's defaults for fields config.json may omit.
_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "rope_interleave": True, "moe_intermediate_size": 2048,
}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """HF's ``yarn_get_mscale``: ``0.1 * mscale * ln(factor) + 1`` above a factor of 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def parse_yarn(params: dict, raw: dict, path: str) -> dict[str, Any]:
    """`RopeConfig`'s yarn fields from ``rope_parameters`` (HF `_compute_yarn_parameters`)."""
    orig = params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    factor = params.get("factor")
    try:
        if factor is None:
            factor = raw.get("max_position_embeddings", 2048) / orig
        af = params.get("attention_factor")
        fields: dict[str, Any] = dict(
            factor=float(factor), original_max_position_embeddings=int(orig),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            attention_factor=None if af is None else float(af), truncate=bool(params.get("truncate", True)))
    except (TypeError, ValueError, ZeroDivisionError):
        raise ConfigError(f"rope_parameters in {path}/config.json: yarn's factor, original_max_position_embeddings, "
                          "beta_fast, beta_slow, mscale, mscale_all_dim and attention_factor must be numbers") from None
    if fields["factor"] <= 0:
        raise ConfigError(f"rope_parameters.factor={fields['factor']} in {path}/config.json must be > 0")
    return fields


def yarn_attention_factor(rope: YarnRope) -> float:
    """The factor yarn multiplies cos and sin by (1 for every other rope type)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def _int(raw: dict, key: str, path: str, minimum: int = 1) -> int:
    value = raw.get(key, _DEFAULTS.get(key))
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r} in {path}/config.json must be an integer >= {minimum}")
    return value


def parse_deepseek(raw: dict, path: str, need: Callable[[str], Any],
                   rope: YarnRope) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields of the `MLAConfig` and `MoEConfig` of a ``DeepseekV3ForCausalLM`` config.json."""
    if raw.get("quantization_config"):
        method = (raw["quantization_config"] or {}).get("quant_method", "?")
        raise ConfigError(f"quantization_config (quant_method={method!r}) in {path}/config.json: quantized "
                          "weights (DeepSeek-V3's FP8 checkpoints) are not supported; use a bfloat16 or float32 copy")
    q_lora = raw.get("q_lora_rank", _DEFAULTS["q_lora_rank"])
    q_lora_rank = None if q_lora is None else _int(raw, "q_lora_rank", path)
    rope_dim = _int(raw, "qk_rope_head_dim", path)
    if rope_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={rope_dim} in {path}/config.json must be even for RoPE")
    nope = _int(raw, "qk_nope_head_dim", path)
    interleave = raw.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ConfigError(f"rope_interleave={interleave!r} in {path}/config.json must be true or false")
    scale = (nope + rope_dim) ** -0.5
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    # HF's yarn_apply_mscale: any scaled rope type with mscale_all_dim scales the softmax too.
    if rope.rope_type != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(rope.factor, float(params["mscale_all_dim"]))
        scale = scale * m * m
    mla = dict(q_lora_rank=q_lora_rank, kv_lora_rank=_int(raw, "kv_lora_rank", path), qk_nope_head_dim=nope,
               qk_rope_head_dim=rope_dim, v_head_dim=_int(raw, "v_head_dim", path),
               rope_interleave=interleave, softmax_scale=scale)
    experts = _int(raw, "n_routed_experts", path)
    top_k = _int(raw, "num_experts_per_tok", path)
    n_group, topk_group = _int(raw, "n_group", path), _int(raw, "topk_group", path)
    if experts % n_group or experts // n_group < 2:
        raise ConfigError(f"n_group={n_group} in {path}/config.json must divide n_routed_experts={experts} "
                          "into groups of at least 2 experts (a group's score is its top two)")
    if topk_group > n_group:
        raise ConfigError(f"topk_group={topk_group} in {path}/config.json exceeds n_group={n_group}")
    if top_k > topk_group * (experts // n_group):
        raise ConfigError(f"num_experts_per_tok={top_k} in {path}/config.json exceeds the "
                          f"{topk_group * (experts // n_group)} experts of the topk_group={topk_group} groups chosen")
    norm = raw.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ConfigError(f"norm_topk_prob={norm!r} in {path}/config.json must be true or false")
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"scoring_func={scoring!r} in {path}/config.json: DeepSeek-V3 routes by 'sigmoid' only")
    method = raw.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ConfigError(f"topk_method={method!r} in {path}/config.json: DeepSeek-V3 routes by 'noaux_tc' "
                          "(sigmoid scores with a correction bias) only")
    try:
        factor = float(raw.get("routed_scaling_factor", _DEFAULTS["routed_scaling_factor"]))
    except (TypeError, ValueError):
        raise ConfigError(f"routed_scaling_factor={raw.get('routed_scaling_factor')!r} in {path}/config.json "
                          "must be a number") from None
    layers = int(need("num_hidden_layers"))
    first_dense = _int(raw, "first_k_dense_replace", path, minimum=0)
    moe = dict(num_experts=experts, top_k=top_k, intermediate_size=_int(raw, "moe_intermediate_size", path),
               norm_topk_prob=norm, weights_float32=True, dense_layers=frozenset(range(min(first_dense, layers))),
               scoring="sigmoid", n_group=n_group, topk_group=topk_group, routed_scaling_factor=factor,
               n_shared_experts=_int(raw, "n_shared_experts", path, minimum=0))
    return mla, moe
