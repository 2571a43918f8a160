"""How to run a step: the model, its KV pool and the attention backend.

Turns a scheduler plan into one flat, unpadded batch (`step_batch`), runs the
model and returns the logits of the sequences that reached their last known
token.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .attention import make_backend
from .block_manager import KVCacheManager
from .config import ConfigError, EngineConfig, ModelConfig, dtype_name, parse_dtype, parse_kv_cache_dtype
from .kv_quant import KVQuant
from .kv_scale_calibration import calibrate_kv_scales
from .kv_scales import checkpoint_scales, record
from .linear import pack_linears
from .lora_slots import LoRARuntime
from .model import load_model
from .overlap import Lookahead
from .request import Request
from .step_batch import StepBatch, build_step_batch
from .tensor_parallel import check_tp, expert_parallel, make_shard
from .tp_group import TPGroup, TPGroupBroken

from .cuda_graphs import GraphAhead

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 256 << 20
# GPU memory kept back from the KV pool for activations and workspaces (at most a tenth of a
# small device).
GPU_ACTIVATION_RESERVE_BYTES = 2 << 30


def gpu_kv_budget(cfg: EngineConfig, free: int, total: int, own_bytes: int) -> tuple[int, str, str]:
    """The KV pool's bytes on a GPU, the engine argument that sets it, and how it was reached.

    ``free``/``total`` are the device's (``torch.cuda.mem_get_info``) after this engine loaded
    its weights, ``own_bytes`` what this engine itself holds so far (its weights).

    ``gpu_memory_utilization`` is this engine's share of the device, as in vLLM: weights,
    activation reserve and KV pool together stay within ``total x utilization``. What others
    hold (another worker on the device, another engine in this process) is never taken: the
    pool is also capped at what is free now, less the activation reserve. So a second engine
    on a device gets what the first left (set each one's utilization, e.g. 0.45 and 0.45, for
    an even split); an explicit ``kv_cache_memory_bytes`` is used as is when it fits.
    """
    reserve = min(GPU_ACTIVATION_RESERVE_BYTES, total // 10)
    headroom = free - reserve
    gib = 1 << 30
    if cfg.kv_cache_memory_bytes is not None:
        budget = cfg.kv_cache_memory_bytes
        if budget > headroom:
            raise ConfigError(
                f"kv_cache_memory_bytes: {budget / gib:.2f} GiB asked, but only {max(headroom, 0) / gib:.2f} GiB "
                f"of the device is free beyond the {reserve / gib:.2f} GiB activation reserve "
                f"({free / gib:.2f} of {total / gib:.2f} GiB free): lower kv_cache_memory_bytes")
        return budget, "kv_cache_memory_bytes", f"kv_cache_memory_bytes = {budget / gib:.2f} GiB"
    share = int(total * cfg.gpu_memory_utilization) - own_bytes - reserve
    budget = min(share, headroom)
    how = (f"min(share {cfg.gpu_memory_utilization:g} x {total / gib:.1f} GiB - weights {own_bytes / gib:.2f} GiB "
           f"- reserve {reserve / gib:.2f} GiB = {share / gib:.2f} GiB, free {free / gib:.2f} GiB - reserve "
           f"= {headroom / gib:.2f} GiB) = {budget / gib:.2f} GiB")
    return budget, "gpu_memory_utilization", how


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available; use device='cpu'")
    return dev


def rank_device(cfg: EngineConfig, device: torch.device, rank: int) -> torch.device:
    """A tensor-parallel rank's CUDA device: engine arg tp_device_ids, else the next index."""
    index = cfg.tp_device_ids[rank] if cfg.tp_device_ids else (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ConfigError(f"tensor-parallel rank {rank} would run on cuda:{index}, but this host has "
                          f"{torch.cuda.device_count()} CUDA device(s): set tp_device_ids (an index may repeat)")
    return torch.device("cuda", index)


def resolve_dtype(cfg: EngineConfig, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype != "auto":
        return parse_dtype(cfg.dtype)
    if device.type == "cpu":
        return torch.float32  # CPU: exact reference numerics
    return parse_dtype(model_cfg.torch_dtype or "bfloat16", "config.json torch_dtype")


class ModelRunner:
    """Owns the model weights, the KV pool tensor and the attention backend.

    With ``tensor_parallel_size > 1`` this is one rank's runner: rank 0 (``rank=0``, the
    engine's) starts the other ranks (engine/tp_group.py) and sends them each step; they run
    `run_step` (engine/tp_rank.py). Each rank's pool holds only its KV heads.
    """

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, rank: int = 0, comm=None, ctrl=None):
        self.device = resolve_device(cfg.device)
        tp = cfg.tensor_parallel_size
        if self.device.type == "cuda" and tp > 1:
            self.device = rank_device(cfg, self.device, rank)
        self.dtype = resolve_dtype(cfg, model_cfg, self.device)
        # The pool's element type: the model's, or float8 (kv_cache_dtype; engine/kv_quant.py).
        self.kv_cache_dtype, storage = parse_kv_cache_dtype(cfg.kv_cache_dtype)
        self.kv_dtype = storage or self.dtype
        self.model_cfg = model_cfg
        self.block_size = cfg.block_size
        self.expert_parallel = expert_parallel(model_cfg, tp, cfg.enable_expert_parallel, self.device.type)
        check_tp(model_cfg, tp, self.expert_parallel)
        if cfg.enable_lora and model_cfg.mla is not None:
            raise ConfigError(f"enable_lora: LoRA adapters are not supported on {model_cfg.architecture} models "
                              "(latent attention has no q/k/v projections to adapt)")
        self.shard = make_shard(model_cfg, rank, tp, self.expert_parallel)
        if model_cfg.moe is not None and tp > 1 and rank == 0:
            log.info("mixture of experts over %d ranks: %s", tp, "expert parallel (each rank 1/%d of the experts)" % tp
                     if self.expert_parallel else "tensor-parallel experts (each rank 1/%d of every expert)" % tp)
        self.kv_quant = self._kv_quant(cfg, storage) if storage is not None else None
        self.group = TPGroup.start(cfg, self.device) if tp > 1 and rank == 0 else None
        self.comm = self.group.comm if self.group is not None else comm
        self.ctrl = self.group.ctrl if self.group is not None else ctrl  # steps, control, agreement
        try:
            self._load(cfg, model_cfg)
        except BaseException as exc:
            if self.group is not None:
                self.group.fail(exc)
            raise
        if self.group is not None:
            self.group.started()

    def _load(self, cfg: EngineConfig, model_cfg: ModelConfig) -> None:
        held = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.model = self._make_model(model_cfg)
        # What this engine holds before its pool: its weights (other engines' memory excluded).
        self.own_bytes = torch.cuda.memory_allocated(self.device) - held if self.device.type == "cuda" else 0
        self.linear_backend = pack_linears(self.model, self.device, self.dtype, cfg.linear_backend)
        # LoRA adapters (engine/lora_slots.py): the projections wrapped, max_loras device slots.
        self.lora = (LoRARuntime(cfg, model_cfg, self.model, self.shard, self.device, self.dtype)
                     if cfg.enable_lora else None)
        self.num_kv_heads = len(self.shard.kv_heads)  # this rank's
        self.backend = make_backend(
            cfg.attention_backend, device=self.device, scale=model_cfg.softmax_scale,
            num_heads=len(self.shard.q_heads), num_kv_heads=self.num_kv_heads,
            head_dim=model_cfg.head_dim, dtype=self.dtype, kv_layout=cfg.kv_layout, kv_quant=self.kv_quant,
        )
        self.num_blocks = self._num_blocks(cfg)
        if self.comm is not None:
            self.num_blocks = self._agree_on_blocks(self.num_blocks)
        # One pool per process: [layers, blocks, K/V, block_size, kv_heads, head_dim] (NHD), or
        # [layers, blocks, K/V, kv_heads, block_size, head_dim] (HND).
        self.kv_layout = cfg.kv_layout
        inner = ((cfg.block_size, self.num_kv_heads) if cfg.kv_layout == "NHD"
                 else (self.num_kv_heads, cfg.block_size))
        self.kv_cache = torch.zeros(
            model_cfg.num_layers, self.num_blocks, 2, *inner, model_cfg.head_dim, dtype=self.kv_dtype, device=self.device,
        )
        if self.kv_quant is not None and cfg.calculate_kv_scales and self.calibrates_kv_scales:
            self.kv_quant = calibrate_kv_scales(self, cfg)

    # An EAGLE head's runner keeps scales of 1.0: its forward is not the model's (engine/spec_eagle.py).
    calibrates_kv_scales = True

    def _kv_quant(self, cfg: EngineConfig, storage: torch.dtype) -> KVQuant:
        """The FP8 pool's scales: the checkpoint's, or 1.0 until a calibration computes them."""
        m = self.model_cfg
        scales = None
        if not cfg.calculate_kv_scales and self.calibrates_kv_scales:
            scales = checkpoint_scales(m.path, m.num_layers, m.num_kv_heads)
        if scales is not None:
            rec = record(scales)
            log.info("KV scales from the checkpoint %s (%s)", m.path,
                     "per tensor" if rec and all(isinstance(x, float) for layer in rec for x in layer) else "per head")
        return KVQuant.static(self.kv_cache_dtype, storage, self.dtype, m.num_layers, self.device,
                              heads=self.shard.kv_heads, scales=scales if scales is not None else
                              torch.ones(m.num_layers, 2, m.num_kv_heads))

    def _make_model(self, model_cfg: ModelConfig) -> torch.nn.Module:
        """The model this runner runs, its weights loaded (an EAGLE head's runner makes its head,
        engine/spec_eagle.py)."""
        return load_model(model_cfg, self.dtype, self.device, self.shard, self.comm)

    def _agree_on_blocks(self, mine: int) -> int:
        """Every rank's pool has the same number of blocks: the smallest any rank can hold (the
        first collective, so it also waits for every rank to have loaded its shard)."""
        counts = self.ctrl.gather(torch.tensor([mine], dtype=torch.int64))
        agreed = torch.tensor([min(int(c) for c in counts) if counts else 0], dtype=torch.int64)
        return int(self.ctrl.broadcast_(agreed))

    @property
    def tensor_parallel_size(self) -> int:
        return self.shard.size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V) in this rank's pool."""
        m = self.model_cfg
        return 2 * self.block_size * self.num_kv_heads * m.head_dim * self.kv_dtype.itemsize

    def _num_blocks(self, cfg: EngineConfig) -> int:
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        per_block = self.block_bytes * self.model_cfg.num_layers
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # memory this process's allocator keeps cached (freed engines) is free to this pool
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            budget, field, how = gpu_kv_budget(cfg, free, total, self.own_bytes)
            log.info("KV pool on %s: %s", self.device, how)
        else:
            budget = cfg.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
            field, how = "kv_cache_memory_bytes", f"{budget} bytes"
        n = budget // per_block
        if n < 1:
            hint = ("; other engines or processes hold the rest of the device: lower their "
                    "gpu_memory_utilization, or set kv_cache_memory_bytes" if field == "gpu_memory_utilization" else "")
            raise ConfigError(
                f"{field}: the KV budget ({how}) does not hold one block "
                f"({per_block} bytes); raise {field}{hint}"
            )
        return int(n)

    def layout_info(self) -> dict:
        m = self.model_cfg
        return {
            "model_id": m.model_id, "architecture": m.architecture, "dtype": dtype_name(self.dtype),
            "num_layers": m.num_layers,
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "block_bytes": self.block_bytes,
            "kv_layout": self.kv_layout, "tensor_parallel_size": self.shard.size,
            # The pool's element type and, for FP8, each layer's [k_scale, v_scale] (engine/kv_quant.py).
            "kv_cache_dtype": self.kv_cache_dtype, "kv_dtype": dtype_name(self.kv_dtype),
            "kv_scales": self.kv_quant.scale_list() if self.kv_quant is not None else [],
        }

    def enable_decode_graphs(self, kv: KVCacheManager, max_batch: int, max_model_len: int, slots: int = 1) -> None:
        """Capture decode CUDA graphs (engine arg cuda_graphs; engine/cuda_graphs.py); two sets
        of them with ``slots=2`` (engine arg overlap_steps: a step loaded while one runs)."""
        if self.device.type != "cuda" or self.backend.name != "flashinfer":
            raise ConfigError(
                f"cuda_graphs=True needs device='cuda' and attention_backend='flashinfer' (with dtype "
                f"bfloat16 or float16); this engine runs {self.backend.name} on {self.device}: "
                "set cuda_graphs=False"
            )
        from .cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, kv, max_batch, max_model_len, slots)
        self.graphs.capture()

    graphs: DecodeGraphs | None = None  # DecodeGraphs once enabled
    # The next decode step's inputs prepared while this one runs (engine arg overlap_steps;
    # engine/overlap.py); None when off
    lookahead: Lookahead | None = None

    def execute(self, scheduled: list[tuple[Request, int]], kv: KVCacheManager,
                layer_hook=None) -> tuple[torch.Tensor, StepBatch]:
        """Run one step; return the logits of the requests that sample (then of the prompt
        positions whose logprobs are owed: ``batch.prompt_rows``), and the step's batch."""
        batch = None
        if self.lookahead is not None:
            if self.lookahead.inflight is not None:  # launched ahead (engine arg async_scheduling)
                done = self.lookahead.take_inflight(scheduled, kv.block_ids) if layer_hook is None else None
                self.lookahead.inflight = None
                if done is not None:
                    return done
            batch = self.lookahead.take(scheduled, kv.block_ids)
        if batch is None:
            batch = build_step_batch(scheduled, kv, self.block_size, self.device)
        if self.lora is not None:
            batch.lora_slots = self.lora.prepare(scheduled, self.group)
        return self.execute_batch(batch, layer_hook), batch

    def execute_batch(self, batch: StepBatch, layer_hook=None) -> torch.Tensor | None:
        """Run one step's built batch: a decode graph's replay where one serves it, else the
        model (the other tensor-parallel ranks with it); its logits (rank 0)."""
        if self.graphs is not None and layer_hook is None and batch.lora_slots is None:
            size = self.graphs.size_for(batch.layout)
            if size is not None:
                return self.graphs.run(batch, size)
        if isinstance(batch.meta, GraphAhead):
            batch.meta = None  # (loaded for a replay this step does not run: planned when it starts)
        if self.group is None:
            return self.run_step(batch, layer_hook)
        try:
            with self.group.exchange:  # a control call from another thread waits for the step's end
                self.group.send_step(batch)
                return self.run_step(batch, layer_hook)
        except TPGroupBroken:
            raise
        except BaseException as exc:
            raise self.group.fail(exc) from exc

    def run_step(self, batch: StepBatch, layer_hook=None) -> torch.Tensor | None:
        """Plan attention and run the model on one step's batch; logits at rank 0, None elsewhere."""
        meta = batch.meta if batch.meta is not None else self.backend.plan(batch.layout, self.device)
        if self.lora is not None:
            self.lora.begin_step(batch.lora_slots)
        logits = self.model(
            batch.input_ids, batch.positions, self.kv_cache, self.backend, meta,
            batch.logits_indices, layer_hook=layer_hook,
        )
        self.backend.queued(meta)
        return logits

    def plan_ahead(self, batch: StepBatch) -> object | None:
        """The attention plan of a step prepared while the one before runs (engine/overlap.py):
        for a step a decode graph will replay, that graph's set of inputs loaded and planned
        (`DecodeGraphs.load_ahead`); else the backend's plan, or None (planned when it starts)."""
        if self.graphs is not None and (size := self.graphs.size_for(batch.layout)) is not None:
            return self.graphs.load_ahead(batch, size)
        return self.backend.plan_ahead(batch.layout, self.device)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at TP=1)."""
        if self.group is not None:
            self.group.close()
