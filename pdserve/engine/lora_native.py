"""LoRA deltas on the CPU with the gathered kernel (csrc/lora_bgmv.c; docs/lora.md).

Each row of a step is multiplied by its own adapter's A and B only (a matrix-vector product per
row, rows in parallel, every part of a fused projection in one call), where the torch forms of
engine/lora_layers.py either gather the rows of each adapter in turn (an operation per adapter)
or multiply every row by every slot's A and B and mask the rest away (work for every slot in
the step). The engine uses it for float32 CPU
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
MAX_CHUNK = 8  # rows of one adapter the kernel takes together (csrc/lora_bgmv.c)


def _declare(lib) -> None:
    fn = lib.pdserve_lora_bgmv_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr,
                   i64, ctypes.c_int]
    fn.restype = ctypes.c_int


def load(device: torch.device, dtype: torch.dtype, max_rank: int):
    """The kernel library when it serves this model (CPU, float32, rank within `MAX_RANK`, not
    turned off by ``PDSERVE_LORA_KERNEL=torch``), else None."""
    if os.environ.get("PDSERVE_LORA_KERNEL", "auto") == "torch":
        return None
    if device.type != "cpu" or dtype != torch.float32 or max_rank > MAX_RANK:
        return None
    return native.load_library(SOURCE, _declare)


class Stacks:
    """One projection's adapter weights as the kernel reads them, every part in one call.

    ``a`` is [slots, parts, rank, in] (the parts' A's side by side per slot: q, k and v read
    the row once); part p's B, transposed to [slots, rank, out_p], is a view into one flat
    buffer (`bt`). ``present[s, p]``: slot s's adapter has part p (else the kernel skips it).
    `a_part` and `bt` are the per-part views the slots are filled through.
    """

    def __init__(self, outs: list[int], cols: list[int], in_features: int, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32):
        if dtype != torch.float32 or max_rank > MAX_RANK or len(outs) != len(cols):
            raise ValueError("the LoRA kernel: float32 stacks, rank within 512, a column offset per part")
        self.slots, self.rank, self.width, self.parts = max_loras, max_rank, in_features, len(outs)
        self.a = torch.zeros(max_loras, len(outs), max_rank, in_features, device=device, dtype=dtype)
        sizes = [max_loras * max_rank * o for o in outs]
        self.flat = torch.zeros(sum(sizes), device=device, dtype=dtype)
        self.outs = np.asarray(outs, dtype=np.int64)
        self.c0s = np.asarray(cols, dtype=np.int64)
        self.boffs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.bt = [self.flat[off:off + n].view(max_loras, max_rank, o) for off, n, o in zip(self.boffs, sizes, outs)]
        self.present: np.ndarray = np.zeros((max_loras, len(outs)), dtype=np.uint8)
        self.span = int(max(c + o for c, o in zip(cols, outs))) if outs else 0
        # the arguments that never change, pointers resolved once (a call is ~20 of them)
        self._fixed = (self.a.data_ptr(), self.flat.data_ptr(), self.slots, self.rank, self.parts,
                       self.outs.ctypes.data, self.c0s.ctypes.data, self.boffs.ctypes.data, self.present.ctypes.data)

    def a_part(self, p: int) -> torch.Tensor:
        return self.a[:, p]

    def apply(self, lib, x: torch.Tensor, step: "StepArgs", y: torch.Tensor) -> None:
        """``y[t, c0_p:c0_p + out_p] += scaling_s * (A_sp x_t) B_sp`` for every row t of slot
        s = step.slots[t] >= 0 and every part p its adapter has (csrc/lora_bgmv.c). Only what
        changes per call is checked: rows, widths, float32, unit stride within a row."""
        if not (x.dtype == y.dtype == torch.float32 and x.stride(1) == 1 and y.stride(1) == 1
                and x.shape[0] == y.shape[0] == step.num_rows and x.shape[1] == self.width
                and self.span <= y.shape[1] and len(step.ranks) == self.slots):
            raise ValueError("the LoRA kernel: x or y has an unexpected shape or layout")
        rc = lib.pdserve_lora_bgmv_f32(x.data_ptr(), x.stride(0), self.width, *self._fixed, *step.pointers,
                                       y.data_ptr(), y.stride(0), step.threads)
        if rc != 0:
            raise ValueError(f"the LoRA kernel: rank {self.rank} over {MAX_RANK}")


class StepArgs:
    """The per-step arguments every projection's call shares, as C arrays, made and checked once
    per step by `step_args`: the rows' slots, the adapter rows ordered by slot (``order``) and
    cut into chunks of at most `MAX_CHUNK` rows of one slot (``chunks``: [start, end) pairs into
    ``order``), the slots' ranks and scalings, the thread count."""

    __slots__ = ("slots", "order", "chunks", "num_chunks", "ranks", "scalings", "num_rows", "threads", "pointers")

    def __init__(self, slots: np.ndarray, order: np.ndarray, chunks: np.ndarray, ranks: np.ndarray,
                 scalings: np.ndarray):
        # kept alive for the pointers
        self.slots, self.order, self.chunks, self.ranks, self.scalings = slots, order, chunks, ranks, scalings
        self.num_chunks = len(chunks) // 2
        self.num_rows = len(slots)
        self.threads = torch.get_num_threads()
        self.pointers = (slots.ctypes.data, order.ctypes.data, chunks.ctypes.data, self.num_chunks,
                         ranks.ctypes.data, scalings.ctypes.data)


def step_args(slots: np.ndarray, ranks: list[int], scalings: list[float], num_slots: int, max_rank: int) -> StepArgs:
    """The step's `StepArgs` (a ValueError when a slot or rank is out of the stacks' range)."""
    arr = np.ascontiguousarray(slots, dtype=np.int32)
    rk = np.asarray(ranks, dtype=np.int32)
    if len(rk) != num_slots or (len(arr) and int(arr.max()) >= num_slots) or int(rk.max(initial=0)) > max_rank:
        raise ValueError("the LoRA kernel: a row's slot or a slot's rank is out of the stacks' range")
    rows = np.flatnonzero(arr >= 0)
    order = rows[np.argsort(arr[rows], kind="stable")].astype(np.int32)
    # a chunk starts where the slot changes and every `size` rows within a slot's run: at most
    # MAX_CHUNK, and small enough that every thread gets rows (8 rows of one adapter on two
    # threads: two chunks of 4)
    threads = torch.get_num_threads()
    size = max(1, min(MAX_CHUNK, -(-len(order) // threads)))
    starts = np.flatnonzero(np.diff(arr[order], prepend=-2) != 0)
    bounds: list[int] = []
    for lo, hi in zip(starts.tolist(), starts[1:].tolist() + [len(order)]):
        for c in range(lo, hi, size):
            bounds += (c, min(c + size, hi))
    return StepArgs(arr, order, np.asarray(bounds, dtype=np.int32), rk, np.asarray(scalings, dtype=np.float32))
