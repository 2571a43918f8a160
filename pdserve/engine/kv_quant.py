"""FP8 KV cache: how K and V are stored in a float8 pool and read back (docs/kv_cache.md).

With ``kv_cache_dtype`` fp8_e4m3 (``fp8``) or fp8_e5m2 the pool holds float8 elements: a new
token's K (V) is divided by its layer's ``k_scale`` (``v_scale``), clamped to the format's
finite range and cast; attention reads ``stored.to(model dtype) * scale``. The scales are static
once the engine has started, per tensor or per KV head, from the checkpoint, computed at start or
1.0 (engine/kv_scales.py); they live beside the pool (`KVQuant.scales`) and in the pool's layout
record, so two workers whose scales differ refuse to pair (kvtransfer/nixl/layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from .kv_scales import record
from .native import FP8_FACTOR

# A layer's K (or V) scale on this rank: one float, or a [heads, 1] column (per-head scales).
Scale = Union[float, torch.Tensor]

# The largest finite value of each float8 format (torch.finfo): larger values are clamped
# (e4m3fn has no infinity: an overflowing cast would be NaN).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass
class KVQuant:
    """One pool's float8 storage: its dtype, the model's dtype it is computed in, its scales."""

    name: str  # the canonical kv_cache_dtype: fp8_e4m3 | fp8_e5m2
    storage: torch.dtype  # torch.float8_e4m3fn | torch.float8_e5m2
    compute: torch.dtype  # the model's dtype
    # [num_layers, 2, total_kv_heads] float32: each layer's k_scale and v_scale for each of the
    # model's KV heads (a per-tensor scale repeats; engine/kv_scales.py says where they come from)
    scales: torch.Tensor
    heads: range  # this rank's KV heads (columns of ``scales``)
    device: torch.device

    @classmethod
    def static(cls, name: str, storage: torch.dtype, compute: torch.dtype, num_layers: int,
               device: torch.device, heads: range = range(1), scales: torch.Tensor | None = None) -> KVQuant:
        """``scales`` (``[num_layers, 2, total_kv_heads]``), or 1.0 everywhere (vLLM's default
        without checkpoint scales)."""
        if scales is None:
            scales = torch.ones(num_layers, 2, heads.stop, dtype=torch.float32)
        return cls(name, storage, compute, scales.float().cpu(), heads, device)

    def scale_list(self) -> list[list]:
        """What the layout record carries: per layer ``[k, v]``, a float each where the scale is
        per tensor, else a list over the model's KV heads (engine/kv_scales.py `record`)."""
        return record(self.scales)

    def layer_scales(self, layer: int) -> tuple[Scale, Scale]:
        return self._local[layer]

    def __post_init__(self) -> None:
        self.observed: torch.Tensor | None = None  # [num_layers, 2, local heads] while calibrating
        self.set_scales(self.scales)

    def set_scales(self, scales: torch.Tensor) -> None:
        """Use ``scales`` (``[num_layers, 2, total_kv_heads]``) from now on: before the pool holds
        anything (a calibration's result, engine/kv_scale_calibration.py)."""
        self.scales = scales.float().cpu()
        self._local: list[tuple[Scale, Scale]] = []
        for layer in self.scales[:, :, self.heads.start:self.heads.stop]:
            halves = []
            for half in layer:
                # one float where this rank's heads share a scale (no per-element broadcast), else
                # a [heads, 1] column that multiplies [..., heads, head_dim]
                halves.append(float(half[0]) if bool((half == half[0]).all())
                              else half.to(self.device)[:, None])
            self._local.append((halves[0], halves[1]))
        factor = FP8_FACTOR[self.storage]
        local = self.scales[:, :, self.heads.start:self.heads.stop].numpy().astype(np.float32) * np.float32(factor)
        self._native = [(np.ascontiguousarray(layer[0]), np.ascontiguousarray(layer[1])) for layer in local]

    def native_scales(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's K and V scale of each local KV head, times the native kernel's factor for
        this format (engine/native.py `FP8_FACTOR`): what `paged_decode` reads a float8 pool with."""
        return self._native[layer]

    def observe(self, num_layers: int) -> None:
        """Record the largest |K| and |V| per local head (a calibration: engine/runner.py)."""
        self.observed = torch.zeros(num_layers, 2, len(self.heads), dtype=torch.float32)

    def quantize(self, x: torch.Tensor, scale: Scale, layer: int = -1, half: int = 0) -> torch.Tensor:
        """``x`` (model dtype, ``[..., heads, head_dim]``) as this pool stores it."""
        if self.observed is not None and layer >= 0:
            seen = x.detach().abs().float().amax(dim=tuple(d for d in range(x.dim()) if d != x.dim() - 2))
            self.observed[layer, half] = torch.maximum(self.observed[layer, half], seen.cpu())
        limit = FP8_MAX[self.storage]
        y = x.float() if isinstance(scale, float) and scale == 1.0 else x.float() / scale
        return torch.clamp(y, -limit, limit).to(self.storage)

    def dequantize(self, stored: torch.Tensor, scale: Scale, heads_at: int = -2) -> torch.Tensor:
        """Stored float8 values back in the model's dtype; ``heads_at``: the axis of the KV heads
        (-2: ``[..., heads, head_dim]``; -3: ``[..., heads, tokens, head_dim]``)."""
        y = stored.to(self.compute)
        if isinstance(scale, float):
            return y if scale == 1.0 else y.mul_(scale)
        return y.mul_(scale if heads_at == -2 else scale.view(-1, *([1] * (-heads_at - 1))))


def layer_of(layer_kv: torch.Tensor) -> int:
    """Which layer ``layer_kv`` (``kv_cache[l]`` of the contiguous pool) is: its offset in the
    pool's storage over one layer's elements. Lets a backend find the layer's scales without
    a layer argument in the attention interface."""
    return layer_kv.storage_offset() // layer_kv.numel()
