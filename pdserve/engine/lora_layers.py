"""The LoRA delta inside the model: rows of one step with different adapters in one forward.

Each adapted projection of a layer (the fused ``qkv_proj`` and ``gate_up_proj``, ``o_proj``,
``down_proj``) is wrapped in a `LoRALinear`: the base projection runs over every row as before,
then each row gets ``scaling * (x @ A.T) @ B.T`` of its adapter added to its columns of the
output (q, k and v, gate and up, each its own A and B). `LoRAState.begin` reads the step's rows
by slot once per step, and the delta takes one of two forms:

- one adapter in the step: its rows are gathered and get two thin matmuls (rank r);
- several: one matmul of every row against the A of every slot in use (the slots' ranks side
  by side), a per-row mask that keeps only the row's own slot's columns (and holds its
  scaling), then one matmul against the B's. Two matmuls per projection whatever the mix,
  instead of two per adapter: on a CPU the per-operation cost of many thin matmuls dominates
  (bench/lora.py measures the mix against the base).

Rows without an adapter take no work when no row has one, and a zero mask row otherwise.

On a float32 CPU model, when the native kernel builds (engine/lora_native.py,
csrc/lora_bgmv.c), neither form runs: each row is multiplied by its own adapter's A and B
only, the rows of an adapter together (its weights read once per step), one call per
projection (all its parts) whatever the mix.

The weights sit in per-projection stacks of ``max_loras`` slots padded to ``max_lora_rank``
(``A: [slots, rank, in]``, ``B: [out, slots, rank]``, so that a run of slots is one matrix
either way), this rank's slice of them at TP>1 (split
like the layer: a column-parallel projection's B by its output rows, a row-parallel one's A by
its input columns, whose partial deltas join the layer's all-reduce). engine/lora_slots.py
decides what each slot holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import lora_native
from .lora import Adapter
from .lora_native import Stacks, StepArgs, step_args
from .tensor_parallel import Shard


@dataclass
class Group:
    slot: int
    rows: torch.Tensor | None  # this slot's rows of the step; None: every row
    rank: int
    scaling: float


class LoRAState:
    """What every wrapped projection reads in a step: the slots' ranks and scalings and the
    step's rows grouped by slot."""

    def __init__(self, max_loras: int, max_rank: int = 0, dtype: torch.dtype = torch.float32):
        self.ranks = [0] * max_loras
        self.scalings = [0.0] * max_loras
        self.max_rank, self.dtype = max_rank, dtype
        self.groups: list[Group] = []
        # several slots in the step: their run [lo, hi) and the [rows, (hi - lo) x max_rank] mask
        self.span: tuple[int, int] = (0, 0)
        self.mask: torch.Tensor | None = None
        # The gathered kernel (engine/lora_native.py), when it serves this model: then a step
        # with adapters passes each row's slot to it (``row_slots``), and neither form above.
        self.lib = None
        self.row_slots: StepArgs | None = None

    def begin(self, slots: np.ndarray | None, device: torch.device) -> None:
        """Group the step's rows by adapter slot (``slots[t]``; -1: the base model)."""
        self.groups = []
        self.mask = None
        self.row_slots = None
        if slots is None:
            return
        if self.lib is not None:
            if (slots >= 0).any():
                self.row_slots = step_args(slots, self.ranks, self.scalings, len(self.ranks), self.max_rank)
            return
        for s in np.unique(slots[slots >= 0]).tolist():
            rows = np.flatnonzero(slots == s)
            index = None if len(rows) == len(slots) else torch.from_numpy(rows).to(device)
            self.groups.append(Group(s, index, self.ranks[s], self.scalings[s]))
        if len(self.groups) > 1 and self.max_rank:
            lo, hi = self.groups[0].slot, self.groups[-1].slot + 1
            mask: np.ndarray = np.zeros((len(slots), hi - lo, self.max_rank), dtype=np.float32)
            for g in self.groups:
                mask[slots == g.slot, g.slot - lo, :g.rank] = g.scaling
            self.span = (lo, hi)
            self.mask = torch.from_numpy(mask.reshape(len(slots), -1)).to(device, self.dtype)


class Part:
    """One adapted projection inside a (possibly fused) linear: its output columns and stacks.
    With the native kernel its A is a view into the projection's `Stacks` and ``bt`` (B
    transposed, [slots, rank, out]) is kept beside B by `LoRAModel.fill`."""

    def __init__(self, module: str, cols: tuple[int, int], in_features: int, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype, a: torch.Tensor | None = None,
                 bt: torch.Tensor | None = None):
        self.module, self.cols = module, cols
        out = cols[1] - cols[0]
        self.a = a if a is not None else torch.zeros(max_loras, max_rank, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(out, max_loras, max_rank, device=device, dtype=dtype)
        self.bt = bt
        self.present = [False] * max_loras

    def mixed_delta(self, x: torch.Tensor, state: "LoRAState") -> torch.Tensor:
        """Every row's delta at once for the slots ``state.span`` (rows masked to their own)."""
        lo, hi = state.span
        assert state.mask is not None
        a = self.a[lo:hi].reshape(-1, self.a.shape[-1])
        b = self.b[:, lo:hi].reshape(self.b.shape[0], -1)
        return F.linear(F.linear(x, a).mul_(state.mask), b)


class LoRALinear(nn.Module):
    """``base(x)``, plus each active slot's delta on its rows (see the module docstring)."""

    def __init__(self, base: nn.Module, parts: list[Part], state: LoRAState, stacks: Stacks | None = None):
        super().__init__()
        self.base, self.parts, self.state, self.stacks = base, parts, state, stacks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        state = self.state
        if state.row_slots is not None:  # the gathered kernel: each row against its own adapter
            assert self.stacks is not None
            self.stacks.apply(state.lib, x if x.stride(-1) == 1 else x.contiguous(), state.row_slots, y)
            return y
        if self.state.mask is not None:  # several adapters in the step: one pass for all
            for p in self.parts:
                y[:, p.cols[0]:p.cols[1]].add_(p.mixed_delta(x, self.state))
            return y
        for g in self.state.groups:
            xs = x if g.rows is None else x.index_select(0, g.rows)
            for p in self.parts:
                if not p.present[g.slot]:
                    continue
                # PEFT's order: base + (B(A(x)) * scaling).
                d = F.linear(F.linear(xs, p.a[g.slot, :g.rank]), p.b[:, g.slot, :g.rank]).mul_(g.scaling)
                out = y[:, p.cols[0]:p.cols[1]]
                if g.rows is None:
                    out.add_(d)
                else:
                    out.index_add_(0, g.rows, d)
        return y


def _slices(shard: Shard, head_dim: int) -> dict[str, tuple[slice | None, slice | None]]:
    """Per module: (rows of B, columns of A) this rank holds; None: all of them."""
    def span(r: range, per: int = 1) -> slice:
        return slice(r.start * per, r.stop * per)

    q, kv, inter = span(shard.q_heads, head_dim), span(shard.kv_heads, head_dim), span(shard.inter)
    return {"q_proj": (q, None), "k_proj": (kv, None), "v_proj": (kv, None), "o_proj": (None, q),
            "gate_proj": (inter, None), "up_proj": (inter, None), "down_proj": (None, inter)}


class LoRAModel:
    """The model's projections wrapped for adapters, and how a slot is filled."""

    def __init__(self, model: nn.Module, shard: Shard, head_dim: int, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype):
        self.state = LoRAState(max_loras, max_rank, dtype)
        self.state.lib = lora_native.load(device, dtype, max_rank)
        self.slices = _slices(shard, head_dim)
        self.layers: list[dict[str, Part]] = []
        self.linears: list[LoRALinear] = []
        self.device = device

        def wrap(layer: nn.Module, attr: str, modules: list[tuple[str, int]], in_features: int) -> dict[str, Part]:
            starts = [sum(w for _, w in modules[:i]) for i in range(len(modules))]
            stacks = None
            if self.state.lib is not None:  # one kernel call for every part (engine/lora_native.py)
                stacks = Stacks([w for _, w in modules], starts, in_features, max_loras, max_rank, device, dtype)
            parts = [Part(name, (start, start + width), in_features, max_loras, max_rank, device, dtype,
                          a=None if stacks is None else stacks.a_part(i), bt=None if stacks is None else stacks.bt[i])
                     for i, ((name, width), start) in enumerate(zip(modules, starts))]
            linear = LoRALinear(getattr(layer, attr), parts, self.state, stacks)
            setattr(layer, attr, linear)
            self.linears.append(linear)
            return {p.module: p for p in parts}

        for layer in model.layers:
            hidden = layer.input_layernorm.weight.shape[0]
            inter = len(shard.inter)
            found = wrap(layer, "qkv_proj", [("q_proj", layer.q_size), ("k_proj", layer.kv_size),
                                             ("v_proj", layer.kv_size)], hidden)
            found |= wrap(layer, "o_proj", [("o_proj", hidden)], layer.q_size)
            if layer.moe is None:
                found |= wrap(layer, "gate_up_proj", [("gate_proj", inter), ("up_proj", inter)], hidden)
                found |= wrap(layer, "down_proj", [("down_proj", hidden)], inter)
            self.layers.append(found)

    def fill(self, slot: int, adapter: Adapter) -> None:
        """Copy this rank's slice of ``adapter`` into ``slot`` (the rest of the slot zeroed)."""
        r = adapter.rank
        with torch.inference_mode():
            for i, parts in enumerate(self.layers):
                for module, p in parts.items():
                    pair = adapter.weights.get((i, module))
                    p.present[slot] = pair is not None
                    p.a[slot].zero_()
                    p.b[:, slot].zero_()
                    if p.bt is not None:
                        p.bt[slot].zero_()
                    if pair is None:
                        continue
                    rows, cols = self.slices[module]
                    a, b = pair
                    p.a[slot, :r].copy_(a if cols is None else a[:, cols])
                    p.b[:, slot, :r].copy_(b if rows is None else b[rows])
                    if p.bt is not None:
                        p.bt[slot, :r].copy_(p.b[:, slot, :r].t())
            for linear in self.linears:
                if linear.stacks is not None:
                    linear.stacks.present[slot] = [p.present[slot] for p in linear.parts]
        self.state.ranks[slot], self.state.scalings[slot] = r, adapter.scaling

    def begin_step(self, slots: np.ndarray | None) -> None:
        self.state.begin(slots, self.device)
