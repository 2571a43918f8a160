"""Paged attention backends behind one small interface.

A step's batch is flat and unpadded: sequence i owns query tokens
``query_start_loc[i]:query_start_loc[i+1]`` whose positions continue its
``context_lens[i]`` already-cached tokens. Per layer the model calls
``backend.forward(layer_kv, q, k, v, meta)``, which first writes the new K/V
into the paged pool (``slot_mapping``) and then attends over the whole
sequence.

The pool for one layer is ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(FlashInfer's NHD layout with K and V stacked on dim 1), see docs/architecture.md, "KV pool".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import native
from .native import check_rows, paged_decode

log = logging.getLogger(__name__)


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


# Query tokens from which a sequence's prefill (chunk) goes to SDPA instead of the native
# kernel: measured on the 2-core CPU, a 2,000-token prompt prefilled 7% faster with SDPA,
# while batches of 16-384-token prompts prefill faster through the kernel.
NATIVE_MAX_QUERY = 512

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
    mask: torch.Tensor  # [g, 1, q_len, num_blocks * block_size] additive: 0 or -inf


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

    def __init__(self, scale: float, dtype: torch.dtype = torch.float32, native=None):
        self.scale = scale
        self.dtype = dtype
        # With the native kernel library (engine/native.py), decode tokens and short prompts attend in place in
        # the pool instead of through gathered copies (float32 on CPU only).
        self.native = native
        self.native_prefill = True  # prompts up to NATIVE_MAX_QUERY tokens through it too (benchmarks: False)
        if native is not None:
            self.name = "native"
        # Gather destinations for K and V, grown on demand and reused by every
        # layer and step: fresh multi-MB tensors per layer cost page faults on CPU.
        self._k_buf = torch.empty(0)
        self._v_buf = torch.empty(0)

    def plan(self, layout: BatchLayout, device: torch.device) -> _TorchMeta:
        k_rows, v_rows = _kv_rows(layout.slot_mapping, layout.block_size)
        meta = _TorchMeta(k_rows=k_rows, v_rows=v_rows)
        qsl, ctx = layout.query_start_loc, layout.context_lens
        qlens = layout.query_lens
        to_kernel = np.zeros(len(qlens), dtype=bool)
        if self.native is not None and device.type == "cpu":
            # The kernel takes decode tokens and short prompts (chunks); SDPA's blocked
            # kernel is faster for long ones (docs/PERFORMANCE.md).
            to_kernel = qlens <= NATIVE_MAX_QUERY if self.native_prefill else (qlens == 1) & (ctx > 0)
            if to_kernel.any():
                meta.native = self._native_plan(layout, np.flatnonzero(to_kernel))
        is_decode = (qlens == 1) & (ctx > 0) & ~to_kernel
        for i in np.flatnonzero(~is_decode & ~to_kernel).tolist():
            if ctx[i] == 0:
                meta.fresh.append((int(qsl[i]), int(qsl[i + 1])))
            else:
                meta.paged.append(self._chunk_group(layout, i, device))
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
        seq = np.repeat(seqs, qlens)
        # Token rows of the listed sequences, in order: each run starts at its qsl.
        qidx = np.arange(int(qlens.sum()), dtype=np.int64) + np.repeat(qsl[seqs] - (np.cumsum(qlens) - qlens), qlens)
        lens = ctx[seq] + qidx - qsl[seq] + 1
        nblk = int(-(-lens.max() // layout.block_size))
        return _NativeRows(qidx=np.ascontiguousarray(qidx, dtype=np.int64),
                             lens=np.ascontiguousarray(lens, dtype=np.int32),
                             tables=np.ascontiguousarray(layout.block_tables[seq, :nblk], dtype=np.int32))

    def _chunk_group(self, layout: BatchLayout, i: int, device) -> _PagedGroup:
        """A prefill chunk whose first position follows ``context_lens[i]`` cached tokens."""
        q0, q1 = int(layout.query_start_loc[i]), int(layout.query_start_loc[i + 1])
        ctx = int(layout.context_lens[i])
        nblk = -(-(ctx + q1 - q0) // layout.block_size)
        keys = torch.arange(nblk * layout.block_size)
        allowed = keys[None, :] <= torch.arange(ctx, ctx + q1 - q0)[:, None]  # causal over context + chunk
        return _PagedGroup(
            query_index=torch.arange(q0, q1, device=device)[None, :],
            block_ids=torch.from_numpy(layout.block_tables[i, :nblk]).to(device),
            mask=self._additive(allowed, device)[None, None],
        )

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
        pool = _flat_pool(layer_kv)
        pool.index_copy_(0, meta.k_rows, k)
        pool.index_copy_(0, meta.v_rows, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.native is not None:
            if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
                q = q.contiguous()
            n = meta.native
            if not n.max_len:  # checked once per step, not per layer
                check_rows(n.qidx, n.lens, n.tables, q.shape[0], layer_kv.shape[0], layer_kv.shape[2])
                n.max_len = int(n.lens.max())
            paged_decode(self.native, q, layer_kv, out, n.qidx, n.lens, n.tables, self.scale, checked=True,
                         max_len=n.max_len)
        for q0, q1 in meta.fresh:
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
                self._attend_paged(q, ks, vs, group, out)
        return out

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


# FlashInfer's paged kernels take 16-bit (or fp8) KV; float32 has no kernel.
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
# Head sizes FlashInfer's kernels are built for (its DISPATCH_HEAD_DIM); others fail at run time.
FLASHINFER_HEAD_DIMS = (64, 128, 256, 512)
# Query heads per KV head from which the decode wrapper runs on tensor cores (the prefill
# kernels with one query row per sequence): FlashInfer's CUDA-core decode kernel is the
# faster one only for small groups. SGLang switches at 4 too; Llama-3-8B's group is 4.
TENSOR_CORE_MIN_GROUP = 4


@dataclass
class FlashInferMeta:
    """One step's FlashInfer inputs, shared by every layer: which wrapper was planned and
    where each new token's K/V goes (`append_paged_kv_cache`'s page-table inputs)."""

    wrapper: object  # the planned decode or prefill wrapper
    decode: bool  # every sequence has one query token: the decode wrapper
    batch_indices: torch.Tensor  # [T] int32: the sequence of each new token
    positions: torch.Tensor  # [T] int32: its position in that sequence
    kv_indices: torch.Tensor  # [nnz pages] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_last_page_len: torch.Tensor  # [B] int32


@dataclass
class PagedPlan:
    """FlashInfer's CSR view of a step's page tables, on the host (numpy int32)."""

    qo_indptr: np.ndarray  # [B+1]
    kv_indptr: np.ndarray  # [B+1] pages of sequence i: kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: np.ndarray  # [nnz]
    kv_last_page_len: np.ndarray  # [B], in 1..block_size
    batch_indices: np.ndarray  # [T] sequence of each new token
    positions: np.ndarray  # [T] position of each new token in its sequence

    @classmethod
    def from_layout(cls, layout: BatchLayout) -> PagedPlan:
        bs = layout.block_size
        qsl = layout.query_start_loc
        qlens = np.diff(qsl)
        total = layout.context_lens + qlens  # every sequence's KV length after this step
        nblk = -(-total // bs)
        # Each sequence's used blocks, concatenated in order (boolean indexing is row-major).
        used = np.arange(layout.block_tables.shape[1])[None, :] < nblk[:, None]
        batch = np.repeat(np.arange(len(qlens)), qlens)
        i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
        return cls(
            qo_indptr=i32(qsl),
            kv_indptr=i32(np.concatenate(([0], np.cumsum(nblk)))),
            kv_indices=i32(layout.block_tables[used]),
            kv_last_page_len=i32(total - (nblk - 1) * bs),
            batch_indices=i32(batch),
            positions=i32(layout.context_lens[batch] + np.arange(int(qsl[-1])) - qsl[batch]),
        )


def _host_i32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


class FlashInferAttention(AttentionBackend):
    """FlashInfer paged attention (CUDA only, imported lazily), following its documentation:

    - decode-only steps (one query token per sequence) run the batch *decode* wrapper, on
      tensor cores when a KV head serves at least `TENSOR_CORE_MIN_GROUP` query heads;
      steps with a prefill chunk run the batch *prefill* wrapper (causal, aligned to the
      end of each sequence's KV, so cached context and decode tokens in the same step
      are right);
    - `plan` gets host (CPU) int32 inputs, built once per step with numpy: FlashInfer
      plans on the host and copies them to the device itself (device inputs would make
      it copy them back first);
    - new K/V go into the pool with `flashinfer.append_paged_kv_cache`, whose page-table
      inputs are copied to the device once per step and reused by every layer.
    A plan writes into the wrapper's pinned host buffer and queues its copy without
    waiting; two plans of one wrapper are safe because every step ends with the sampler
    copying tokens to the host, which waits for the stream.
    The pool layout is the torch path's (NHD, K and V stacked on dim 1), so the two
    backends and NIXL peers read the same bytes.
    """

    name = "flashinfer"

    def __init__(self, scale: float, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, workspace_bytes: int = 256 << 20):
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(
                f"attention_backend='flashinfer' runs float16/bfloat16 KV, not {dtype}; set dtype to "
                "bfloat16 (or float16), or use attention_backend='torch'"
            )
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"attention_backend='flashinfer' needs head_dim in {FLASHINFER_HEAD_DIMS}; this model's is "
                f"{head_dim}: use attention_backend='torch'"
            )
        import flashinfer  # lazy: only on CUDA

        self._fi = flashinfer
        self.scale = scale
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        # One float workspace for both wrappers: a step runs one of them.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)

    def plan(self, layout: BatchLayout, device: torch.device) -> FlashInferMeta:
        p = PagedPlan.from_layout(layout)
        decode = bool(np.all(np.diff(p.qo_indptr) == 1))
        if decode:
            self._decode.plan(
                _host_i32(p.kv_indptr), _host_i32(p.kv_indices), _host_i32(p.kv_last_page_len),
                self.num_heads, self.num_kv_heads, self.head_dim, layout.block_size,
                q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
            )
            wrapper = self._decode
        else:
            self._prefill.plan(
                _host_i32(p.qo_indptr), _host_i32(p.kv_indptr), _host_i32(p.kv_indices),
                _host_i32(p.kv_last_page_len), self.num_heads, self.num_kv_heads, self.head_dim,
                layout.block_size, causal=True, sm_scale=self.scale,
                q_data_type=self.dtype, kv_data_type=self.dtype,
            )
            wrapper = self._prefill
        return self.append_meta(p, wrapper, decode, device)

    @staticmethod
    def append_meta(p: PagedPlan, wrapper, decode: bool, device: torch.device) -> FlashInferMeta:
        """The step's append inputs on ``device``: one host-to-device copy, viewed five ways."""
        parts = (p.batch_indices, p.positions, p.kv_indices, p.kv_indptr, p.kv_last_page_len)
        flat = torch.from_numpy(np.concatenate(parts)).to(device)
        views = torch.split(flat, [len(x) for x in parts])
        return FlashInferMeta(wrapper, decode, *views)

    def forward(self, layer_kv, q, k, v, meta: FlashInferMeta) -> torch.Tensor:
        self._fi.append_paged_kv_cache(
            k, v, meta.batch_indices, meta.positions, layer_kv,
            meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, "NHD",
        )
        # q is a view into the fused qkv projection (RoPE runs in place there).
        return meta.wrapper.run(q.contiguous(), layer_kv)


def make_backend(name: str, *, device: torch.device, scale: float, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> AttentionBackend:
    """`auto` picks FlashInfer on CUDA with a 16-bit dtype and a head size it supports, when it
    is installed; on the CPU in float32 the torch path with the native paged decode kernel
    (engine/native.py) when it builds; else torch."""
    if name == "auto":
        name = "torch"
        if device.type == "cpu" and dtype == torch.float32:
            if native.load() is not None:
                name = "native"
            else:
                log.info("attention: torch path (native decode kernel unavailable: %s)", native.why_unavailable())
        if device.type == "cuda" and dtype in FLASHINFER_DTYPES and head_dim in FLASHINFER_HEAD_DIMS:
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError:
                pass
    if name == "torch":
        return TorchAttention(scale, dtype)
    if name == "native":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"attention_backend='native' runs float32 on the CPU, not {dtype} on {device}; "
                             "use 'auto' or 'torch'")
        lib = native.load()
        if lib is None:
            raise ValueError(f"attention_backend='native': {native.why_unavailable()}; use 'auto' or 'torch'")
        return TorchAttention(scale, dtype, native=lib)
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
    raise ValueError(f"attention_backend={name!r}; use auto, torch, native or flashinfer")
