"""Engine and model configuration: one place for defaults and validation.

`EngineConfig` holds the engine arguments a user passes to `LLM(...)` (engine/engine_config.py,
re-exported here); `ModelConfig` is what the engine needs from a Hugging Face `config.json`.
Both raise `ConfigError` (a `ValueError`, engine/config_base.py) naming the offending field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .config_base import KV_CACHE_DTYPES as KV_CACHE_DTYPES
from .config_base import ConfigError as ConfigError
from .config_base import dtype_name as dtype_name
from .config_base import parse_dtype as parse_dtype
from .config_base import parse_kv_cache_dtype as parse_kv_cache_dtype
from .config_mla import parse_deepseek, parse_yarn
from .engine_config import EngineConfig as EngineConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Families whose attention normalises each query and key head (RMSNorm over head_dim) before RoPE.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
# Families whose config.json says when `use_sliding_window` is off that the window is unused.
_SLIDING_FLAG_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")

@dataclass
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (DeepSeek-V3): the ramp's bounds, the cos/sin factor and the softmax's mscale.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: from factor, mscale and mscale_all_dim
    truncate: bool = True


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts model's expert layers (engine/moe.py runs them and says how they
    route). ``weights_float32``: the routing weights scale an expert's output in float32
    (Mixtral), not cast to the model's dtype first (Qwen3-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    weights_float32: bool
    dense_layers: frozenset[int] = frozenset()  # layers with a dense MLP instead (Qwen3-MoE)
    # DeepSeek-V3's router (engine/moe.py `route_grouped`): sigmoid scores, a correction bias used
    # only to choose, the top ``topk_group`` of ``n_group`` groups, the weights times
    # ``routed_scaling_factor``; ``n_shared_experts`` experts' worth of shared MLP in every layer.
    scoring: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention (engine/mla.py): per head a query of
    ``qk_nope_head_dim + qk_rope_head_dim``, keys and values from one latent of
    ``kv_lora_rank`` per token; ``q_lora_rank`` None: the query straight from ``q_proj``."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float  # HF's: qk_head_dim ** -0.5, times yarn's mscale squared

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """What the pool holds per token and layer in its one KV head: the latent and the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class ModelConfig:
    """The architecture facts the engine needs, read from `config.json`."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    sliding_window: int | None
    torch_dtype: str | None
    qk_norm: bool = False  # RMSNorm per query/key head before RoPE (Qwen3)
    moe: MoEConfig | None = None  # the expert layers of a mixture-of-experts model
    # DeepSeek's latent attention: then the pool has one KV head (num_kv_heads 1) of head_dim
    # kv_lora_rank + qk_rope_head_dim, the latent, and attention's scale is mla.softmax_scale.
    mla: MLAConfig | None = None

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates: the head's, or MLA's decoupled rope part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def softmax_scale(self) -> float:
        """The attention backends' scale: ``head_dim ** -0.5``, or MLA's."""
        return self.mla.softmax_scale if self.mla is not None else self.head_dim ** -0.5

    def has_dense_mlp(self) -> bool:
        """Whether any layer has a dense MLP of ``intermediate_size``."""
        return self.moe is None or bool(self.moe.dense_layers)

    @property
    def model_id(self) -> str:
        return os.path.basename(os.path.normpath(self.path))

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        if not isinstance(path, str) or not path:
            raise ConfigError("model: a local model directory path is required")
        if not os.path.isdir(path):
            raise ConfigError(
                f"model={path!r}: no such directory; pass a local Hugging Face model "
                "directory (config.json + *.safetensors + tokenizer files), "
                "e.g. one made by `pdserve make-model DIR`"
            )
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"model={path!r}: config.json is missing in that directory")
        with open(cfg_path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"model={path!r}: config.json is not valid JSON ({exc})") from None
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict, path: str) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"architectures={archs!r} in {path}/config.json is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )

        def need(key: str):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{key} is missing in {path}/config.json")
            return raw[key]

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"num_key_value_heads={num_kv_heads} must divide num_attention_heads={num_heads}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        # Qwen3Config's head_dim defaults to 128 (not hidden / heads) when config.json omits it.
        head_dim = int(raw.get("head_dim") or (128 if family == "qwen3" else hidden // num_heads))
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported; only 'silu'")
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        sliding = raw.get("sliding_window")
        if family in _SLIDING_FLAG_FAMILIES and not raw.get("use_sliding_window", False):
            sliding = None
        moe = _parse_moe(raw, family, path, need)
        rope = _parse_rope(raw, path)
        if rope.rope_type == "yarn" and family != "deepseek_v3":
            raise ConfigError(f"rope_parameters.rope_type='yarn' in {path}/config.json is supported for "
                              "DeepseekV3ForCausalLM only")
        mla = None
        if family == "deepseek_v3":
            mla_fields, moe_fields = parse_deepseek(raw, path, need, rope)
            mla, moe = MLAConfig(**mla_fields), MoEConfig(**moe_fields)
            # The pool sees MLA as multi-query attention over the latent (engine/mla.py).
            num_kv_heads, head_dim = 1, mla.cache_dim
        return cls(
            path=path,
            architecture=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama/Mistral only when attention_bias is set.
            # Mixtral never has attention biases.
            attention_bias=family == "qwen2" or (family != "mixtral" and bool(raw.get("attention_bias", False))),
            mlp_bias=moe is None and bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            qk_norm=family in QK_NORM_FAMILIES,
            moe=moe,
            mla=mla,
        )


def _parse_moe(raw: dict, family: str, path: str, need) -> MoEConfig | None:
    """The expert layers of a Qwen3-MoE or Mixtral config.json (None for a dense family)."""
    if family not in ("qwen3_moe", "mixtral"):
        return None

    def positive(key: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r} in {path}/config.json must be an integer >= 1")
        return value

    if family == "mixtral":
        num_experts = positive("num_local_experts", need("num_local_experts"))
        inter = positive("intermediate_size", need("intermediate_size"))
        norm, dense = True, frozenset[int]()
    else:
        # The hub's files say num_experts; transformers 5's save_pretrained writes num_local_experts.
        key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
        num_experts = positive(key, raw.get(key) if raw.get(key) is not None else need("num_experts"))
        inter = positive("moe_intermediate_size", need("moe_intermediate_size"))
        norm = raw.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise ConfigError(f"norm_topk_prob={norm!r} in {path}/config.json must be true or false")
        step = positive("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
        only = raw.get("mlp_only_layers") or []
        layers = int(need("num_hidden_layers"))
        if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < layers for i in only):
            raise ConfigError(f"mlp_only_layers={only!r} in {path}/config.json must list layer indices "
                              f"in [0, {layers})")
        # HF's rule: a layer is sparse unless listed in mlp_only_layers or off the sparse step.
        dense = frozenset(i for i in range(layers) if i in only or (i + 1) % step)
    top_k = positive("num_experts_per_tok", need("num_experts_per_tok"))
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok={top_k} in {path}/config.json exceeds the "
                          f"{num_experts} experts")
    return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter,
                     norm_topk_prob=norm, weights_float32=family == "mixtral", dense_layers=dense)


def _parse_rope(raw: dict, path: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files use
    # `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ConfigError(
            f"rope_parameters.rope_type={rope_type!r} in {path}/config.json is not supported; "
            "supported: default, linear, llama3, yarn"
        )
    rope = RopeConfig(theta=theta, rope_type=rope_type)
    if rope_type == "yarn":
        rope = RopeConfig(theta=theta, rope_type=rope_type, **parse_yarn(params, raw, path))
    if rope_type in ("linear", "llama3"):
        if "factor" not in params:
            raise ConfigError(f"rope_parameters.factor is required for rope_type={rope_type!r}")
        rope.factor = float(params["factor"])
    if rope_type == "llama3":
        rope.low_freq_factor = float(params.get("low_freq_factor", 1.0))
        rope.high_freq_factor = float(params.get("high_freq_factor", 4.0))
        rope.original_max_position_embeddings = int(
            params.get("original_max_position_embeddings", 8192)
        )
    return rope
