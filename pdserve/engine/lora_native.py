"""LoRA deltas on the CPU with the gathered kernel (csrc/lora_bgmv.c; docs/lora.md).

Each row of a step is multiplied by its own adapter's A and B only (a matrix-vector product per
row, rows in parallel), where the torch forms of engine/lora_layers.py either gather the rows of
each adapter in turn (an operation per adapter) or multiply every row by every slot's A and B
and mask the rest away (work for every slot in the step). The engine uses it for float32 CPU
models when the kernel builds (engine/native.py); ``PDSERVE_LORA_KERNEL=torch`` keeps the torch
forms (the benchmark's ablation, bench/lora.py).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from . import native

SOURCE = "lora_bgmv.c"
MAX_RANK = 512  # the kernel keeps a row's rank-sized product on its stack


def _declare(lib) -> None:
    fn = lib.pdserve_lora_bgmv_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_int]
    fn.restype = ctypes.c_int


def load(device: torch.device, dtype: torch.dtype, max_rank: int):
    """The kernel library when it serves this model (CPU, float32, rank within `MAX_RANK`, not
    turned off by ``PDSERVE_LORA_KERNEL=torch``), else None."""
    if os.environ.get("PDSERVE_LORA_KERNEL", "auto") == "torch":
        return None
    if device.type != "cpu" or dtype != torch.float32 or max_rank > MAX_RANK:
        return None
    return native.load_library(SOURCE, _declare)


def bgmv(lib, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: np.ndarray, ranks: np.ndarray,
         scalings: np.ndarray, y: torch.Tensor, c0: int) -> None:
    """``y[t, c0:c0 + out] += scalings[s] * (a[s, :r] @ x[t]) @ bt[s, :r]`` for each row t of
    slot s = slots[t] >= 0, r = ranks[s] (``bt``: B transposed, [slots, rank, out]; the layouts
    of csrc/lora_bgmv.c, all float32)."""
    num_slots, rank, width = a.shape
    out = bt.shape[2]
    if not (x.dtype == a.dtype == bt.dtype == y.dtype == torch.float32):
        raise TypeError("the LoRA kernel runs float32 only")
    if not (a.is_contiguous() and bt.is_contiguous() and x.stride(1) == 1 and y.stride(1) == 1
            and x.shape[1] == width and bt.shape[:2] == (num_slots, rank) and x.shape[0] == y.shape[0] == len(slots)
            and 0 <= c0 and c0 + out <= y.shape[1]):
        raise ValueError("the LoRA kernel: x, a, b or y has an unexpected shape or layout")
    if slots.dtype != np.int32 or ranks.dtype != np.int32 or scalings.dtype != np.float32 or len(ranks) != num_slots:
        raise TypeError("the LoRA kernel: slots and ranks int32, scalings float32, a rank per slot")
    rc = lib.pdserve_lora_bgmv_f32(
        x.data_ptr(), x.stride(0), x.shape[0], width, a.data_ptr(), bt.data_ptr(), num_slots, rank, out,
        slots.ctypes.data, ranks.ctypes.data, scalings.ctypes.data, y.data_ptr(), y.stride(0), c0,
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the LoRA kernel: rank {rank} over {MAX_RANK}")


class StepArgs:
    """The per-step arguments every projection's call shares (the rows' slots, the slots' ranks
    and scalings as C arrays, the thread count), checked once per step by `step_args`."""

    __slots__ = ("slots", "ranks", "scalings", "num_rows", "threads")

    def __init__(self, slots: np.ndarray, ranks: np.ndarray, scalings: np.ndarray):
        self.slots, self.ranks, self.scalings = slots, ranks, scalings  # kept alive for the pointers
        self.num_rows = len(slots)
        self.threads = torch.get_num_threads()


def step_args(slots: np.ndarray, ranks: list[int], scalings: list[float], num_slots: int, max_rank: int) -> StepArgs:
    """The step's `StepArgs` (a ValueError when a slot or rank is out of the stacks' range)."""
    arr = np.ascontiguousarray(slots, dtype=np.int32)
    rk = np.asarray(ranks, dtype=np.int32)
    if len(rk) != num_slots or (len(arr) and int(arr.max()) >= num_slots) or int(rk.max(initial=0)) > max_rank:
        raise ValueError("the LoRA kernel: a row's slot or a slot's rank is out of the stacks' range")
    return StepArgs(arr, rk, np.asarray(scalings, dtype=np.float32))


def check_stacks(a: torch.Tensor, bt: torch.Tensor) -> None:
    """One part's stacks as the kernel reads them (checked once, when they are made)."""
    if not (a.dtype == bt.dtype == torch.float32 and a.is_contiguous() and bt.is_contiguous()
            and a.dim() == bt.dim() == 3 and a.shape[:2] == bt.shape[:2] and a.shape[1] <= MAX_RANK):
        raise ValueError("the LoRA kernel: stacks a [slots, rank, in] and bt [slots, rank, out], float32, contiguous")


def bgmv_step(lib, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, step: StepArgs, y: torch.Tensor, c0: int) -> None:
    """`bgmv` for a part whose stacks passed `check_stacks`, with the step's `StepArgs`: only
    what changes per call is checked (rows, widths, float32, unit stride within a row)."""
    num_slots, rank, width = a.shape
    out = bt.shape[2]
    if not (x.dtype == y.dtype == torch.float32 and x.stride(1) == 1 and y.stride(1) == 1
            and x.shape[0] == y.shape[0] == step.num_rows and x.shape[1] == width and c0 + out <= y.shape[1]):
        raise ValueError("the LoRA kernel: x or y has an unexpected shape or layout")
    lib.pdserve_lora_bgmv_f32(x.data_ptr(), x.stride(0), step.num_rows, width, a.data_ptr(), bt.data_ptr(),
                              num_slots, rank, out, step.slots.ctypes.data, step.ranks.ctypes.data,
                              step.scalings.ctypes.data, y.data_ptr(), y.stride(0), c0, step.threads)
