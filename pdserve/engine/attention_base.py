"""The attention interface: what every paged attention backend implements and plans from.

A step's batch is flat and unpadded: sequence i owns query tokens
``query_start_loc[i]:query_start_loc[i+1]`` whose positions continue its
``context_lens[i]`` already-cached tokens. Per layer the model calls
``backend.forward(layer_kv, q, k, v, meta)``, which first writes the new K/V
into the paged pool (``slot_mapping``) and then attends over the whole
sequence.

The pool for one layer is ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(FlashInfer's NHD layout with K and V stacked on dim 1), see docs/architecture.md, "KV pool".
The backends: torch_attention.py (torch, and the native CPU kernel through it),
attention.py (FlashInfer on GPU, and the choice of backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class BatchLayout:
    """Per-step batch geometry shared by every layer (built once per step).

    Host-side integers are numpy arrays: backends plan from them with a few
    vectorised operations instead of a Python loop per sequence.
    """

    query_start_loc: np.ndarray  # [B+1] int64
    context_lens: np.ndarray  # [B] int64: tokens already in the pool before this step
    # [B, max_blocks] int64 block ids per sequence covering context + new tokens,
    # right-padded with block 0 (whatever a backend reads there it masks out).
    block_tables: np.ndarray
    slot_mapping: torch.Tensor  # [T] flat slot of each new token: block * block_size + offset
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    def query_len(self, i: int) -> int:
        return int(self.query_start_loc[i + 1] - self.query_start_loc[i])


class AttentionBackend:
    """Interface: ``plan`` once per step, ``forward`` once per layer."""

    name = "base"

    def plan(self, layout: BatchLayout, device: torch.device) -> object:
        raise NotImplementedError

    def plan_ahead(self, layout: BatchLayout, device: torch.device) -> object | None:
        """The plan of a step made while the step before it may still run on the device
        (engine/overlap.py), or None: it is planned when it starts."""
        return None

    def queued(self, meta) -> None:
        """The step planned as ``meta`` has all its kernels queued."""

    def forward(self, layer_kv, q, k, v, meta) -> torch.Tensor:
        raise NotImplementedError
