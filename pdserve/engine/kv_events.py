"""The pool's prefix-cache changes as KV events (common/kv_events.py), numbered in batches.

`KVEventLog` is fed by the block pool on the engine thread (a full block registered under
its hash: stored; a cached block taken for other KV: removed) and drained by a publisher on
its own thread (cluster/kvindex/publisher.py): `take_batch` hands out everything recorded since the
last call as one batch with the next sequence number. Recording is a list append under a
lock; nothing here waits for a subscriber.

Bounded: when more than ``max_pending`` events wait (the publisher is starved), they are
dropped and a sequence number is skipped; the next batch goes out even if empty, so every
subscriber sees the gap at once and resyncs from `snapshot`, which is consistent with the
sequence numbers: a snapshot at ``seq`` holds exactly the blocks that the batches up to
``seq`` leave cached.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from pdserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

if TYPE_CHECKING:
    from .lora_request import LoRARequest

DEFAULT_MAX_PENDING = 100_000
# What a stored block's event says of it besides its hash: parent hash, tokens, and the LoRA
# adapter that computed it (vLLM's lora_id and lora_name; None: the base model).
Live = tuple[bytes | None, tuple[int, ...], int | None, str | None]


class KVEventLog:
    def __init__(self, block_size: int, medium: str, max_pending: int = DEFAULT_MAX_PENDING):
        self.block_size, self.medium, self.max_pending = block_size, medium, max_pending
        self._lock = threading.Lock()
        self._pending: list[KVEvent] = []
        # Every cached block now, per tier: (hash, medium) -> (parent hash, its tokens), in the
        # order they were stored. ``medium``: the pool's; a second tier (engine/kv_tier.py) names its own.
        self._live: dict[tuple[bytes, str], Live] = {}
        self._seq = -1  # the last sequence number handed out (or skipped)
        self._announce_gap = False  # a number was skipped: the next batch goes out even if empty
        self.batches = 0
        self.dropped_events = 0
        self.gaps = 0

    # -- the engine thread ---------------------------------------------------------------
    def stored(self, block_hash: bytes, parent: bytes | None, token_ids, medium: str | None = None,
               lora: LoRARequest | None = None) -> None:
        tokens, medium = tuple(token_ids), medium or self.medium
        lid, lname = (None, None) if lora is None else (lora.lora_int_id, lora.lora_name)
        with self._lock:
            self._live[(block_hash, medium)] = (parent, tokens, lid, lname)
            self._record(BlockStored((block_hash,), parent, tokens, self.block_size, medium, lid, lname))

    def removed(self, block_hash: bytes, medium: str | None = None) -> None:
        medium = medium or self.medium
        with self._lock:
            self._live.pop((block_hash, medium), None)
            self._record(BlockRemoved((block_hash,), medium))

    def cleared(self) -> None:
        with self._lock:
            self._live.clear()
            self._record(AllBlocksCleared())

    def _record(self, event: KVEvent) -> None:
        self._pending.append(event)
        if len(self._pending) > self.max_pending:
            self.dropped_events += len(self._pending)
            self._pending = []
            self._seq += 1  # a number no batch carries: subscribers see the gap and resync
            self.gaps += 1
            self._announce_gap = True

    # -- the publisher's thread ------------------------------------------------------------
    def take_batch(self) -> tuple[int, KVEventBatch] | None:
        """Everything recorded since the last call, as (seq, batch); None when nothing was."""
        with self._lock:
            return self._take()

    def _take(self) -> tuple[int, KVEventBatch] | None:
        if not self._pending and not self._announce_gap:
            return None
        events, self._pending, self._announce_gap = _coalesce(self._pending), [], False
        self._seq += 1
        self.batches += 1
        return self._seq, KVEventBatch(time.time(), tuple(events))

    def snapshot(self) -> tuple[tuple[int, KVEventBatch] | None, int, KVEventBatch]:
        """(the batch of events still pending, or None: publish it first; the sequence number
        the snapshot is at; the snapshot: AllBlocksCleared, then every cached block's
        BlockStored)."""
        with self._lock:
            flushed = self._take()
            events: list[KVEvent] = [AllBlocksCleared()]  # then the blocks in the order they were stored
            events += [BlockStored((h,), parent, tokens, self.block_size, medium, lid, lname)
                       for (h, medium), (parent, tokens, lid, lname) in self._live.items()]
            return flushed, self._seq, KVEventBatch(time.time(), tuple(_coalesce(events)))

    def cached_hashes(self, medium: str | None = None) -> set[bytes]:
        """The blocks held now in ``medium`` (default: the pool's)."""
        medium = medium or self.medium
        with self._lock:
            return {h for h, m in self._live if m == medium}


def _coalesce(events: list[KVEvent]) -> list[KVEvent]:
    """Consecutive stores of one chain (each block's parent the previous one's hash) as one
    BlockStored, as vLLM sends a request's new blocks; consecutive removes as one."""
    out: list[KVEvent] = []
    for e in events:
        last = out[-1] if out else None
        if (isinstance(e, BlockStored) and isinstance(last, BlockStored) and e.medium == last.medium
                and e.lora_name == last.lora_name
                and e.parent_block_hash is not None and e.parent_block_hash == last.block_hashes[-1]):
            out[-1] = BlockStored(last.block_hashes + e.block_hashes, last.parent_block_hash,
                                  last.token_ids + e.token_ids, last.block_size, last.medium,
                                  last.lora_id, last.lora_name)
        elif isinstance(e, BlockRemoved) and isinstance(last, BlockRemoved) and e.medium == last.medium:
            out[-1] = BlockRemoved(last.block_hashes + e.block_hashes, last.medium)
        else:
            out.append(e)
    return out
