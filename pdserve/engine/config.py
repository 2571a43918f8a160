"""Engine and model configuration: one place for defaults and validation.

`EngineConfig` holds the engine arguments a user passes to `LLM(...)`;
`ModelConfig` is what the engine needs from a Hugging Face `config.json`.
Both raise `ConfigError` (a `ValueError`) naming the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# Families whose attention normalises each query and key head (RMSNorm over head_dim) before RoPE.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
# Families whose config.json says when `use_sliding_window` is off that the window is unused.
_SLIDING_FLAG_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the field."""


def parse_dtype(value: str | torch.dtype, field_name: str = "dtype") -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(
            f"{field_name}={value!r} is not supported; use one of float32, float16, bfloat16"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


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
            rope=_parse_rope(raw, path),
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
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(
            f"rope_parameters.rope_type={rope_type!r} in {path}/config.json is not supported; "
            "supported: default, linear, llama3"
        )
    rope = RopeConfig(theta=theta, rope_type=rope_type)
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


@dataclass
class EngineConfig:
    """Engine arguments (the keyword arguments of `LLM(model, **engine_args)`)."""

    model: str
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = None  # KV pool size (default: 256 MiB on CPU, from the next on GPU)
    # GPU: this engine's share of the device (weights + reserve + KV pool), never more than is free
    # (engine/runner.py gpu_kv_budget)
    gpu_memory_utilization: float = 0.85
    num_gpu_blocks_override: int | None = None  # exact pool size (tests, benchmarks)
    enable_prefix_caching: bool = True
    # Record the prefix cache's changes as KV events (engine/kv_events.py; `LLMEngine.kv_events`)
    # for a publisher to send (cluster/kvindex/publisher.py): the cluster's KV index reads them.
    kv_events: bool = False
    # A second KV tier (engine/kv_tier.py): full prefix blocks about to be evicted from the pool are
    # copied there off the step, and a later prompt's prefix found there is loaded back instead of
    # recomputed. 0 = off. kv_offload_backend: auto (host memory on GPU, a file on CPU) | memory |
    # file; kv_offload_path: the file tier's directory (default: the system's temp directory).
    kv_offload_bytes: int = 0
    kv_offload_backend: str = "auto"
    kv_offload_path: str | None = None
    attention_backend: str = "auto"  # auto | torch | native (CPU float32 decode kernel) | flashinfer
    dtype: str = "auto"  # auto (float32 on CPU, the config's dtype on GPU) | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    scheduling_policy: str = "fcfs"  # fcfs | priority
    # Decode-only steps replay CUDA graphs captured per padded batch size (engine/cuda_graphs.py);
    # needs device cuda and the flashinfer backend. Capture costs start-up time and some memory.
    cuda_graphs: bool = False
    cuda_graph_max_batch: int = 64  # the largest captured batch (capped at max_num_seqs)
    # Linear layers: auto (oneDNN-packed weights for float32 on CPU, else torch) | torch | onednn
    # (engine/linear.py: MKL's small-batch sgemm is slow on the CPU; oneDNN is not bit-identical).
    linear_backend: str = "auto"
    # Tensor parallelism inside this worker (engine/tensor_parallel.py): ranks are processes on this
    # host; rank 0 is this process (it schedules and samples). tp_comm: auto (NCCL on GPU, shared
    # memory on CPU) | shm | gloo | nccl. tp_threads_per_rank: CPU threads of each rank (default:
    # this process's cores / ranks).
    tensor_parallel_size: int = 1
    # KV pool order inside a block: NHD [token][head][dim] or HND [head][token][dim]. HND keeps a
    # head's pages contiguous, which a handoff between different TP sizes needs (the workers
    # exchanging KV must agree; docs/architecture.md "KV pool").
    kv_layout: str = "NHD"
    tp_comm: str = "auto"
    tp_threads_per_rank: int | None = None
    # "module:factory" of what ranks 1..N-1 run besides their shard (engine/tp_group.py): the
    # workers set it to their KV transport's rank service; None for an engine on its own.
    tp_rank_extension: str | None = None
    seed: int = 0
    # Structured outputs (engine/structured.py): a request's grammar must compile within
    # structured_outputs_timeout_s (else it fails, naming structured_outputs); compiled grammars
    # are cached (at most this many entries and bytes); compiles run on this many threads, at
    # this CPU niceness (0-19; 10: a compile takes the cores only from what the step leaves, so
    # the streams running do not feel it: docs/structured.md, "Compiling").
    structured_outputs_timeout_s: float = 10.0
    structured_outputs_cache_entries: int = 512
    structured_outputs_cache_bytes: int = 256 << 20
    structured_outputs_threads: int = 2
    structured_outputs_compile_nice: int = 10
    speculative_config: dict | None = None  # vLLM's; checked by engine/spec_config.py (docs/speculative.md)
    # LoRA adapters, vLLM's names (engine/lora.py checks them; docs/lora.md; max_cpu_loras None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ConfigError(f"block_size={self.block_size} must be in [1, 1024]")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError(f"num_gpu_blocks_override={self.num_gpu_blocks_override} must be >= 1")
        if self.attention_backend not in ("auto", "torch", "native", "flashinfer"):
            raise ConfigError(f"attention_backend={self.attention_backend!r}; use auto, torch, native or flashinfer")
        if self.linear_backend not in ("auto", "torch", "onednn"):
            raise ConfigError(f"linear_backend={self.linear_backend!r}; use auto, torch or onednn")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy={self.scheduling_policy!r}; use fcfs or priority")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.kv_layout not in ("NHD", "HND"):
            raise ConfigError(f"kv_layout={self.kv_layout!r}; use NHD or HND")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.tp_comm not in ("auto", "shm", "gloo", "nccl"):
            raise ConfigError(f"tp_comm={self.tp_comm!r}; use auto, shm, gloo or nccl")
        if self.tp_threads_per_rank is not None and self.tp_threads_per_rank < 1:
            raise ConfigError(f"tp_threads_per_rank={self.tp_threads_per_rank} must be >= 1")
        if self.tensor_parallel_size > 1 and self.cuda_graphs:
            raise ConfigError("cuda_graphs=True is not supported with tensor_parallel_size > 1 yet; "
                              "set cuda_graphs=False")
        if self.kv_offload_bytes < 0:
            raise ConfigError(f"kv_offload_bytes={self.kv_offload_bytes} must be >= 0 (0: no second tier)")
        if self.kv_offload_backend not in ("auto", "memory", "file"):
            raise ConfigError(f"kv_offload_backend={self.kv_offload_backend!r}; use auto, memory or file")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ConfigError("kv_offload_bytes needs enable_prefix_caching=True (the tier holds prefix blocks)")
        if self.cuda_graph_max_batch < 1:
            raise ConfigError(f"cuda_graph_max_batch={self.cuda_graph_max_batch} must be >= 1")
        if not self.structured_outputs_timeout_s > 0:
            raise ConfigError(f"structured_outputs_timeout_s={self.structured_outputs_timeout_s} must be > 0")
        if self.structured_outputs_cache_entries < 0 or self.structured_outputs_cache_bytes < 0:
            raise ConfigError("structured_outputs_cache_entries and structured_outputs_cache_bytes must be >= 0")
        if self.structured_outputs_threads < 1:
            raise ConfigError(f"structured_outputs_threads={self.structured_outputs_threads} must be >= 1")
        if not 0 <= self.structured_outputs_compile_nice <= 19:
            raise ConfigError(f"structured_outputs_compile_nice={self.structured_outputs_compile_nice} must be in "
                              "[0, 19] (a thread may lower its own priority, not raise it)")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(
                f"unknown engine argument(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(names - {'model', 'extra'}))}"
            )
        cfg = cls(model=model, **kwargs)
        cfg.validate()
        return cfg
