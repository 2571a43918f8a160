"""How to run a step: the model, its KV pool and the attention backend.

Turns a scheduler plan into one flat, unpadded batch (`step_batch`), runs the
model and returns the logits of the sequences that reached their last known
token.
"""

from __future__ import annotations

import logging

import torch

from .attention import make_backend
from .block_manager import KVCacheManager
from .config import ConfigError, EngineConfig, ModelConfig, dtype_name, parse_dtype
from .linear import pack_linears
from .model import load_model
from .request import Request
from .step_batch import build_step_batch

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 256 << 20
# GPU memory kept back from the KV pool for activations and workspaces.
GPU_ACTIVATION_RESERVE_BYTES = 2 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available; use device='cpu'")
    return dev


def resolve_dtype(cfg: EngineConfig, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype != "auto":
        return parse_dtype(cfg.dtype)
    if device.type == "cpu":
        return torch.float32  # CPU: exact reference numerics
    return parse_dtype(model_cfg.torch_dtype or "bfloat16", "config.json torch_dtype")


class ModelRunner:
    """Owns the model weights, the KV pool tensor and the attention backend."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig):
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg, model_cfg, self.device)
        self.model_cfg = model_cfg
        self.block_size = cfg.block_size
        self.model = load_model(model_cfg, self.dtype, self.device)
        self.linear_backend = pack_linears(self.model, self.device, self.dtype, cfg.linear_backend)
        self.backend = make_backend(
            cfg.attention_backend, device=self.device, scale=model_cfg.head_dim ** -0.5,
            num_heads=model_cfg.num_heads, num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim, dtype=self.dtype,
        )
        self.num_blocks = self._num_blocks(cfg)
        # One pool per process: [layers, blocks, K/V, block_size, kv_heads, head_dim].
        self.kv_cache = torch.zeros(
            model_cfg.num_layers, self.num_blocks, 2, cfg.block_size,
            model_cfg.num_kv_heads, model_cfg.head_dim, dtype=self.dtype, device=self.device,
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        m = self.model_cfg
        return 2 * self.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def _num_blocks(self, cfg: EngineConfig) -> int:
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        per_block = self.block_bytes * self.model_cfg.num_layers
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - GPU_ACTIVATION_RESERVE_BYTES
            field = "gpu_memory_utilization"
        else:
            budget = cfg.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
            field = "kv_cache_memory_bytes"
        n = budget // per_block
        if n < 1:
            raise ConfigError(
                f"{field}: the KV budget ({budget} bytes) does not hold one block "
                f"({per_block} bytes); raise {field}"
            )
        return int(n)

    def layout_info(self) -> dict:
        m = self.model_cfg
        return {
            "model_id": m.model_id, "dtype": dtype_name(self.dtype), "num_layers": m.num_layers,
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "block_bytes": self.block_bytes,
        }

    def enable_decode_graphs(self, kv: KVCacheManager, max_batch: int, max_model_len: int) -> None:
        """Capture decode CUDA graphs (engine arg cuda_graphs; engine/cuda_graphs.py)."""
        if self.device.type != "cuda" or self.backend.name != "flashinfer":
            raise ConfigError(
                f"cuda_graphs=True needs device='cuda' and attention_backend='flashinfer' (with dtype "
                f"bfloat16 or float16); this engine runs {self.backend.name} on {self.device}: "
                "set cuda_graphs=False"
            )
        from .cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, kv, max_batch, max_model_len)
        self.graphs.capture()

    graphs = None  # DecodeGraphs once enabled

    def execute(self, scheduled: list[tuple[Request, int]], kv: KVCacheManager,
                layer_hook=None) -> tuple[torch.Tensor, list[Request]]:
        """Run one step; return logits for the requests that sample, and those requests."""
        batch = build_step_batch(scheduled, kv, self.block_size, self.device)
        if self.graphs is not None and layer_hook is None:
            size = self.graphs.size_for(batch.layout)
            if size is not None:
                return self.graphs.run(batch, size), batch.sampling
        meta = self.backend.plan(batch.layout, self.device)
        logits = self.model(
            batch.input_ids, batch.positions, self.kv_cache, self.backend, meta,
            batch.logits_indices, layer_hook=layer_hook,
        )
        return logits, batch.sampling
