"""The torch reference paged attention (CPU and GPU), with the native CPU kernel path.

`TorchAttention` implements the interface of attention_base.py in plain torch; given the
native kernel library (engine/native.py) it attends decode tokens and short prompts in
place in the pool instead (float32 on CPU: the "native" backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .attention_base import AttentionBackend, BatchLayout
from .kv_quant import KVQuant, Scale, layer_of
from .native import check_rows, paged_decode
from .prefill_native import prefill_attention

KV_LAYOUTS = ("NHD", "HND")


def nhd_view(layer_kv: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """One layer's pool as [num_blocks, 2, block_size, Hkv, D], whatever its storage order
    (HND storage is [num_blocks, 2, Hkv, block_size, D]: the view is strided)."""
    return layer_kv if kv_layout == "NHD" else layer_kv.transpose(2, 3)


def _flat_pool(layer_kv: torch.Tensor) -> torch.Tensor:
    """View one layer's pool as rows [num_blocks * 2 * block_size, H, D]."""
    nb, two, bs, h, d = layer_kv.shape
    return layer_kv.view(nb * two * bs, h, d)


def _kv_rows(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat rows of K and V for flat slots (block * block_size + offset)."""
    block = torch.div(slots, block_size, rounding_mode="floor")
    k_rows = block * block_size + slots  # == block * 2 * block_size + offset
    return k_rows, k_rows + block_size


# Query tokens from which a sequence's prefill (chunk) goes to SDPA instead of the native
# kernel: measured on the 2-core CPU, a 2,000-token prompt prefilled 7% faster with SDPA,
# while batches of 16-384-token prompts prefill faster through the kernel.
NATIVE_MAX_QUERY = 512
# A prefill chunk longer than this goes to the tiled causal kernel when it loaded: for a fresh
# prompt measured equal to the paged kernel at 100-250 tokens and faster from 300 (engine prefill
# 33 against 39 ms at 500); after context, on K/V gathered from the pool, 1.8-2.1x the paged
# kernel at 300-500 tokens and 1.6-2.2x masked SDPA beyond (docs/PERFORMANCE.md).
PREFILL_MIN_QUERY = 256

# Fixed cost of one more decode group (a handful of small ops per layer) counted
# in padded KV positions of equal cost. Splitting the decode batch by length
# trades it against attending over padding; on a 2-core CPU step time is flat
# for values between 256 and 2048.
DECODE_GROUP_COST_TOKENS = 512


@dataclass
class _PagedGroup:
    """Sequences attended together over K/V gathered from their pool blocks."""

    query_index: torch.Tensor  # [g, q_len] token index of each query
    block_ids: torch.Tensor  # [g * num_blocks] block ids, row by row, padded with 0
    mask: torch.Tensor | None  # [g, 1, q_len, num_blocks * block_size] additive: 0 or -inf
    # A prefill chunk for the tiled kernel (engine/prefill_native.py; no mask): its query rows
    # [q0, q1) after ``context`` tokens; -1 for groups SDPA attends.
    context: int = -1
    q0: int = 0
    q1: int = 0


@dataclass
class _NativeRows:
    """Query tokens for the native kernel (engine/native.py): host arrays it reads."""

    qidx: np.ndarray  # [n] int64 row of each query token in q
    lens: np.ndarray  # [n] int32 KV rows it attends (its position + 1: causal)
    tables: np.ndarray  # [n, max_blocks] int32 its sequence's block ids, C-contiguous
    max_len: int = 0  # lens.max()


@dataclass
class _TorchMeta:
    k_rows: torch.Tensor  # [T] rows in the flat pool where new K goes
    v_rows: torch.Tensor
    # HND storage: each new token's (block, offset), for writes through the NHD-ordered view
    hnd_index: tuple[torch.Tensor, torch.Tensor] | None = None
    fresh: list[tuple[int, int]] = field(default_factory=list)  # (q0, q1): prefills with no context
    paged: list[_PagedGroup] = field(default_factory=list)  # decode groups, prefill chunks after context
    max_group_blocks: int = 0
    native: _NativeRows | None = None  # query tokens the native kernel attends


class TorchAttention(AttentionBackend):
    """Reference paged attention in plain torch (CPU and GPU).

    A prefill with nothing cached before it attends to its fresh K/V directly
    (causal SDPA). Everything else reads the pool: decode tokens are grouped by
    context length, so that little padding is attended, and each group is one
    masked SDPA call over K/V gathered block by block into reused buffers; a
    prefill chunk that continues a cached context is a group of its own.
    """

    name = "torch"

    def __init__(self, scale: float, dtype: torch.dtype = torch.float32, native=None, kv_layout: str = "NHD",
                 kv_quant: KVQuant | None = None, prefill=None):
        self.scale = scale
        self.dtype = dtype
        self.kv_layout = kv_layout
        # FP8 KV (engine/kv_quant.py): K/V stored quantized, read back in ``dtype`` (the native kernel
        # widens a block's float8 rows to float32 as it reads them).
        self.kv_quant = kv_quant
        # With the native kernel library (engine/native.py), decode tokens and short prompts attend in place in
        # the pool instead of through gathered copies (float32 on CPU only).
        self.native = native
        self.native_prefill = True  # prompts up to NATIVE_MAX_QUERY tokens through it too (benchmarks: False)
        # Longer prompts with nothing cached: the tiled causal kernel (engine/prefill_native.py) when
        # it loaded, about twice SDPA's speed at 950 tokens (docs/PERFORMANCE.md); SDPA otherwise.
        self.prefill = prefill if native is not None else None
        if native is not None:
            self.name = "native"
        # Gather destinations for K and V, grown on demand and reused by every
        # layer and step: fresh multi-MB tensors per layer cost page faults on CPU.
        self._k_buf = torch.empty(0)
        self._v_buf = torch.empty(0)

    def plan_ahead(self, layout: BatchLayout, device: torch.device) -> _TorchMeta:
        return self.plan(layout, device)  # (its tensors are the plan's own: nothing a running step reads)

    def plan(self, layout: BatchLayout, device: torch.device) -> _TorchMeta:
        k_rows, v_rows = _kv_rows(layout.slot_mapping, layout.block_size)
        meta = _TorchMeta(k_rows=k_rows, v_rows=v_rows)
        if self.kv_layout == "HND":
            block = torch.div(layout.slot_mapping, layout.block_size, rounding_mode="floor")
            meta.hnd_index = (block, layout.slot_mapping - block * layout.block_size)
        qsl, ctx = layout.query_start_loc, layout.context_lens
        qlens = layout.query_lens
        to_kernel: np.ndarray = np.zeros(len(qlens), dtype=bool)
        calibrating = self.kv_quant is not None and self.kv_quant.observed is not None  # exact K/V, not the pool's
        if self.native is not None and device.type == "cpu" and not calibrating:
            # The kernel takes decode tokens and short prompts (chunks); SDPA's blocked
            # kernel is faster for long ones (docs/PERFORMANCE.md).
            to_kernel = qlens <= NATIVE_MAX_QUERY if self.native_prefill else (qlens == 1) & (ctx > 0)
            if self.prefill is not None:  # prefill chunks past PREFILL_MIN_QUERY: the tiled kernel (forward)
                to_kernel &= ~(qlens > PREFILL_MIN_QUERY)
            if to_kernel.any():
                meta.native = self._native_plan(layout, np.flatnonzero(to_kernel))
        is_decode = (qlens == 1) & (ctx > 0) & ~to_kernel
        for i in np.flatnonzero(~is_decode & ~to_kernel).tolist():
            if ctx[i] == 0:
                meta.fresh.append((int(qsl[i]), int(qsl[i + 1])))
            else:
                meta.paged.append(self._chunk_group(layout, i, device,
                                                    tiled=self.prefill is not None and qlens[i] > PREFILL_MIN_QUERY))
        decode = np.flatnonzero(is_decode)
        if decode.size:
            meta.paged.extend(self._decode_groups(layout, decode, device))
        meta.max_group_blocks = max((g.block_ids.numel() for g in meta.paged), default=0)
        return meta

    @staticmethod
    def _native_plan(layout: BatchLayout, seqs: np.ndarray) -> _NativeRows:
        """Every query token of ``seqs`` as one kernel row: the token at position ``p`` of
        its sequence attends the ``p + 1`` first KV rows (causal), through its block table."""
        qsl, ctx = layout.query_start_loc, layout.context_lens
        qlens = qsl[seqs + 1] - qsl[seqs]
        seq: np.ndarray = np.repeat(seqs, qlens)
        # Token rows of the listed sequences, in order: each run starts at its qsl.
        qidx = np.arange(int(qlens.sum()), dtype=np.int64) + np.repeat(qsl[seqs] - (np.cumsum(qlens) - qlens), qlens)
        lens = ctx[seq] + qidx - qsl[seq] + 1
        nblk = int(-(-lens.max() // layout.block_size))
        return _NativeRows(qidx=np.ascontiguousarray(qidx, dtype=np.int64),
                             lens=np.ascontiguousarray(lens, dtype=np.int32),
                             tables=np.ascontiguousarray(layout.block_tables[seq, :nblk], dtype=np.int32))

    def _chunk_group(self, layout: BatchLayout, i: int, device, tiled: bool = False) -> _PagedGroup:
        """A prefill chunk whose first position follows ``context_lens[i]`` cached tokens
        (``tiled``: for the tiled kernel, which needs no mask)."""
        q0, q1 = int(layout.query_start_loc[i]), int(layout.query_start_loc[i + 1])
        ctx = int(layout.context_lens[i])
        nblk = -(-(ctx + q1 - q0) // layout.block_size)
        block_ids = torch.from_numpy(layout.block_tables[i, :nblk]).to(device)
        query_index = torch.arange(q0, q1, device=device)[None, :]
        if tiled:
            return _PagedGroup(query_index, block_ids, None, context=ctx, q0=q0, q1=q1)
        keys = torch.arange(nblk * layout.block_size)
        allowed = keys[None, :] <= torch.arange(ctx, ctx + q1 - q0)[:, None]  # causal over context + chunk
        return _PagedGroup(query_index, block_ids, self._additive(allowed, device)[None, None])

    def _decode_groups(self, layout: BatchLayout, seqs: np.ndarray, device) -> list[_PagedGroup]:
        bs = layout.block_size
        lengths = layout.context_lens[seqs] + 1
        order = np.argsort(lengths, kind="stable")
        seqs, lengths = seqs[order], lengths[order]
        nblks = -(-lengths // bs)
        groups = []
        for a, b in split_by_length((nblks * bs).tolist(), DECODE_GROUP_COST_TOKENS):
            nblk = int(nblks[b - 1])
            ids = np.ascontiguousarray(layout.block_tables[seqs[a:b], :nblk])
            allowed = torch.arange(nblk * bs)[None, :] < torch.from_numpy(lengths[a:b])[:, None]
            groups.append(_PagedGroup(
                query_index=torch.from_numpy(layout.query_start_loc[seqs[a:b]]).to(device)[:, None],
                block_ids=torch.from_numpy(ids.reshape(-1)).to(device),
                mask=self._additive(allowed, device)[:, None, None, :],
            ))
        return groups

    def _additive(self, allowed: torch.Tensor, device) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        return mask.masked_fill_(~allowed, float("-inf")).to(device)

    def forward(self, layer_kv, q, k, v, meta: _TorchMeta) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        scales, layer = None, -1
        if self.kv_quant is not None:
            layer = layer_of(layer_kv)
            scales = self.kv_quant.layer_scales(layer)
            k, v = self._store_fp8(layer_kv, k, v, meta, scales, layer)
        elif self.kv_layout == "NHD":
            pool = _flat_pool(layer_kv)
            pool.index_copy_(0, meta.k_rows, k)
            pool.index_copy_(0, meta.v_rows, v)
        else:
            assert meta.hnd_index is not None  # plan() sets it for HND, the layout this branch serves
            block, offset = meta.hnd_index
            nhd = nhd_view(layer_kv, self.kv_layout)
            nhd[block, 0, offset] = k
            nhd[block, 1, offset] = v
        layer_kv = nhd_view(layer_kv, self.kv_layout)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.native is not None:
            if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
                q = q.contiguous()
            n = meta.native
            if not n.max_len:  # checked once per step, not per layer
                check_rows(n.qidx, n.lens, n.tables, q.shape[0], layer_kv.shape[0], layer_kv.shape[2])
                n.max_len = int(n.lens.max())
            paged_decode(self.native, q, layer_kv, out, n.qidx, n.lens, n.tables, self.scale, checked=True,
                         max_len=n.max_len, fp8_scales=None if self.kv_quant is None else self.kv_quant.native_scales(layer))
        for q0, q1 in meta.fresh:
            if self.prefill is not None and q.device.type == "cpu":
                prefill_attention(self.prefill, q[q0:q1], k[q0:q1], v[q0:q1], out[q0:q1], self.scale)
                continue
            qs, ks, vs = (t[q0:q1].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
            out[q0:q1] = o.squeeze(0).transpose(0, 1)
        if meta.paged:
            # K and V halves of the pool: [num_blocks, block_size, Hkv, D] views.
            k_pool, v_pool = layer_kv.unbind(1)
            self._k_buf = _reserve(self._k_buf, meta.max_group_blocks, k_pool)
            self._v_buf = _reserve(self._v_buf, meta.max_group_blocks, v_pool)
            for group in meta.paged:
                ks = _gather_blocks(k_pool, group, self._k_buf)
                vs = _gather_blocks(v_pool, group, self._v_buf)
                if self.kv_quant is not None and scales is not None:
                    ks = self.kv_quant.dequantize(ks, scales[0], heads_at=-3)  # [g, Hkv, tokens, D]
                    vs = self.kv_quant.dequantize(vs, scales[1], heads_at=-3)
                if group.context >= 0:  # a long chunk after context: the tiled kernel, on the gathered K/V
                    keys = group.context + group.q1 - group.q0
                    prefill_attention(self.prefill, q[group.q0:group.q1], ks[0].transpose(0, 1)[:keys],
                                      vs[0].transpose(0, 1)[:keys], out[group.q0:group.q1], self.scale,
                                      q_offset=group.context)
                else:
                    self._attend_paged(q, ks, vs, group, out)
        return out

    def _store_fp8(self, layer_kv, k, v, meta: _TorchMeta, scales: tuple[Scale, Scale], layer: int):
        """Write the new K/V quantized into the float8 pool (as bytes: torch's CPU index ops lack
        float8) and return them as attention reads them back: stored values in the model's dtype
        (while the scales are being calibrated, the exact values: engine/kv_scales.py)."""
        assert self.kv_quant is not None
        qk, qv = self.kv_quant.quantize(k, scales[0], layer, 0), self.kv_quant.quantize(v, scales[1], layer, 1)
        raw = layer_kv.view(torch.uint8)
        if self.kv_layout == "NHD":
            pool = _flat_pool(raw)
            pool.index_copy_(0, meta.k_rows, qk.view(torch.uint8))
            pool.index_copy_(0, meta.v_rows, qv.view(torch.uint8))
        else:
            assert meta.hnd_index is not None
            block, offset = meta.hnd_index
            nhd = nhd_view(raw, self.kv_layout)
            nhd[block, 0, offset] = qk.view(torch.uint8)
            nhd[block, 1, offset] = qv.view(torch.uint8)
        if self.kv_quant.observed is not None:
            return k, v
        return self.kv_quant.dequantize(qk, scales[0]), self.kv_quant.dequantize(qv, scales[1])

    def _attend_paged(self, q, ks, vs, group: _PagedGroup, out: torch.Tensor) -> None:
        g, q_len = group.query_index.shape
        _, num_heads, head_dim = q.shape
        flat_index = group.query_index.reshape(-1)
        qs = q.index_select(0, flat_index)
        if q_len == 1:
            # Decode: the query heads that share a KV head become that head's
            # query rows (one mask fits all), so each K/V row is read once per
            # KV head rather than once per query head.
            qs = qs.view(g, ks.shape[1], -1, head_dim)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=group.mask, scale=self.scale)
            out.index_copy_(0, flat_index, o.reshape(g, num_heads, head_dim))
            return
        qs = qs.view(g, q_len, num_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=group.mask, scale=self.scale,
                                           enable_gqa=True)
        out.index_copy_(0, flat_index, o.transpose(1, 2).reshape(g * q_len, num_heads, head_dim))


def split_by_length(lengths: list[int], group_cost: int) -> list[tuple[int, int]]:
    """Cut ascending ``lengths`` into runs ``[a, b)`` minimising the padded work
    ``sum((b - a) * lengths[b - 1])`` plus ``group_cost`` per run.

    Dynamic programming over the ends of runs of equal length only: cutting
    between equal lengths adds a group and removes no padding.
    """
    n = len(lengths)
    ends = [b for b in range(1, n + 1) if b == n or lengths[b] != lengths[b - 1]]
    best, start = {0: 0}, {}
    for j, b in enumerate(ends):
        longest = lengths[b - 1]
        best[b], start[b] = min(
            (best[a] + (b - a) * longest + group_cost, a) for a in [0] + ends[:j]
        )
    runs, b = [], n
    while b > 0:
        runs.append((start[b], b))
        b = start[b]
    return runs[::-1]


def _reserve(buf: torch.Tensor, num_blocks: int, half: torch.Tensor) -> torch.Tensor:
    """``buf`` if it holds ``num_blocks`` blocks of ``half``, else a larger buffer."""
    need = num_blocks * half.shape[1] * half.shape[2] * half.shape[3]
    if buf.numel() >= need and buf.dtype == half.dtype and buf.device == half.device:
        return buf
    return torch.empty(max(need, buf.numel() * 3 // 2), dtype=half.dtype, device=half.device)


def _gather_blocks(half: torch.Tensor, group: _PagedGroup, buf: torch.Tensor) -> torch.Tensor:
    """K (or V) of the group's blocks as [g, Hkv, num_blocks * block_size, D].

    ``half`` is [num_blocks, block_size, Hkv, D]: whole blocks are copied, each a
    contiguous run of block_size * Hkv * D values.
    """
    n = group.block_ids.numel()
    _, block_size, num_kv_heads, head_dim = half.shape
    dst = buf[: n * block_size * num_kv_heads * head_dim].view(n, block_size, num_kv_heads, head_dim)
    torch.index_select(half, 0, group.block_ids, out=dst)
    g = group.query_index.shape[0]
    return dst.view(g, -1, num_kv_heads, head_dim).transpose(1, 2)
