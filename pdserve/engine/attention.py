"""Choosing the paged attention backend (`make_backend`), and the FlashInfer backend (CUDA only).

Every backend implements the interface of attention_base.py (the step's `BatchLayout`,
``plan`` once per step, ``forward`` once per layer); the torch reference path, and the
native CPU kernel path through it, are torch_attention.py. FlashInfer's limits
(`FLASHINFER_DTYPES`, `FLASHINFER_HEAD_DIMS`) stay here beside both their readers, the
backend and `make_backend`. The pool layout: docs/architecture.md, "KV pool".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import native, prefill_native
from .attention_base import AttentionBackend, BatchLayout
from .kv_quant import KVQuant
from .torch_attention import TorchAttention

log = logging.getLogger(__name__)


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

    wrapper: Any  # the planned decode or prefill wrapper (flashinfer's; flashinfer is read as Any)
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
        batch: np.ndarray = np.repeat(np.arange(len(qlens)), qlens)
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
    The pool layout is the torch path's (K and V stacked on dim 1; NHD or HND by the engine
    argument ``kv_layout``), so the two backends and NIXL peers read the same bytes.
    """

    name = "flashinfer"

    def __init__(self, scale: float, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, workspace_bytes: int = 256 << 20,
                 kv_layout: str = "NHD"):
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
        self.kv_layout = kv_layout
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        # One float workspace for both wrappers: a step runs one of them.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout, use_tensor_cores=self.use_tensor_cores)
        # A second decode wrapper, made by the first step planned ahead (engine/overlap.py): a
        # plan goes into the wrapper the last queued step does not run, once the kernels of its
        # own last step are done (an event each); the two share the float workspace, which only
        # the kernels use, one step after the other on the stream.
        self._spare: Any = None
        self._last_queued: Any = None
        self._events: dict[int, torch.cuda.Event] = {}

    def plan_ahead(self, layout: BatchLayout, device: torch.device) -> FlashInferMeta | None:
        if not bool(np.all(np.diff(layout.query_start_loc) == 1)):
            return None  # (prefill steps are not planned ahead)
        if self._spare is None:
            self._spare = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, self.kv_layout, use_tensor_cores=self.use_tensor_cores)
        return self.plan(layout, device, ahead=True)

    def queued(self, meta) -> None:
        self._last_queued = meta.wrapper
        if self._spare is not None and meta.decode and self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._events[id(meta.wrapper)] = ev

    def _decode_wrapper(self):
        if self._spare is None:
            return self._decode
        wrapper = self._spare if self._last_queued is self._decode else self._decode
        ev = self._events.get(id(wrapper))
        if ev is not None:
            ev.synchronize()
        return wrapper

    def plan(self, layout: BatchLayout, device: torch.device, ahead: bool = False) -> FlashInferMeta:
        p = PagedPlan.from_layout(layout)
        decode = bool(np.all(np.diff(p.qo_indptr) == 1))
        if decode:
            wrapper = self._decode_wrapper()
            wrapper.plan(
                _host_i32(p.kv_indptr), _host_i32(p.kv_indices), _host_i32(p.kv_last_page_len),
                self.num_heads, self.num_kv_heads, self.head_dim, layout.block_size,
                q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
            )
        else:
            self._prefill.plan(
                _host_i32(p.qo_indptr), _host_i32(p.kv_indptr), _host_i32(p.kv_indices),
                _host_i32(p.kv_last_page_len), self.num_heads, self.num_kv_heads, self.head_dim,
                layout.block_size, causal=True, sm_scale=self.scale,
                q_data_type=self.dtype, kv_data_type=self.dtype,
            )
            wrapper = self._prefill
        return self.append_meta(p, wrapper, decode, device, ahead)

    @staticmethod
    def append_meta(p: PagedPlan, wrapper, decode: bool, device: torch.device, ahead: bool = False) -> FlashInferMeta:
        """The step's append inputs on ``device``: one host-to-device copy, viewed five ways
        (ahead of its step: from pinned memory, not waiting for the step before; the caching
        host allocator keeps that memory until the copy is done)."""
        parts = (p.batch_indices, p.positions, p.kv_indices, p.kv_indptr, p.kv_last_page_len)
        host = torch.from_numpy(np.concatenate(parts))
        if ahead and device.type == "cuda":
            flat = host.pin_memory().to(device, non_blocking=True)
        else:
            flat = host.to(device)
        views = torch.split(flat, [len(x) for x in parts])
        return FlashInferMeta(wrapper, decode, *views)

    def forward(self, layer_kv, q, k, v, meta: FlashInferMeta) -> torch.Tensor:
        self._fi.append_paged_kv_cache(
            k, v, meta.batch_indices, meta.positions, layer_kv,
            meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, self.kv_layout,
        )
        # q is a view into the fused qkv projection (RoPE runs in place there).
        return meta.wrapper.run(q.contiguous(), layer_kv)


def make_backend(name: str, *, device: torch.device, scale: float, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_layout: str = "NHD",
                 kv_quant: KVQuant | None = None) -> AttentionBackend:
    """`auto` picks FlashInfer on CUDA with a 16-bit dtype and a head size it supports, when it
    is installed; on the CPU in float32 the torch path with the native paged decode kernel
    (engine/native.py) when it builds; else torch. An FP8 KV pool (``kv_quant``) runs the torch
    path with the native kernel's float8 variant the same way; FlashInfer's FP8 path is not wired."""
    if kv_quant is not None and name == "flashinfer":
        raise ValueError(f"kv_cache_dtype={kv_quant.name!r} runs on attention_backend 'auto', 'torch' or 'native', "
                         "not 'flashinfer' (its FP8 KV path is not wired yet)")
    if name == "auto":
        name = "torch"
        if device.type == "cpu" and dtype == torch.float32:
            if native.load() is not None:
                name = "native"
            else:
                log.info("attention: torch path (native decode kernel unavailable: %s)", native.why_unavailable())
        if device.type == "cuda" and kv_quant is None and dtype in FLASHINFER_DTYPES and head_dim in FLASHINFER_HEAD_DIMS:
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError:
                pass
    if name == "torch":
        return TorchAttention(scale, dtype, kv_layout=kv_layout, kv_quant=kv_quant)
    if name == "native":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"attention_backend='native' runs float32 on the CPU, not {dtype} on {device}; "
                             "use 'auto' or 'torch'")
        lib = native.load()
        if lib is None:
            raise ValueError(f"attention_backend='native': {native.why_unavailable()}; use 'auto' or 'torch'")
        # long fresh prompts through the tiled causal kernel where its vector path runs (engine/prefill_native.py)
        return TorchAttention(scale, dtype, native=lib, kv_layout=kv_layout, prefill=prefill_native.load(head_dim),
                              kv_quant=kv_quant)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend='flashinfer' needs device='cuda'; use 'torch' on CPU")
        try:
            return FlashInferAttention(scale, num_heads, num_kv_heads, head_dim, dtype, device, kv_layout=kv_layout)
        except ImportError as exc:
            raise ValueError(
                "attention_backend='flashinfer' but flashinfer is not installed; "
                "install the gpu extra: pip install 'pdserve[gpu]'"
            ) from exc
    raise ValueError(f"attention_backend={name!r}; use auto, torch, native or flashinfer")
