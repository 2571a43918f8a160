"""How a scheduler plan becomes the flat, unpadded inputs of one step.

Per request the plan gives ``(request, n)``: run ``n`` new tokens whose
positions continue the ``num_computed_tokens`` already in the pool. The
integer bookkeeping (positions, slots, block tables) is built with numpy over
the whole batch at once: a step runs every ~10 ms on CPU and a handful of
small torch ops per request would cost as much as the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .attention_base import BatchLayout
from .block_manager import KVCacheManager
from .prompt_logprobs import owed_rows
from .request import Request


@dataclass
class StepBatch:
    """The model inputs of one step and the requests that sample from it."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    layout: BatchLayout
    # token index of each sampling request, then of each prompt position whose logprobs are owed;
    # a request verifying k proposals samples k + 1 consecutive rows (in ``sampling`` k + 1 times)
    logits_indices: torch.Tensor
    sampling: list[Request]
    # (request, a, b): prompt positions [a, b) whose logits follow the sampling rows, in order
    # (engine/prompt_logprobs.py)
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    # each token's LoRA adapter slot, -1 for the base (engine/lora_slots.py); None: no adapter in the step
    lora_slots: np.ndarray | None = None
    # the attention backend's plan when it was made ahead of the step (engine/overlap.py); None:
    # the runner plans it when the step starts
    meta: Any = None


def new_token_ids(req: Request, start: int, n: int) -> list[int]:
    """Token ids of positions ``[start, start + n)`` without building ``all_token_ids``."""
    prompt = req.prompt_token_ids
    if start + n <= len(prompt):
        return prompt[start:start + n]
    if start >= len(prompt):
        out = req.output_token_ids
        return out[start - len(prompt):start - len(prompt) + n]
    return req.all_token_ids[start:start + n]


def pad_block_tables(tables: list[list[int]]) -> np.ndarray:
    """Rows of block ids, right-padded with block 0 (attention masks out what it reads there)."""
    width = max(map(len, tables), default=0)
    out: np.ndarray = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def build_step_batch(scheduled: list[tuple[Request, int]], kv: KVCacheManager,
                     block_size: int, device: torch.device) -> StepBatch:
    """The flat inputs of one step for the plan's ``(request, new tokens)`` pairs."""
    num = len(scheduled)
    new = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=num)
    ctx = np.fromiter((r.num_computed_tokens for r, _ in scheduled), dtype=np.int64, count=num)
    qsl: np.ndarray = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(new, out=qsl[1:])
    ids: list[int] = []
    tables: list[list[int]] = []
    logits_idx: list[int] = []
    sampling: list[Request] = []
    prompt_idx: list[int] = []
    prompt_rows: list[tuple[Request, int, int]] = []
    for i, (req, n) in enumerate(scheduled):
        c = req.num_computed_tokens
        s = max(0, c + n - req.num_tokens)  # proposals to verify: a row each (engine/spec_decode.py)
        ids.extend(new_token_ids(req, c, n - s) + req.spec_token_ids[:s] if s else new_token_ids(req, c, n))
        tables.append(kv.block_ids(req.request_id))
        if c + n >= req.num_tokens:
            logits_idx.extend(range(int(qsl[i + 1]) - 1 - s, int(qsl[i + 1])))
            sampling.extend([req] * (s + 1))
        if req.prompt_logprobs is not None and (owed := owed_rows(req, c, n)) is not None:
            a, b = owed
            base = int(qsl[i]) - c
            prompt_idx.extend(range(base + a, base + b))
            prompt_rows.append((req, a, b))
    block_tables = pad_block_tables(tables)
    # Token t of sequence i sits at position ctx[i] + (t - qsl[i]).
    seq: np.ndarray = np.repeat(np.arange(num), new)
    pos = np.arange(qsl[-1]) - np.repeat(qsl[:-1] - ctx, new)
    slots = block_tables[seq, pos // block_size] * block_size + pos % block_size
    layout = BatchLayout(
        query_start_loc=qsl, context_lens=ctx, block_tables=block_tables,
        slot_mapping=torch.from_numpy(slots).to(device), block_size=block_size,
    )
    return StepBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.from_numpy(pos).to(device),
        layout=layout,
        logits_indices=torch.tensor(logits_idx + prompt_idx, dtype=torch.long, device=device),
        sampling=sampling,
        prompt_rows=prompt_rows,
    )
