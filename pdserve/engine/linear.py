"""Linear layers on the CPU: weights packed once for oneDNN instead of MKL's sgemm per call.

On this project's CPU machines (AMD EPYC, AVX2) PyTorch's `F.linear` goes to MKL, whose
small-batch path is slow: a decode step of 4 sequences spent 16 of its 33 ms in the
32,000-row LM head (bench/engine_throughput.py, docs/PERFORMANCE.md), reading the 49 MB of
weights at under 3 GB/s. oneDNN with the weight reordered once at load time into its
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the same op PyTorch's inductor
uses for frozen CPU linears) runs that product at memory speed, and is as fast or faster at
every batch a step runs (1-2,048 rows). vLLM's CPU build packs its weights with oneDNN too.

The results are not bit-identical to MKL's (another summation order, differences of a few
ulp), which is why `linear_backend='torch'` stays available; greedy output stays
token-identical to HF `transformers` on the parity tests.

`pack_linears(model, device, dtype, backend)` swaps every `nn.Linear` of the model for a
`PackedLinear` in place and returns the backend it chose (`auto` resolves here).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ConfigError

LINEAR_BACKENDS = ("auto", "torch", "onednn")
# dtypes oneDNN's packed linear runs on every x86 CPU PyTorch supports (bf16 would need
# AVX512-BF16 or AMX to be fast; float32 runs everywhere).
ONEDNN_DTYPES = (torch.float32,)


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto`: oneDNN for float32 on CPU when this torch has it, else torch."""
    if name not in LINEAR_BACKENDS:
        raise ConfigError(f"linear_backend={name!r}; use auto, torch or onednn")
    usable = device.type == "cpu" and dtype in ONEDNN_DTYPES and onednn_available()
    if name == "auto":
        return "onednn" if usable else "torch"
    if name == "onednn" and not usable:
        why = ("this torch build has no oneDNN (mkldnn)" if not onednn_available()
               else f"it runs float32 on the CPU only (this engine: {dtype} on {device})")
        raise ConfigError(f"linear_backend='onednn' but {why}; use linear_backend='torch' or 'auto'")
    return name


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held only in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            # No batch-size hint: one packing for every step size (measured best or equal
            # at 1-2,048 rows against hints of 1, 64 and 2,048).
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype, backend: str = "auto") -> str:
    """Replace the model's `nn.Linear`s by `PackedLinear`s when the backend resolves to
    oneDNN; return the resolved backend. The unpacked weights are dropped (an LM head tied
    to the embedding keeps the embedding's copy)."""
    backend = resolve_linear_backend(backend, device, dtype)
    if backend != "onednn":
        return backend
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
    return backend
