"""CUDA graphs for decode-only steps (engine arg ``cuda_graphs``; CUDA + FlashInfer only).

A decode step at a small batch is launch-bound: each layer issues a dozen small
kernels and the GPU waits on the host between them. Like vLLM, the engine
captures the whole model forward once per *padded batch size* (`capture_sizes`:
1, 2, 4, then every 8 up to ``cuda_graph_max_batch``) and replays the smallest
graph that holds a step, after copying the step's inputs into the graph's
static buffers.

How a replay stays correct:
- FlashInfer's decode wrapper runs in its CUDA-graph mode (`use_cuda_graph=True`,
  fixed indptr / indices / last-page-length buffers, one wrapper per size, the
  indices buffer shared): ``plan()`` runs before each replay, outside the graph,
  and rewrites those buffers in place; the captured kernels read them.
- K/V are appended with `append_paged_kv_cache` reading the same buffers, plus
  static token-to-sequence and position buffers.
- Padding rows are sequences of one token in a *scratch block* taken from the block
  pool once, outside every request's table, and never freed: their K/V land where
  no request reads and their logits are dropped.
- Every graph writes its logits into one static buffer (its first rows), so the
  graphs share their memory pool instead of each keeping a [size, vocab] output.
- Steps with a prefill chunk, a layer hook (the prefill worker streams KV per
  layer) or more sequences than the largest graph run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np
import torch

from .attention import FlashInferAttention, FlashInferMeta, PagedPlan

log = logging.getLogger(__name__)

def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8 up to ``max_batch`` (included)."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """The captured decode graphs of one runner and their static inputs."""

    def __init__(self, runner, kv, max_batch: int, max_model_len: int):
        backend = runner.backend
        if not isinstance(backend, FlashInferAttention):
            raise TypeError("decode CUDA graphs need the flashinfer attention backend")
        self.runner = runner
        self.backend = backend
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        dev = runner.device
        bs = runner.block_size
        if kv.pool.num_free < 1:
            raise RuntimeError("the KV pool has no block left for the CUDA-graph padding block")
        # Taken from the pool itself: no request id (a client's included) can name or free it.
        self._scratch = kv.pool.allocate(1)
        self.scratch_block = self._scratch[0].block_id
        self.max_pages = self.max_batch * -(-max_model_len // bs)
        i32 = dict(dtype=torch.int32, device=dev)
        # Shared static inputs; graph P reads the first P (or P + 1) entries.
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.batch_indices = torch.zeros(self.max_batch, **i32)
        self.append_positions = torch.zeros(self.max_batch, **i32)
        self.kv_indptr = torch.zeros(self.max_batch + 1, **i32)
        self.kv_indices = torch.zeros(self.max_pages, **i32)
        self.kv_last_page_len = torch.ones(self.max_batch, **i32)
        self.logits_rows = torch.arange(self.max_batch, dtype=torch.long, device=dev)
        self.logits = torch.empty(self.max_batch, runner.model_cfg.vocab_size, dtype=torch.float32, device=dev)
        self.wrappers: dict[int, Any] = {}  # flashinfer's decode wrappers (flashinfer is read as Any)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    # -- capture ---------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture one graph per size, largest first (the smaller ones reuse its memory)."""
        t0 = time.perf_counter()
        dev = self.runner.device
        with torch.cuda.device(dev) if dev.type == "cuda" else _nothing():
            for size in reversed(self.sizes):
                self._capture(size)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.sizes),
                 ",".join(map(str, self.sizes)), time.perf_counter() - t0)

    def _wrapper(self, size: int):
        b = self.backend
        return b._fi.BatchDecodeWithPagedKVCacheWrapper(
            b.workspace, b.kv_layout, use_cuda_graph=True, use_tensor_cores=b.use_tensor_cores,
            paged_kv_indptr_buffer=self.kv_indptr[:size + 1],
            paged_kv_indices_buffer=self.kv_indices,
            paged_kv_last_page_len_buffer=self.kv_last_page_len[:size],
        )

    def _meta(self, size: int) -> FlashInferMeta:
        return FlashInferMeta(
            wrapper=self.wrappers[size], decode=True,
            batch_indices=self.batch_indices[:size], positions=self.append_positions[:size],
            kv_indices=self.kv_indices, kv_indptr=self.kv_indptr[:size + 1],
            kv_last_page_len=self.kv_last_page_len[:size],
        )

    def _forward(self, size: int) -> None:
        r = self.runner
        logits = r.model(self.input_ids[:size], self.positions[:size], r.kv_cache, self.backend,
                         self._meta(size), self.logits_rows[:size])
        self.logits[:size].copy_(logits)

    def _capture(self, size: int) -> None:
        self.wrappers[size] = self._wrapper(size)
        self._load(self._padding_plan(0, size), size)  # an all-padding step: plans the wrapper
        self.graphs[size] = self._record(size)

    def _record(self, size: int) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (kernel selection, lazy initialisation: nothing of it may
        happen inside a capture), then capture the forward pass into the shared memory pool."""
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # capture() made `dev` current: the capture stream is created on it.
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(size)
        if self._pool is None:
            self._pool = graph.pool()
        return graph

    # -- replay ----------------------------------------------------------------------------
    def size_for(self, layout) -> int | None:
        """The graph size for a step, or None when it must run eagerly."""
        b = layout.num_seqs
        if b > self.max_batch or not np.all(layout.query_lens == 1):
            return None
        pages = -(-(layout.context_lens + 1) // layout.block_size)
        if int(pages.sum()) + (self.max_batch - b) > self.max_pages:
            return None
        return next(s for s in self.sizes if s >= b)

    def run(self, batch, size: int) -> torch.Tensor:
        """Replay graph ``size`` for a decode-only step; the logits of ``batch.logits_indices``."""
        self._load(self._pad(PagedPlan.from_layout(batch.layout), size), size, batch.input_ids, batch.positions)
        self.graphs[size].replay()
        return self.logits.index_select(0, batch.logits_indices)

    def _padding_plan(self, b: int, size: int) -> PagedPlan:
        """Rows b..size-1 only: each a one-token sequence in the scratch block."""
        n = size - b
        i32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731
        return PagedPlan(qo_indptr=i32(np.arange(n + 1)), kv_indptr=i32(np.arange(n + 1)),
                         kv_indices=i32(np.full(n, self.scratch_block)), kv_last_page_len=i32(np.ones(n)),
                         batch_indices=i32(np.arange(b, size)), positions=i32(np.zeros(n)))

    def _pad(self, p: PagedPlan, size: int) -> PagedPlan:
        b = len(p.kv_last_page_len)
        pad = self._padding_plan(b, size)
        cat = lambda x, y: np.concatenate((x, y)).astype(np.int32)  # noqa: E731
        return PagedPlan(
            qo_indptr=np.arange(size + 1, dtype=np.int32),
            kv_indptr=cat(p.kv_indptr, pad.kv_indptr[1:] + p.kv_indptr[-1]),
            kv_indices=cat(p.kv_indices, pad.kv_indices),
            kv_last_page_len=cat(p.kv_last_page_len, pad.kv_last_page_len),
            batch_indices=cat(p.batch_indices, pad.batch_indices),
            positions=cat(p.positions, pad.positions),
        )

    def _load(self, p: PagedPlan, size: int, ids: torch.Tensor | None = None,
              pos: torch.Tensor | None = None) -> None:
        """Copy a padded step into the static buffers (device to device for the step's token
        ids and positions, padding rows zero) and plan graph ``size``'s wrapper, which
        rewrites kv_indptr / kv_indices / kv_last_page_len in place."""
        b = 0 if ids is None else ids.shape[0]
        if b:
            self.input_ids[:b].copy_(ids)
            self.positions[:b].copy_(pos)
        self.input_ids[b:size].zero_()
        self.positions[b:size].zero_()
        ints = torch.from_numpy(np.concatenate((p.batch_indices, p.positions)).astype(np.int32))
        ints = ints.to(self.runner.device)
        self.batch_indices[:size].copy_(ints[:size])
        self.append_positions[:size].copy_(ints[size:])
        fi = self.backend
        self.wrappers[size].plan(
            torch.from_numpy(p.kv_indptr), torch.from_numpy(p.kv_indices),
            torch.from_numpy(p.kv_last_page_len), fi.num_heads, fi.num_kv_heads, fi.head_dim,
            self.runner.block_size, q_data_type=fi.dtype, kv_data_type=fi.dtype, sm_scale=fi.scale,
        )


def _nothing():
    return contextlib.nullcontext()
