"""`EngineConfig`: the engine arguments a user passes to `LLM(model, **engine_args)`, with
their defaults and validation (errors are `ConfigError`s naming the field). Re-exported by
engine/config.py, beside `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .config_base import ConfigError, parse_dtype, parse_kv_cache_dtype
from .kv_scales import KV_SCALE_GRANULARITIES


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
    # In a run of decode-only steps, build the next step's inputs while this step's forward runs
    # on the device, and use them when the scheduler's plan is the one predicted (engine/overlap.py).
    # Same tokens either way; it pays where the device runs ahead of the host (a GPU).
    overlap_steps: bool = False
    # vLLM's --async-scheduling: beyond overlap_steps (which it turns on), the predicted next
    # step is launched from this step's sampled tokens while they are still on the device, before
    # the host reads them and makes this step's outputs; the next plan takes its result when it
    # is that step or that step less requests that finished (engine/overlap.py). A step launched
    # for a plan that turns out otherwise (an arrival admitted) is computed for nothing.
    async_scheduling: bool = False
    # Linear layers: auto (oneDNN-packed weights for float32 on CPU, else torch) | torch | onednn
    # (engine/linear.py: MKL's small-batch sgemm is slow on the CPU; oneDNN is not bit-identical).
    linear_backend: str = "auto"
    # Tensor parallelism inside this worker (engine/tensor_parallel.py): ranks are processes on this
    # host; rank 0 is this process (it schedules and samples). tp_comm: auto (NCCL on GPU, shared
    # memory on CPU) | shm | gloo | nccl. tp_threads_per_rank: CPU threads of each rank (default:
    # this process's cores / ranks).
    tensor_parallel_size: int = 1
    # Mixture-of-experts models at tensor_parallel_size N: False, every rank holds a 1/N slice of
    # every expert (tensor-parallel experts, vLLM's default); True (vLLM's flag), each rank holds
    # 1/N of the routed experts whole; None (default): expert parallel on the CPU where N divides
    # the experts (measured faster there), tensor-parallel experts elsewhere (engine/tensor_parallel.py
    # `expert_parallel`; docs/models.md measures both).
    enable_expert_parallel: bool | None = None
    # KV pool order inside a block: NHD [token][head][dim] or HND [head][token][dim]. HND keeps a
    # head's pages contiguous, which a handoff between different TP sizes needs (the workers
    # exchanging KV must agree; docs/architecture.md "KV pool").
    kv_layout: str = "NHD"
    # The KV pool's element type, vLLM's names: auto (the model's dtype) | fp8 (= fp8_e4m3) |
    # fp8_e4m3 | fp8_e5m2. FP8 halves a 16-bit pool's bytes per token (engine/kv_quant.py;
    # docs/kv_cache.md); both roles of a handoff must agree.
    kv_cache_dtype: str = "auto"
    # FP8 scales (engine/kv_scales.py, docs/kv_cache.md "Scales"): the checkpoint's k_scale/v_scale
    # when it has them, else 1.0; calculate_kv_scales (vLLM's name) computes them at start from a
    # fixed calibration sequence instead, one per KV head or per tensor (kv_scale_granularity).
    calculate_kv_scales: bool = False
    kv_scale_granularity: str = "head"
    tp_comm: str = "auto"
    tp_threads_per_rank: int | None = None
    # The CUDA device index of each tensor-parallel rank (default: the device's index + rank). An
    # index may repeat: ranks sharing a device (a TP run on one GPU, as the gpu tests do) talk
    # over gloo, not NCCL (one device per rank there); size their pools with kv_cache_memory_bytes.
    tp_device_ids: list[int] | None = None
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

    def _validate_parallel(self) -> None:
        """Tensor parallelism and what runs beside the step (validate's part)."""
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.tp_comm not in ("auto", "shm", "gloo", "nccl"):
            raise ConfigError(f"tp_comm={self.tp_comm!r}; use auto, shm, gloo or nccl")
        if self.tp_device_ids is not None and (len(self.tp_device_ids) != self.tensor_parallel_size
                                               or any(int(i) < 0 for i in self.tp_device_ids)):
            raise ConfigError(f"tp_device_ids={self.tp_device_ids} must list one device index >= 0 for each of "
                              f"the tensor_parallel_size={self.tensor_parallel_size} ranks")
        if self.tp_threads_per_rank is not None and self.tp_threads_per_rank < 1:
            raise ConfigError(f"tp_threads_per_rank={self.tp_threads_per_rank} must be >= 1")
        if self.tensor_parallel_size > 1 and self.cuda_graphs:
            raise ConfigError("cuda_graphs=True is not supported with tensor_parallel_size > 1 yet; "
                              "set cuda_graphs=False")
        if self.async_scheduling:
            for name, on in (("speculative_config", self.speculative_config), ("enable_lora", self.enable_lora),
                             ("kv_offload_bytes", self.kv_offload_bytes)):
                if on:
                    raise ConfigError(f"async_scheduling=True does not run with {name} yet; set one of them off "
                                      "(overlap_steps=True prepares the next step without launching it)")

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
        if not isinstance(self.kv_cache_dtype, str):
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be a string")
        kv_name, _ = parse_kv_cache_dtype(self.kv_cache_dtype)
        if kv_name != "auto" and self.attention_backend == "flashinfer":
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} runs on attention_backend 'auto', 'torch' or 'native' for now; "
                "FlashInfer's FP8 KV path is not wired yet: set attention_backend='auto'")
        if self.enable_expert_parallel is not None and not isinstance(self.enable_expert_parallel, bool):
            raise ConfigError(f"enable_expert_parallel={self.enable_expert_parallel!r} must be true, false or "
                              "null (auto)")
        if not isinstance(self.calculate_kv_scales, bool):
            raise ConfigError(f"calculate_kv_scales={self.calculate_kv_scales!r} must be true or false")
        if self.calculate_kv_scales and kv_name == "auto":
            raise ConfigError("calculate_kv_scales=True computes FP8 KV scales: set kv_cache_dtype to fp8_e4m3 "
                              "or fp8_e5m2, or calculate_kv_scales=False")
        if self.kv_scale_granularity not in KV_SCALE_GRANULARITIES:
            raise ConfigError(f"kv_scale_granularity={self.kv_scale_granularity!r}; use one of "
                              f"{', '.join(KV_SCALE_GRANULARITIES)}")
        if kv_name != "auto" and self.cuda_graphs:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with cuda_graphs=True yet "
                              "(the graphs run FlashInfer): set cuda_graphs=False or kv_cache_dtype='auto'")
        self._validate_parallel()
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
