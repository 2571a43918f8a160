"""Where an FP8 KV pool's scales come from (docs/kv_cache.md, "Scales").

Three sources, in this order:

* **the checkpoint**: ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (or one ``kv_scale``
  for both; or ``k_proj.output_scale`` / ``v_proj.output_scale``, the compressed-tensors
  names), each a scalar (per tensor) or one value per KV head (per head), as llm-compressor and
  ModelOpt write them and vLLM reads them;
* **computed** (engine argument ``calculate_kv_scales``): one calibration forward at start over a
  fixed, seeded token sequence (`calibration_ids`) records each layer's largest |K| and |V| (per
  KV head, or per tensor with ``kv_scale_granularity: tensor``); the scale maps that maximum to
  half the format's largest value (room for activations beyond the calibration's), rounded up to
  a power of two. Every worker of one model computes the same scales from the same sequence
  (a rounding difference between TP sizes does not cross a power of two but at its edge), so a
  prefill and a decode worker pair, and the handoff's check still refuses them if they do not;
* otherwise 1.0 (vLLM's default).

Scales are held for the model's KV heads ``[num_layers, 2, total_kv_heads]`` (a per-tensor scale
is the same value for every head) on every rank; a rank reads its heads' columns, and the layout
record carries the whole so that pools of different TP sizes compare the same thing.
"""

from __future__ import annotations

import glob
import math
import os
import re

import torch
from safetensors import safe_open

from .config_base import ConfigError

# The checkpoint names of a layer's K and V scales, as vLLM reads them.
_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                         r"v_proj\.output_scale)$")
_WHICH = {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1), "k_proj.output_scale": (0,),
          "v_proj.output_scale": (1,)}
KV_SCALE_GRANULARITIES = ("head", "tensor")
CALIBRATION_SEED = 20251130


def checkpoint_scales(model_dir: str, num_layers: int, num_kv_heads: int) -> torch.Tensor | None:
    """The checkpoint's K/V scales as ``[num_layers, 2, num_kv_heads]`` float32, or None where it
    has none. A checkpoint with scales for some layers only, a scale of the wrong size or a
    non-positive scale is refused, naming the tensor."""
    found: dict[tuple[int, int], torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                m = _SCALE_NAME.match(name)
                if m is None:
                    continue
                layer = int(m.group(1))
                value = f.get_tensor(name).float().reshape(-1)
                if layer >= num_layers or value.numel() not in (1, num_kv_heads):
                    raise ConfigError(f"model={model_dir!r}: KV scale {name} has {value.numel()} values for layer "
                                      f"{layer}; a KV scale is one value or one per KV head ({num_kv_heads}) "
                                      f"of one of the {num_layers} layers")
                if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
                    raise ConfigError(f"model={model_dir!r}: KV scale {name} must be finite and positive, "
                                      f"got {value.tolist()}")
                for which in _WHICH[m.group(2)]:
                    found[(layer, which)] = value.expand(num_kv_heads)
    if not found:
        return None
    missing = [(layer, "kv"[which]) for layer in range(num_layers) for which in (0, 1) if (layer, which) not in found]
    if missing:
        layer, half = missing[0]
        raise ConfigError(f"model={model_dir!r}: the checkpoint has KV scales for some layers but not "
                          f"model.layers.{layer}.self_attn.{half}_scale ({len(missing)} missing); all layers need them")
    return torch.stack([torch.stack([found[(layer, 0)], found[(layer, 1)]]) for layer in range(num_layers)])


def calibration_ids(vocab_size: int, n: int) -> torch.Tensor:
    """The fixed token sequence a computed calibration runs (the same on every worker)."""
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (n,), generator=gen, dtype=torch.long)


def scales_from_amax(amax: torch.Tensor, fp8_max: float, granularity: str) -> torch.Tensor:
    """Scales for observed maxima ``[num_layers, 2, heads]``: each maximum maps to at most half of
    ``fp8_max``, the scale a power of two (so scaling is exact); per tensor: one per layer and half."""
    if granularity == "tensor":
        amax = amax.amax(dim=2, keepdim=True).expand_as(amax)
    out = torch.empty_like(amax, dtype=torch.float32)
    for index, value in enumerate(amax.float().reshape(-1).tolist()):
        out.view(-1)[index] = 2.0 ** math.ceil(math.log2(value / (fp8_max / 2))) if value > 0 else 1.0
    return out


def record(scales: torch.Tensor) -> list[list]:
    """The scales as a layout record carries them: per layer ``[k, v]``, each one float where every
    head has the same scale (per tensor), else the list of per-head scales."""
    out: list[list] = []
    for layer in scales.tolist():
        out.append([half[0] if all(x == half[0] for x in half) else list(half) for half in layer])
    return out
