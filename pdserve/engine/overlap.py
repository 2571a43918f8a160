"""The next decode step's inputs, prepared while the current step runs (engine argument
``overlap_steps``).

A decode step on a GPU is mostly host work at small batches: the step's inputs (positions,
page table, slot mapping) are built after the previous step's tokens are known, while the
device idles. In a run of decode-only steps with nobody waiting, the next step is predictable:
the same requests, one token each, one position further. So, as soon as step N's forward is
launched (and before its sampled tokens are read back, which waits for the device), the engine
predicts step N+1 (`predict_next`), builds its inputs and plans its attention
(`Lookahead.prepare`, with the runner's `plan_ahead`);
when the scheduler's actual plan for N+1 is that prediction (same requests, same order, the
same context and block table each), the runner takes the prepared inputs (`Lookahead.take`)
and only fills in the token ids just sampled. Any other plan (an arrival, a finish, a
preemption, a prompt chunk, speculation) builds its inputs as before: the prediction is never
trusted, only compared.

The block a request crosses into at step N+1 is allocated with the prediction, as the
scheduler would at N+1 (`KVCacheManager.allocate`, the same call), only while the pool has a
block spare for every running request and only from free blocks holding no cached prefix:
the scheduler then finds it allocated. Before a plan that may admit someone, the engine drops
the prepared step and gives those blocks back (`Lookahead.release`), so that admission (a
remote-KV reservation above all) sees the pool it would without the prediction.

Correct by construction on a device: the prepared integers are written into one of two host
staging buffers (pinned on CUDA), and reach the device with one copy that does not wait for
the host (``non_blocking``); a buffer is written again only after the event recorded behind
its last copy has completed (`Staging`). What reaches the device ahead of its step goes into
tensors of its own, read only by kernels queued after the copy on the same stream; a plan that
writes a backend's buffers goes into a second set, alternating (FlashInfer's decode wrappers,
engine/attention.py). The sampled tokens are read back by the sampler, which waits for the
stream. On the CPU every copy is synchronous: the same code runs with events that are always
complete (the prepared step is then no faster, but it is the same step: the tests compare
tokens with and without it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import logging

import numpy as np
import torch

from .attention_base import BatchLayout
from .step_batch import StepBatch, pad_block_tables
from .tp_group import TPGroupBroken

log = logging.getLogger(__name__)


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class _Done:
    """An event of a copy that already happened (the host's own memory)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class Transfer(Protocol):
    """How staged integers reach the device, and the event that says a copy has read them."""

    pinned: bool

    def copy(self, host: torch.Tensor) -> torch.Tensor: ...
    def record(self) -> Event: ...


class HostTransfer:
    """CPU engine: the "device" tensor is a copy of the staged one, made now."""

    pinned = False

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        return host.clone()

    def record(self) -> Event:
        return _Done()


class CudaTransfer:
    """CUDA: an asynchronous copy from pinned memory on the current stream, an event behind it."""

    pinned = True

    def __init__(self, device: torch.device):
        self.device = device

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def record(self) -> Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev


def transfer_for(device: torch.device) -> Transfer:
    return CudaTransfer(device) if device.type == "cuda" else HostTransfer()


class Staging:
    """``slots`` host buffers of int64 that prepared steps are written into; each is read by
    one copy to the device, and written again only once the event behind that copy is done."""

    def __init__(self, transfer: Transfer, slots: int = 2, capacity: int = 1024):
        self.transfer = transfer
        self.bufs = [self._buffer(capacity) for _ in range(slots)]
        self.events: list[Event | None] = [None] * slots
        self.next = 0
        self.waited = 0  # writes that found their buffer's last copy still running (and waited)

    def _buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=self.transfer.pinned)

    def acquire(self, n: int) -> tuple[int, np.ndarray]:
        """A free buffer's slot and its first ``n`` entries, to write."""
        s = self.next
        self.next = (s + 1) % len(self.bufs)
        ev = self.events[s]
        if ev is not None and not ev.query():
            self.waited += 1
            ev.synchronize()
        self.events[s] = None
        if self.bufs[s].numel() < n:  # (its last copy is done: the old buffer can go)
            self.bufs[s] = self._buffer(max(n, 2 * self.bufs[s].numel()))
        return s, self.bufs[s][:n].numpy()

    def upload(self, s: int, n: int, start: int = 0) -> torch.Tensor:
        """Buffer ``s``'s entries ``[start, start + n)`` on the device; the buffer is busy until
        the copy is (copies on one stream finish in order: the last one's event covers them)."""
        out = self.transfer.copy(self.bufs[s][start:start + n])
        self.events[s] = self.transfer.record()
        return out


@dataclass
class _Prepared:
    reqs: list  # the predicted step's requests, in the scheduler's order
    context: list[int]  # each one's computed tokens (its new token's position)
    tables: list[list[int]]  # each one's block ids
    batch: StepBatch  # its inputs but the token ids, and its attention plan when made ahead
    slot: int  # the staging buffer: [positions | slot mapping | logits rows | token ids]
    host: np.ndarray
    grown: list  # the requests given their next block by the prediction


class Lookahead:
    """The prepared inputs of the next decode step, if it is the one predicted."""

    def __init__(self, block_size: int, device: torch.device, transfer: Transfer | None = None):
        self.block_size = block_size
        self.device = device
        self.staging = Staging(transfer or transfer_for(device))
        self._next: _Prepared | None = None
        self.prepared = 0  # steps prepared ahead
        self.taken = 0  # ... whose plan was the prediction (their inputs were not built again)
        self.planned = 0  # ... taken (or launched) with their attention planned ahead too
        # engine arg async_scheduling: the prepared step launched from the tokens still on the
        # device, before they are read back (`launch`), and its result kept until its plan
        self.inflight: _InFlight | None = None
        self.launched = 0  # steps launched ahead
        self.launched_taken = 0  # ... whose plan was the launched step or a part of it
        self.launched_part = 0  # ... a part of it (some of its requests had left)
        self.settled = 0  # waits for a launched step before its blocks could change hands (`settle`)

    def prepare(self, reqs: list, block_ids: Callable[[str], list[int]],
                plan: Callable[[StepBatch], object | None] | None = None, grown: Sequence = ()) -> None:
        """Build the inputs of a step of one token for each of ``reqs`` (decoding requests whose
        blocks already cover their next position; ``grown``: those the prediction gave a block),
        all but the token ids, and ``plan`` its attention (the runner's `plan_ahead`)."""
        b, bs = len(reqs), self.block_size
        context = [r.num_computed_tokens for r in reqs]
        tables = [block_ids(r.request_id) for r in reqs]
        block_tables = pad_block_tables(tables)
        ctx = np.asarray(context, dtype=np.int64)
        slot, host = self.staging.acquire(4 * b)
        host[:b] = ctx
        host[b:2 * b] = block_tables[np.arange(b), ctx // bs] * bs + ctx % bs
        host[2 * b:3 * b] = np.arange(b)
        flat = self.staging.upload(slot, 3 * b)
        layout = BatchLayout(query_start_loc=np.arange(b + 1, dtype=np.int64), context_lens=ctx,
                             block_tables=block_tables, slot_mapping=flat[b:2 * b], block_size=bs)
        batch = StepBatch(input_ids=flat[:0], positions=flat[:b], layout=layout,
                          logits_indices=flat[2 * b:3 * b], sampling=list(reqs))
        batch.meta = plan(batch) if plan is not None else None
        self._next = _Prepared(reqs, context, tables, batch, slot, host, list(grown))
        self.prepared += 1

    def release(self, kv) -> None:
        """Drop the prepared step and give back the blocks its prediction took ahead: called
        before a plan that admits someone (a prompt, a remote-KV reservation, a tier load), so
        that admission sees the pool it would without the prediction."""
        self.settle()  # (admission may give its blocks out)
        held = [p for p in (self._next, self.inflight.prepared if self.inflight is not None else None) if p]
        self._next = self.inflight = None  # (a step launched ahead is not that plan: dropped)
        for req in (r for p in held for r in p.grown):
            table = kv.tables.get(req.request_id)
            if table is not None and req.num_computed_tokens == req.num_tokens - 1:  # still where predicted
                kv.trim(req.request_id, req.num_computed_tokens)

    def take(self, scheduled: list, block_ids: Callable[[str], list[int]]) -> StepBatch | None:
        """The prepared batch when ``scheduled`` is the predicted step (its token ids filled in
        now), else None (the caller builds it)."""
        p, self._next = self._next, None
        if p is None or not matches(p, scheduled, block_ids):
            return None
        b = len(p.reqs)
        p.host[3 * b:] = [r.output_token_ids[-1] for r in p.reqs]
        p.batch.input_ids = self.staging.upload(p.slot, b, start=3 * b)
        self.taken += 1
        self.planned += p.batch.meta is not None
        return p.batch

    def drop(self) -> None:
        self._next = None
        self.inflight = None

    @property
    def has_prepared(self) -> bool:
        return self._next is not None

    def launch(self, rows_of: dict[int, int], tokens: torch.Tensor) -> _Prepared | None:
        """The prepared step, its token ids gathered on the device from ``tokens`` (this step's
        draw, not yet read back; ``rows_of``: a request's ``id`` -> its row there), ready to run
        now; None when there is none or one of its requests drew no row. The caller runs it and
        hands its logits to `launched`."""
        p = self._next
        if p is None or any(id(r) not in rows_of for r in p.reqs):
            return None
        self._next = None
        b = len(p.reqs)
        p.host[3 * b:] = [rows_of[id(r)] for r in p.reqs]
        rows = self.staging.upload(p.slot, b, start=3 * b)
        p.batch.input_ids = tokens.index_select(0, rows.to(tokens.device))
        return p

    def launched_step(self, p: _Prepared, logits: torch.Tensor | None) -> None:
        self.inflight = _InFlight(p, logits, self.staging.transfer.record(), {r.request_id for r in p.reqs})
        self.launched += 1
        self.planned += p.batch.meta is not None

    def discard(self) -> None:
        """Forget the step launched ahead once the device has run it: its inputs may not be
        what the step's tokens turned out to be (the sampler fell back to drawing row by row)."""
        self.settle()
        self.inflight = None

    def settle(self, request_id: str | None = None) -> None:
        """Wait until the step launched ahead has run on the device (``request_id``: only if
        that request is in it). Called before blocks it writes can change hands outside the
        stream's order (a request of it freed, a plan that admits someone): what the pool then
        gives out (to a remote write, a loan, a tier copy) is never written by that step after."""
        f = self.inflight
        if f is None or f.event is None or (request_id is not None and request_id not in f.ids):
            return
        f.event.synchronize()
        f.event = None
        self.settled += 1

    def take_inflight(self, scheduled: list, block_ids: Callable[[str], list[int]]) -> tuple | None:
        """(logits, batch) of the step launched ahead when ``scheduled`` is it, or it without
        some of its requests (those that finished or were aborted since: their rows are left
        out); else None, and the launched step's result is dropped (its writes were the KV of
        positions the plan computes again, or of requests that left)."""
        f, self.inflight = self.inflight, None
        if f is None:
            return None
        rows = subsequence_rows(f.prepared, scheduled, block_ids)
        if rows is None:
            return None
        self.launched_taken += 1
        batch = f.prepared.batch
        if len(rows) == len(f.prepared.reqs):
            return f.logits, batch
        self.launched_part += 1
        logits = None
        if f.logits is not None:  # (rank 0)
            logits = f.logits.index_select(0, torch.tensor(rows).to(f.logits.device, non_blocking=True))
        # the requests that sample are the plan's; the inputs stay those of the step that ran
        return logits, replace(batch, sampling=[r for r, _ in scheduled])


@dataclass
class _InFlight:
    prepared: _Prepared  # the step launched ahead
    logits: torch.Tensor | None  # its logits (rank 0), maybe still being computed on the device
    event: Event | None  # recorded behind it on the stream (None once waited for)
    ids: set[str]  # its requests' ids


def subsequence_rows(p: _Prepared, scheduled: list, block_ids: Callable[[str], list[int]]) -> list[int] | None:
    """The rows of the prepared step that ``scheduled`` runs, when it is that step or that step
    without some of its requests (same order, each one new token at the predicted position,
    the same blocks); None otherwise."""
    rows, j = [], 0
    for req, n in scheduled:
        while j < len(p.reqs) and p.reqs[j] is not req:
            j += 1
        if j == len(p.reqs):
            return None
        c = p.context[j]
        if (n != 1 or req.num_computed_tokens != c or req.num_tokens != c + 1 or not req.output_token_ids
                or not _same(block_ids(req.request_id), p.tables[j])):
            return None
        rows.append(j)
        j += 1
    return rows if rows else None


def _same(ids: list[int], table: list[int]) -> bool:
    return ids is table or ids == table  # (the block manager hands out one list until the table changes)


def matches(p: _Prepared, scheduled: list, block_ids: Callable[[str], list[int]]) -> bool:
    """Whether the plan is the prepared step: the same request objects in the same order, one
    new token each at the predicted position (its last output token's), the same blocks."""
    rows = subsequence_rows(p, scheduled, block_ids)
    return rows is not None and len(rows) == len(p.reqs)


def launch_next(runner, reqs: list, tokens: torch.Tensor) -> None:
    """engine arg async_scheduling: run the prepared next step now, its token ids gathered from
    ``tokens`` (this step's draw for ``reqs``, still on the device: on a GPU the forward is
    queued behind the draw and the host goes on to read the tokens and make the outputs while
    it runs). Never raises: a failure costs only the launch (logged)."""
    look = runner.lookahead
    if look is None or not look.has_prepared:
        return
    try:
        p = look.launch({id(r): i for i, r in enumerate(reqs)}, tokens)
        if p is not None:
            look.launched_step(p, runner.execute_batch(p.batch))
    except TPGroupBroken:
        raise  # (the engine cannot step again: as a step's own forward would say)
    except Exception:  # noqa: BLE001  (the next step runs as it would without the launch)
        log.exception("launching the next decode step ahead failed; it runs when it is planned")
        look.drop()


def predict_next(scheduled: list, running: list, waiting: int, failed: set[str], kv) -> tuple[list, list] | None:
    """The requests of the next step if it is a decode step like this one, given what this
    step scheduled (after its computed counts moved) and how many requests wait for admission
    (prompts, remote-KV reservations, tier loads); None when it cannot be predicted. The blocks
    the predicted requests cross into are allocated now, as the scheduler would (returned
    beside them), and only from blocks that hold no cached prefix: a prediction that does not
    come true must not have evicted one."""
    if waiting or len(scheduled) != len(running):
        return None
    reqs = []
    for req, n in scheduled:
        # (a decode token just computed, its sampled successor not yet appended)
        if n != 1 or not req.output_token_ids or req.num_computed_tokens != req.num_tokens:
            return None
        if req.request_id in failed or req.spec_token_ids:
            return None
        if len(req.output_token_ids) + 1 >= req.params.max_tokens:
            continue  # its token of this step is its last
        reqs.append(req)
    if not reqs:
        return None
    bs = kv.block_size
    need = [r for r in reqs if len(kv.tables.get(r.request_id, ())) * bs <= r.num_computed_tokens]
    if need and kv.pool.num_free - len(need) < len(running):
        return None  # a tight pool: the scheduler decides who gets the blocks
    if any(b.block_hash is not None for b in kv.pool.free.first(len(need))):
        return None  # (the scheduler evicts it when the step comes true)
    for r in need:
        if not kv.allocate(r.request_id, r.num_computed_tokens + 1):
            return None
    return reqs, need
