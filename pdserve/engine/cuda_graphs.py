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
- With ``slots=2`` (engine arg ``overlap_steps``: engine/overlap.py) there are two sets of
  static inputs, wrappers and graphs: the next decode step is loaded and planned into the set
  the running step does not read (`load_ahead`), each set loaded again only after the event
  behind its last replay; the sets share the graphs' memory pool (their replays follow each
  other on the stream).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
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


@dataclass
class GraphAhead:
    """A decode step loaded and planned into graph set ``slot`` ahead of its replay (its
    batch's ``meta``: engine/overlap.py)."""

    slot: int
    size: int


class _Slot:
    """One set of static inputs, with the wrappers and graphs that read them."""

    def __init__(self, max_batch: int, max_pages: int, dev: torch.device):
        i32 = dict(dtype=torch.int32, device=dev)
        # graph P reads the first P (or P + 1) entries
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.batch_indices = torch.zeros(max_batch, **i32)
        self.append_positions = torch.zeros(max_batch, **i32)
        self.kv_indptr = torch.zeros(max_batch + 1, **i32)
        self.kv_indices = torch.zeros(max_pages, **i32)
        self.kv_last_page_len = torch.ones(max_batch, **i32)
        self.wrappers: dict[int, Any] = {}  # flashinfer's decode wrappers (flashinfer is read as Any)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.event: Any = None  # recorded behind this set's last replay (with two sets)


class DecodeGraphs:
    """The captured decode graphs of one runner and their static inputs."""

    def __init__(self, runner, kv, max_batch: int, max_model_len: int, slots: int = 1):
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
        self.slots = [_Slot(self.max_batch, self.max_pages, dev) for _ in range(slots)]
        self._last = 0  # the set the last replay read
        self.logits_rows = torch.arange(self.max_batch, dtype=torch.long, device=dev)
        self.logits = torch.empty(self.max_batch, runner.model_cfg.vocab_size, dtype=torch.float32, device=dev)
        self._pool = None

    @property
    def wrappers(self) -> dict[int, Any]:
        return self.slots[0].wrappers

    # -- capture ---------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture one graph per size, largest first (the smaller ones reuse its memory)."""
        t0 = time.perf_counter()
        dev = self.runner.device
        with torch.cuda.device(dev) if dev.type == "cuda" else _nothing():
            for slot in range(len(self.slots)):
                for size in reversed(self.sizes):
                    self._capture(size, slot)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        log.info("captured %d decode CUDA graphs (batch %s%s) in %.1f s", len(self.sizes) * len(self.slots),
                 ",".join(map(str, self.sizes)), f"; {len(self.slots)} sets" if len(self.slots) > 1 else "",
                 time.perf_counter() - t0)

    def _wrapper(self, size: int, slot: int):
        b, s = self.backend, self.slots[slot]
        return b._fi.BatchDecodeWithPagedKVCacheWrapper(
            b.workspace, b.kv_layout, use_cuda_graph=True, use_tensor_cores=b.use_tensor_cores,
            paged_kv_indptr_buffer=s.kv_indptr[:size + 1],
            paged_kv_indices_buffer=s.kv_indices,
            paged_kv_last_page_len_buffer=s.kv_last_page_len[:size],
        )

    def _meta(self, size: int, slot: int) -> FlashInferMeta:
        s = self.slots[slot]
        return FlashInferMeta(
            wrapper=s.wrappers[size], decode=True,
            batch_indices=s.batch_indices[:size], positions=s.append_positions[:size],
            kv_indices=s.kv_indices, kv_indptr=s.kv_indptr[:size + 1],
            kv_last_page_len=s.kv_last_page_len[:size],
        )

    def _forward(self, size: int, slot: int = 0) -> None:
        r, s = self.runner, self.slots[slot]
        logits = r.model(s.input_ids[:size], s.positions[:size], r.kv_cache, self.backend,
                         self._meta(size, slot), self.logits_rows[:size])
        self.logits[:size].copy_(logits)

    def _capture(self, size: int, slot: int) -> None:
        self.slots[slot].wrappers[size] = self._wrapper(size, slot)
        self._load(self._padding_plan(0, size), size, slot)  # an all-padding step: plans the wrapper
        self.slots[slot].graphs[size] = self._record(size, slot)

    def _record(self, size: int, slot: int) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (kernel selection, lazy initialisation: nothing of it may
        happen inside a capture), then capture the forward pass into the shared memory pool."""
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(size, slot)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # capture() made `dev` current: the capture stream is created on it.
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(size, slot)
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
        """Replay graph ``size`` for a decode-only step; the logits of ``batch.logits_indices``.
        A step loaded ahead (``batch.meta``, `load_ahead`) only gets its token ids now."""
        ahead = batch.meta
        if isinstance(ahead, GraphAhead) and ahead.size == size:
            slot = ahead.slot
            self.slots[slot].input_ids[:batch.input_ids.shape[0]].copy_(batch.input_ids)
        else:
            slot = self._free_slot()
            self._load(self._pad(PagedPlan.from_layout(batch.layout), size), size, slot,
                       batch.input_ids, batch.positions)
        s = self.slots[slot]
        s.graphs[size].replay()
        self._last = slot
        if len(self.slots) > 1 and self.runner.device.type == "cuda":
            s.event = torch.cuda.Event()
            s.event.record(torch.cuda.current_stream(self.runner.device))
        return self.logits.index_select(0, batch.logits_indices)

    def load_ahead(self, batch, size: int) -> GraphAhead | None:
        """Load and plan a decode step (all but its token ids) into the set the last replay did
        not read, while that replay may still run (engine/overlap.py); None with one set."""
        if len(self.slots) < 2:
            return None
        slot = self._free_slot()
        self._load(self._pad(PagedPlan.from_layout(batch.layout), size), size, slot, None, batch.positions,
                   ahead=True)
        return GraphAhead(slot, size)

    def _free_slot(self) -> int:
        """The set to load: the one the last replay did not read, once its own last replay is done."""
        if len(self.slots) == 1:
            return 0
        slot = 1 - self._last
        ev = self.slots[slot].event
        if ev is not None:
            ev.synchronize()
        return slot

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

    def _load(self, p: PagedPlan, size: int, slot: int, ids: torch.Tensor | None = None,
              pos: torch.Tensor | None = None, ahead: bool = False) -> None:
        """Copy a padded step into set ``slot``'s static buffers (device to device for the
        step's token ids and positions, padding rows zero; the ids later when they are not yet
        known) and plan its graph ``size``'s wrapper, which rewrites kv_indptr / kv_indices /
        kv_last_page_len in place. ``ahead``: the host integers from pinned memory, not
        waiting for the step before (the caching host allocator keeps it until the copy)."""
        s = self.slots[slot]
        b = 0 if pos is None else pos.shape[0]
        if b:
            s.positions[:b].copy_(pos)
            if ids is not None:
                s.input_ids[:b].copy_(ids)
        s.input_ids[b:size].zero_()
        s.positions[b:size].zero_()
        ints = torch.from_numpy(np.concatenate((p.batch_indices, p.positions)).astype(np.int32))
        dev = self.runner.device
        ints = ints.pin_memory().to(dev, non_blocking=True) if ahead and dev.type == "cuda" else ints.to(dev)
        s.batch_indices[:size].copy_(ints[:size])
        s.append_positions[:size].copy_(ints[size:])
        fi = self.backend
        s.wrappers[size].plan(
            torch.from_numpy(p.kv_indptr), torch.from_numpy(p.kv_indices),
            torch.from_numpy(p.kv_last_page_len), fi.num_heads, fi.num_kv_heads, fi.head_dim,
            self.runner.block_size, q_data_type=fi.dtype, kv_data_type=fi.dtype, sm_scale=fi.scale,
        )


def _nothing():
    return contextlib.nullcontext()
