"""Each step's plan, from rank 0 (which schedules and samples) to the other tensor-parallel ranks.

A step is the flat batch of engine/step_batch.py: token ids, positions, KV slots, the
layout (query starts, context lengths, block tables) and the rows whose logits are
sampled. It travels as two int64 tensors over the group's broadcast (engine/tp_comm.py):
a fixed header, then one payload of the concatenated arrays. No pickle: the other ranks
rebuild the same `StepBatch` (without requests) and plan attention from it themselves.
"""

from __future__ import annotations

import numpy as np
import torch

from .attention_base import BatchLayout
from .step_batch import StepBatch

OP_STEP, OP_STOP, OP_CONTROL = 1, 2, 3
# op, tokens, sequences, block-table width, sampled rows, block size, attachment bytes, LoRA slots
# follow (1: the payload ends with each token's adapter slot, engine/lora_slots.py; 0: none).
# OP_CONTROL: op, message bytes, then zeros.
HEADER_LEN = 8
ATTACH = 6  # header slot: bytes of the step's attachment (engine/tp_group.py `attach`)
LORA = 7  # header slot: the payload carries the tokens' LoRA slots


def encode_step(batch: StepBatch, attachment_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    lay = batch.layout
    tables = lay.block_tables
    num_tokens, num_seqs = batch.input_ids.numel(), lay.num_seqs
    header = torch.tensor([OP_STEP, num_tokens, num_seqs, tables.shape[1] if tables.ndim == 2 else 0,
                           batch.logits_indices.numel(), lay.block_size, attachment_bytes,
                           int(batch.lora_slots is not None)], dtype=torch.int64)
    payload = torch.cat([
        batch.input_ids.cpu(), batch.positions.cpu(), lay.slot_mapping.cpu(), batch.logits_indices.cpu(),
        torch.from_numpy(lay.query_start_loc), torch.from_numpy(lay.context_lens),
        torch.from_numpy(np.ascontiguousarray(tables).reshape(-1)),
        *([] if batch.lora_slots is None else [torch.from_numpy(batch.lora_slots)]),
    ]).to(torch.int64)
    return header, payload


def stop_header() -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = OP_STOP
    return header


def control_header(nbytes: int) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = OP_CONTROL, nbytes
    return header


def to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def gather_bytes(comm, data: bytes) -> list[bytes] | None:
    """Every rank's ``data`` (any lengths) at rank 0, in rank order; None on the other ranks.
    Lengths first, then one padded gather of the longest."""
    n = torch.tensor([len(data)], dtype=torch.int64)
    lengths = comm.gather(n)
    longest = torch.tensor([max(int(x) for x in lengths) if lengths else 0], dtype=torch.int64)
    comm.broadcast_(longest)
    buf = torch.zeros(int(longest), dtype=torch.uint8)
    buf[:len(data)] = to_tensor(data)
    parts = comm.gather(buf)
    if parts is None:
        return None
    return [bytes(p[:int(k)].numpy()) for p, k in zip(parts, lengths)]


def payload_len(header: torch.Tensor) -> int:
    _, t, b, w, n = (int(v) for v in header[:5])
    return 3 * t + n + (b + 1) + b + b * w + t * int(header[LORA])


def decode_step(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> StepBatch:
    _, t, b, w, n, block_size = (int(v) for v in header[:6])
    lora = int(header[LORA])
    parts = torch.split(payload, [t, t, t, n, b + 1, b, b * w, t * lora])
    ids, pos, slots, logits_idx = (p.to(device) for p in parts[:4])
    layout = BatchLayout(
        query_start_loc=parts[4].numpy().copy(), context_lens=parts[5].numpy().copy(),
        block_tables=parts[6].numpy().reshape(b, w).copy(), slot_mapping=slots, block_size=block_size,
    )
    return StepBatch(input_ids=ids, positions=pos, layout=layout, logits_indices=logits_idx, sampling=[],
                     lora_slots=parts[7].numpy().copy() if lora else None)
