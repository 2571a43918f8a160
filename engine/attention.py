"""Paged attention backends behind one small interface.

A step's batch is flat and unpadded: sequence i owns query tokens
``query_start_loc[i]:query_start_loc[i+1]`` whose positions continue its
``context_lens[i]`` already-cached tokens. Per layer the model calls
``backend.forward(layer_kv, q, k, v, meta)``, which first writes the new K/V
into the paged pool (``slot_mapping``) and then attends over the whole
sequence.

The pool for one layer is ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(FlashInfer's NHD layout with K and V stacked on dim 1), see ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class BatchLayout:
    """Per-step batch geometry shared by every layer (built once per step)."""

    query_start_loc: list[int]  # len B+1
    context_lens: list[int]  # tokens already in the pool before this step, per sequence
    block_tables: list[list[int]]  # block ids per sequence, covering context + new tokens
    slot_mapping: torch.Tensor  # [T] flat slot of each new token: block * block_size + offset
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


class AttentionBackend:
    """Interface: ``plan`` once per step, ``forward`` once per layer."""

    name = "base"

    def plan(self, layout: BatchLayout, device: torch.device) -> object:
        raise NotImplementedError

    def forward(self, layer_kv, q, k, v, meta) -> torch.Tensor:
        raise NotImplementedError


def _flat_pool(layer_kv: torch.Tensor) -> torch.Tensor:
    """View one layer's pool as rows [num_blocks * 2 * block_size, H, D]."""
    nb, two, bs, h, d = layer_kv.shape
    return layer_kv.view(nb * two * bs, h, d)


def _kv_rows(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat rows of K and V for flat slots (block * block_size + offset)."""
    block = torch.div(slots, block_size, rounding_mode="floor")
    k_rows = block * block_size + slots  # == block * 2 * block_size + offset
    return k_rows, k_rows + block_size


@dataclass
class _TorchMeta:
    k_rows: torch.Tensor  # [T] rows in the flat pool where new K goes
    v_rows: torch.Tensor
    # Decode group: sequences with one query token, attended together, padded.
    decode_q_idx: torch.Tensor | None = None  # [Bd] token index of each decode query
    decode_k_rows: torch.Tensor | None = None  # [Bd, Lmax]
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, Lmax] bool, True = attend
    # Prefill group: (q_start, q_end, context_len, k_rows or None, mask or None)
    prefills: list = field(default_factory=list)


class TorchAttention(AttentionBackend):
    """Reference paged attention in plain torch (CPU and GPU).

    Single-query sequences (decode) are attended in one padded, masked SDPA
    call; multi-token sequences (prefill chunks) one SDPA call each, reading
    their fresh K/V directly when nothing is cached before them.
    """

    name = "torch"

    def __init__(self, scale: float):
        self.scale = scale

    def plan(self, layout: BatchLayout, device: torch.device) -> _TorchMeta:
        bs = layout.block_size
        k_rows, v_rows = _kv_rows(layout.slot_mapping, bs)
        meta = _TorchMeta(k_rows=k_rows, v_rows=v_rows)
        decode_seqs = []
        for i in range(layout.num_seqs):
            q0, q1 = layout.query_start_loc[i], layout.query_start_loc[i + 1]
            ctx = layout.context_lens[i]
            if q1 - q0 == 1 and ctx > 0:
                decode_seqs.append(i)
                continue
            if ctx == 0:
                meta.prefills.append((q0, q1, 0, None, None))
                continue
            total = ctx + (q1 - q0)
            rows = _seq_rows(layout.block_tables[i], total, bs, device)
            q_pos = torch.arange(ctx, total, device=device)
            mask = torch.arange(total, device=device)[None, :] <= q_pos[:, None]
            meta.prefills.append((q0, q1, ctx, rows, mask))
        if decode_seqs:
            lens = [layout.context_lens[i] + 1 for i in decode_seqs]
            lmax = max(lens)
            rows = torch.zeros(len(decode_seqs), lmax, dtype=torch.long)
            for j, i in enumerate(decode_seqs):
                rows[j, : lens[j]] = _seq_rows(layout.block_tables[i], lens[j], bs, "cpu")
            lens_t = torch.tensor(lens)
            mask = torch.arange(lmax)[None, :] < lens_t[:, None]
            meta.decode_q_idx = torch.tensor(
                [layout.query_start_loc[i] for i in decode_seqs], device=device
            )
            meta.decode_k_rows = rows.to(device)
            meta.decode_mask = mask[:, None, None, :].to(device)
        return meta

    def forward(self, layer_kv, q, k, v, meta: _TorchMeta) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        pool = _flat_pool(layer_kv)
        pool.index_copy_(0, meta.k_rows, k)
        pool.index_copy_(0, meta.v_rows, v)
        out = torch.empty_like(q)
        for q0, q1, ctx, rows, mask in meta.prefills:
            qs = q[q0:q1].transpose(0, 1).unsqueeze(0)
            if rows is None:
                ks = k[q0:q1].transpose(0, 1).unsqueeze(0)
                vs = v[q0:q1].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                ks = pool[rows].transpose(0, 1).unsqueeze(0)
                vs = pool[rows + _block_size(layer_kv)].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True
                )
            out[q0:q1] = o.squeeze(0).transpose(0, 1)
        if meta.decode_q_idx is not None:
            qd = q[meta.decode_q_idx].unsqueeze(2)  # [Bd, Hq, 1, D]
            kd = pool[meta.decode_k_rows].transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = pool[meta.decode_k_rows + _block_size(layer_kv)].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
            )
            out[meta.decode_q_idx] = o.squeeze(2)
        return out


def _block_size(layer_kv: torch.Tensor) -> int:
    return layer_kv.shape[2]


def _seq_rows(block_table: list[int], length: int, block_size: int, device) -> torch.Tensor:
    """Flat K rows of the first `length` tokens of a sequence."""
    nblk = (length + block_size - 1) // block_size
    blocks = torch.tensor(block_table[:nblk], dtype=torch.long)
    rows = (blocks[:, None] * (2 * block_size) + torch.arange(block_size)[None, :]).reshape(-1)
    return rows[:length].to(device)


class FlashInferAttention(AttentionBackend):
    """FlashInfer paged attention (CUDA only, imported lazily).

    One ``BatchPrefillWithPagedKVCacheWrapper`` covers prefill chunks and
    decode tokens alike (a decode token is a query of length 1), so mixed
    steps need a single plan per step. New K/V are appended with the same
    slot mapping as the torch path, keeping one pool layout for both.
    """

    name = "flashinfer"

    def __init__(self, scale: float, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, workspace_bytes: int = 256 << 20):
        import flashinfer  # noqa: F401  (lazy: only on CUDA)

        self.scale = scale
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, layout: BatchLayout, device: torch.device):
        bs = layout.block_size
        indptr, indices, last_len = [0], [], []
        for i in range(layout.num_seqs):
            total = layout.context_lens[i] + layout.query_len(i)
            nblk = (total + bs - 1) // bs
            indices.extend(layout.block_tables[i][:nblk])
            indptr.append(len(indices))
            last_len.append(total - (nblk - 1) * bs)
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        self._wrapper.plan(
            as_i32(layout.query_start_loc), as_i32(indptr), as_i32(indices), as_i32(last_len),
            self.num_heads, self.num_kv_heads, self.head_dim, bs,
            causal=True, sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )
        k_rows, v_rows = _kv_rows(layout.slot_mapping, bs)
        return k_rows, v_rows

    def forward(self, layer_kv, q, k, v, meta) -> torch.Tensor:
        k_rows, v_rows = meta
        pool = _flat_pool(layer_kv)
        pool.index_copy_(0, k_rows, k)
        pool.index_copy_(0, v_rows, v)
        return self._wrapper.run(q, layer_kv)


def make_backend(name: str, *, device: torch.device, scale: float, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> AttentionBackend:
    """`auto` picks FlashInfer on CUDA when it is installed, else torch."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError:
                pass
    if name == "torch":
        return TorchAttention(scale)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend='flashinfer' needs device='cuda'; use 'torch' on CPU")
        try:
            return FlashInferAttention(scale, num_heads, num_kv_heads, head_dim, dtype, device)
        except ImportError as exc:
            raise ValueError(
                "attention_backend='flashinfer' but flashinfer is not installed; "
                "install the gpu extra: pip install 'pdserve[gpu]'"
            ) from exc
    raise ValueError(f"attention_backend={name!r}; use auto, torch or flashinfer")
