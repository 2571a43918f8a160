"""FP8 KV cache: how K and V are stored in a float8 pool and read back (docs/kv_cache.md).

With ``kv_cache_dtype`` fp8_e4m3 (``fp8``) or fp8_e5m2 the pool holds float8 elements: a new
token's K (V) is divided by its layer's ``k_scale`` (``v_scale``), clamped to the format's
finite range and cast; attention reads ``stored.to(model dtype) * scale``. The scales are static
and per tensor (one K and one V scale per layer), 1.0 as in vLLM when a checkpoint carries none;
they live beside the pool (`KVQuant.scales`, ``[num_layers, 2]`` float32) and in the pool's
layout record, so two workers whose scales differ refuse to pair (kvtransfer/nixl/layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The largest finite value of each float8 format (torch.finfo): larger values are clamped
# (e4m3fn has no infinity: an overflowing cast would be NaN).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass
class KVQuant:
    """One pool's float8 storage: its dtype, the model's dtype it is computed in, its scales."""

    name: str  # the canonical kv_cache_dtype: fp8_e4m3 | fp8_e5m2
    storage: torch.dtype  # torch.float8_e4m3fn | torch.float8_e5m2
    compute: torch.dtype  # the model's dtype
    scales: torch.Tensor  # [num_layers, 2] float32: each layer's k_scale, v_scale

    @classmethod
    def static(cls, name: str, storage: torch.dtype, compute: torch.dtype, num_layers: int,
               device: torch.device) -> KVQuant:
        """Per-tensor scales of 1.0 (vLLM's default without checkpoint scales)."""
        return cls(name, storage, compute, torch.ones(num_layers, 2, dtype=torch.float32, device=device))

    def scale_list(self) -> list[list[float]]:
        """The scales as plain floats, layer by layer: what the layout record carries."""
        return [[float(k), float(v)] for k, v in self.scales.cpu().tolist()]

    def layer_scales(self, layer: int) -> tuple[float, float]:
        k, v = self._host[layer]
        return k, v

    def __post_init__(self) -> None:
        # Host copies: read once per layer and step without a device sync.
        self._host = [(float(k), float(v)) for k, v in self.scales.cpu().tolist()]

    def quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``x`` (model dtype) as this pool stores it."""
        limit = FP8_MAX[self.storage]
        y = x.float() if scale == 1.0 else x.float() / scale
        return torch.clamp(y, -limit, limit).to(self.storage)

    def dequantize(self, stored: torch.Tensor, scale: float) -> torch.Tensor:
        """Stored float8 values back in the model's dtype."""
        y = stored.to(self.compute)
        return y if scale == 1.0 else y.mul_(scale)


def layer_of(layer_kv: torch.Tensor) -> int:
    """Which layer ``layer_kv`` (``kv_cache[l]`` of the contiguous pool) is: its offset in the
    pool's storage over one layer's elements. Lets a backend find the layer's scales without
    a layer argument in the attention interface."""
    return layer_kv.storage_offset() // layer_kv.numel()
