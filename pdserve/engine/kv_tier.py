"""The second KV tier: prefix blocks kept past their eviction from the pool, loaded back on a hit.

`kv_offload_bytes` (engine/config.py) gives an engine a tier of ``kv_offload_bytes //
block bytes`` slots, each one full block of every layer (K and V); where they live and how
the bytes move is engine/kv_tier_store.py's, the values and the interface the scheduler and
the block pool see engine/kv_tier_types.py's. docs/kvindex.md has the measurements.

**Off the step, before eviction.** The pool evicts lazily: a free block keeps its prefix
until `BlockPool.allocate` takes it, and the step that took it writes new KV into it at
once. So the tier copies ahead: after each step, the engine offers the cached blocks at
the head of the pool's LRU free queue (the next to be evicted, `window` of them) to the
tier's copy thread, which copies them while the next steps run. A copy counts only if the
block was not taken in the meantime: `allocate` bumps a block's generation, and the copy
thread commits a slot only when the generation it was given is still the block's, checked
after the copy has completed (on a GPU: after its stream has synchronised). A block taken
before the check may already be rewritten, so that copy is dropped; a block taken after
it was rewritten only by a step issued after the check. The copy of a block a step is
still writing on a GPU waits for that step: the offer records a CUDA event on the
engine's stream, the copy stream waits on it.

**Loaded back, overlapped.** At admission the scheduler looks past the pool's prefix hit
into the tier (`leading`). If enough blocks follow there, it takes pool blocks for them,
pins their slots and hands the load to the copy thread (loads go before offloads); the
request waits in LOADING_KV while other requests' steps run. When the load is done the
blocks are registered in the pool's prefix cache under their hashes and the request is
admitted again, first in line: the prefix is a pool hit now. A load that fails leaves
those blocks unregistered (they are computed again); nothing is read from a slot whose
load was not finished.

**Tensor parallelism** (``mirror``): each rank holds its heads of every block, so each rank
keeps its own store of the same slots (`TierMirror`, in engine/tp_rank.py), and rank 0's
tier decides for all of them. There the copies are made on the engine thread, in the order
the pool takes and the scheduler loads blocks: a block is copied when the pool takes it
(`evicting`, before the step that rewrites it) and a load is copied when it starts; no copy
ahead, no copy thread, so no generation to check. Each copy is also queued for the other
ranks, which make the same copies, in the same order, before their next step's forward
(`TPGroup.attach`), or at once when block ids leave the engine (`flush`, a remote
reservation): no rank reads or rewrites a block or a slot before its copy.

Slots are an LRU: a new block evicts the least recently stored or loaded unpinned slot.
Every store and eviction is a KV event with the tier's medium (CPU for host memory,
STORAGE for a file), so the cluster's index sees the tier (docs/kvindex.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import torch

from .config import ConfigError
from .kv_tier_store import block_bytes, host_copy, load_to_device, make_store, resolve_backend
from .kv_tier_types import Mirror, MirrorOp, TierLoad, TierStats

if TYPE_CHECKING:
    from .block_manager import Block, BlockPool
    from .kv_events import KVEventLog

log = logging.getLogger(__name__)

WAIT_FOR_LOAD_S = 0.005  # an idle engine waits this long for a load to finish before stepping again

# An offer (block, its generation then, hash, parent hash, token ids, GPU: the engine's event).
_Offer = tuple["Block", int, bytes, "bytes | None", "tuple[int, ...]", "torch.cuda.Event | None"]


class KVTier:
    """The tier of one engine: its slots, its copy thread and the engine thread's calls.

    Engine thread: `offer_lru_head`, `leading`, `start_load`, `finished_loads`,
    `wait_for_load`. Copy thread: the copies, commits and slot evictions. One lock guards
    the slot table."""

    def __init__(self, pool: torch.Tensor, capacity_bytes: int, backend: str = "auto", path: str | None = None,
                 events: "KVEventLog | None" = None, window: int = 64, mirror: Mirror | None = None):
        self.block_bytes = block_bytes(pool)
        self.capacity = capacity_bytes // self.block_bytes
        if self.capacity < 1:
            raise ConfigError(f"kv_offload_bytes={capacity_bytes} holds no block: one block of this model is "
                              f"{self.block_bytes} bytes; raise it (or 0 for no tier)")
        backend = resolve_backend(backend, pool)
        self.store = make_store(backend, self.capacity, pool, path)
        # Tensor parallelism: called with each batch of copies the other ranks must repeat, as
        # (slots, [("store"|"load", block id, slot), ...], now); None at TP=1.
        self.mirror = mirror
        self._mirror_ops: list[MirrorOp] = []
        self.medium = self.store.medium
        self.backend = backend
        self.pool, self.events, self.window = pool, events, window
        self.stats = TierStats()
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # committed: hash -> slot, least recent first
        self._meta: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}
        self._pins: dict[int, int] = {}
        self._ready: dict[int, torch.cuda.Event] = {}  # GPU: slot -> event of a copy queued on the engine's stream
        self._last_copy: torch.cuda.Event | None = None  # GPU: the latest such copy not yet waited for (`flush`)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._in_flight: set[bytes] = set()  # offered, not yet committed or dropped
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._loads: deque[TierLoad] = deque()
        self._offers: deque[_Offer] = deque()
        self._done: list[TierLoad] = []
        self._load_done = threading.Event()
        self._closed = False
        # Mirrored (TP): the copies run on the engine's own stream, in its order.
        self._stream = torch.cuda.Stream(pool.device) if pool.is_cuda and mirror is None else None
        # Load bandwidth, measured (bytes/s); None until the first load.
        self.load_bytes_per_s: float | None = None
        self._thread: threading.Thread | None = None
        if mirror is None:
            self._thread = threading.Thread(target=self._run, name="kv-tier", daemon=True)
            self._thread.start()
        log.info("second KV tier: %d blocks of %d bytes in %s (%s)", self.capacity, self.block_bytes,
                 backend, getattr(self.store, "path", "host memory"))

    def close(self) -> None:
        with self._work:
            self._closed = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.store.close()

    def flush(self, now: bool = True) -> None:
        """Hand the copies the other ranks have still to make to ``mirror`` (TP only): with the
        next step (``now=False``), or before block ids leave the engine (``now=True``: another
        worker may read or write those blocks at once, with NIXL, which does not wait for a
        CUDA stream; so on a GPU the copies queued on the engine's stream, a block's copy at
        eviction or a mirrored load, have landed when this returns, on every rank)."""
        handed = False
        if self.mirror is not None and self._mirror_ops:
            ops, self._mirror_ops = self._mirror_ops, []
            self.mirror(self.capacity, ops, now)
            handed = True
        if now and self.pool.is_cuda:
            with self._lock:
                last, self._last_copy = self._last_copy, None
            if handed:  # (a mirrored load has no event of its own)
                torch.cuda.current_stream(self.pool.device).synchronize()
            elif last is not None:  # the latest copy at eviction: the earlier ones are ahead of it
                last.synchronize()

    def chain_meta(self, block_hash: bytes) -> tuple[bytes | None, tuple[int, ...]] | None:
        """(parent hash, token ids) of a block the tier holds; None if it holds none."""
        with self._lock:
            return self._meta.get(block_hash) if block_hash in self._slots else None

    # -- the engine thread -----------------------------------------------------------------
    def offer_lru_head(self, pool: "BlockPool") -> int:
        """Offer the cached blocks among the next `window` the pool will evict for a copy;
        returns how many were new to the tier. Mirrored (TP), none: each rank copies a block
        when the pool takes it (`evicting`)."""
        if self.mirror is not None:
            return 0
        candidates = []
        for b in pool.free.first(self.window):
            if b.block_hash is not None:
                candidates.append(b)
        if not candidates:
            return 0
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record()  # after every write the engine issued so far
        n = 0
        with self._work:
            for b in candidates:
                h = b.block_hash
                if h is None or h in self._slots or h in self._in_flight:  # (candidates have a hash)
                    continue
                self._in_flight.add(h)
                self._offers.append((b, b.generation, h, b.parent_hash, b.token_ids, event))
                n += 1
            if n:
                self.stats.offered += n
                self._work.notify()
        return n

    def evicting(self, block: "Block") -> None:
        """The pool is taking cached ``block`` for other KV now (`BlockPool.allocate`, before
        the step that rewrites it): if the tier has no copy yet, copy it here, on the engine
        thread (on a GPU: queued on the engine's stream ahead of that step, so the host does
        not wait). The fallback for blocks the copy thread had not reached: freed and taken
        again within a step or two. Counted as ``sync_copies``."""
        h = block.block_hash
        if h is None:  # not a cached block (the pool tells of cached ones only): nothing to keep
            return
        with self._lock:
            if h in self._slots:
                return
            slot = self._take_slot()
            if slot is None:
                self.stats.dropped += 1
                return
            dst = self.store.view()[slot]
            if self.pool.is_cuda:  # on the engine's stream
                dst.copy_(self.pool[:, block.block_id], non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
                self._ready[slot] = ready  # a load of this slot waits for it
                self._last_copy = ready
            else:
                dst.copy_(self.pool[:, block.block_id])
            if self.mirror is not None:
                self._mirror_ops.append(("store", block.block_id, slot))
            self._slots[h] = slot  # an offer of this block still in flight now drops itself
            self._meta[h] = (block.parent_hash, block.token_ids)
            self.stats.stored += 1
            self.stats.sync_copies += 1
            if self.events is not None:
                self.events.stored(h, block.parent_hash, block.token_ids, medium=self.medium)

    def leading(self, hashes: list[bytes]) -> int:
        """How many leading hashes of ``hashes`` the tier holds now."""
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._slots:
                    break
                n += 1
        return n

    def worth_loading(self, blocks: int, compute_s_per_token: float | None, block_size: int) -> bool:
        """Loading ``blocks`` beats computing their tokens? Without a measured load or a step
        cost, yes (a copy of a block's KV is far cheaper than the forward pass that made it)."""
        if compute_s_per_token is None or self.load_bytes_per_s is None:
            return True
        if blocks * self.block_bytes / self.load_bytes_per_s < blocks * block_size * compute_s_per_token:
            return True
        self.stats.skipped_by_cost += 1
        return False

    def start_load(self, request_id: str, hashes: list[bytes], blocks: list["Block"], held: list["Block"]
                   ) -> TierLoad | None:
        """Load the tier's blocks for ``hashes`` into pool ``blocks`` (taken by the caller,
        len equal), in the copy thread; None if the tier no longer holds the first of them
        (the caller then gives the blocks back). Loads fewer when a later hash has gone: the
        returned load's `blocks` are the ones written; the caller gives back the rest."""
        with self._work:
            slots: list[int] = []
            for h in hashes:
                slot = self._slots.get(h)
                if slot is None:
                    break
                slots.append(slot)
            if not slots:
                return None
            for h, slot in zip(hashes, slots):
                self._pins[slot] = self._pins.get(slot, 0) + 1
                self._slots.move_to_end(h)  # loaded: recently used
            n = len(slots)
            meta = [self._meta[h] for h in hashes[:n]]
            load = TierLoad(request_id, list(hashes[:n]), [m[0] for m in meta], [m[1] for m in meta],
                            list(blocks[:n]), held, slots)
            if self._stream is not None:  # the load writes after whatever the engine issued into those blocks
                load.after = after = torch.cuda.Event()
                after.record()
            if self.mirror is not None:  # here, in the engine's order (and stream); the ranks the same
                self._mirror_ops += [("load", b.block_id, slot) for b, slot in zip(load.blocks, slots)]
            else:
                self._loads.append(load)
                self._work.notify()
        if self.mirror is not None:
            self._load(load)
        return load

    def finished_loads(self) -> list[TierLoad]:
        with self._lock:
            done, self._done = self._done, []
            self._load_done.clear()
        return done

    def wait_for_load(self, timeout_s: float = WAIT_FOR_LOAD_S) -> None:
        """Block until a load finishes or ``timeout_s`` passes (an engine with nothing else to run)."""
        self._load_done.wait(timeout_s)

    def snapshot(self) -> dict:
        with self._lock:
            return {"medium": self.medium, "backend": self.backend, "capacity_blocks": self.capacity,
                    "block_bytes": self.block_bytes, "blocks": len(self._slots), "pinned": sum(
                        1 for v in self._pins.values() if v), "in_flight": len(self._in_flight),
                    "load_bytes_per_s": self.load_bytes_per_s, **self.stats.__dict__}

    # -- the copy thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._work:
                while not (self._loads or self._offers or self._closed):
                    self._work.wait()
                if self._closed:
                    return
                job: TierLoad | _Offer = self._loads.popleft() if self._loads else self._offers.popleft()
            try:
                if isinstance(job, TierLoad):
                    self._load(job)
                else:
                    self._offload(*job)
            except Exception:  # noqa: BLE001  (the thread must live; the op is accounted as failed)
                log.exception("second KV tier: a copy failed")

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _offload(self, block: "Block", generation: int, h: bytes, parent: bytes | None, tokens: tuple[int, ...],
                 event: "torch.cuda.Event | None") -> None:
        with self._lock:
            slot = self._take_slot()
        if slot is None:  # every slot pinned by loads
            with self._lock:
                self._in_flight.discard(h)
                self.stats.dropped += 1
            return
        data = self.store.view()
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(event)
                    data[slot].copy_(self.pool[:, block.block_id], non_blocking=True)
            else:
                host_copy(data[slot], self.pool[:, block.block_id])
            self._sync()
        except BaseException:
            with self._lock:
                self._free.append(slot)
                self._in_flight.discard(h)
            raise
        with self._lock:
            self._in_flight.discard(h)
            if block.generation != generation or h in self._slots:
                # Taken for other KV before the copy was known complete (or stored meanwhile).
                self._free.append(slot)
                self.stats.dropped += 1
                return
            self._slots[h] = slot
            self._meta[h] = (parent, tokens)
            self.stats.stored += 1
            if self.events is not None:
                self.events.stored(h, parent, tokens, medium=self.medium)

    def _take_slot(self) -> int | None:
        """A free slot, or the least recently used unpinned one (its block leaves the tier)."""
        if self._free:
            return self._free.pop()
        for h, slot in self._slots.items():
            if not self._pins.get(slot):
                ready = self._ready.pop(slot, None)
                if ready is not None:  # its copy at eviction must land before the slot is rewritten
                    ready.synchronize()
                del self._slots[h]
                self._meta.pop(h, None)
                self.stats.evicted += 1
                if self.events is not None:
                    self.events.removed(h, medium=self.medium)
                return slot
        return None

    def _load(self, load: TierLoad) -> None:
        t0 = time.perf_counter()
        try:
            with self._lock:
                waits = [self._ready.pop(slot) for slot in load.slots if slot in self._ready]
            for ready in waits:  # a copy queued at eviction on the engine's stream: landed first
                ready.synchronize()
            data = self.store.view()
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(load.after)
                    load_to_device(self.pool, data, load.slots, [b.block_id for b in load.blocks], self.block_bytes)
            elif self.pool.is_cuda:  # mirrored: on the engine's stream, ahead of the steps that read it
                load_to_device(self.pool, data, load.slots, [b.block_id for b in load.blocks], self.block_bytes)
            else:
                for slot, block in zip(load.slots, load.blocks):
                    host_copy(self.pool[:, block.block_id], data[slot])
            self._sync()
        except Exception as exc:  # noqa: BLE001  (reported with the load; the blocks are computed again)
            load.error = f"{exc.__class__.__name__}: {exc}"
        load.seconds = time.perf_counter() - t0
        with self._lock:
            for slot in load.slots:
                self._pins[slot] -= 1
                if not self._pins[slot]:
                    del self._pins[slot]
            if load.error is None:
                self.stats.loads += 1
                self.stats.loaded_blocks += len(load.blocks)
                self.stats.load_seconds += load.seconds
                rate = len(load.blocks) * self.block_bytes / max(load.seconds, 1e-9)
                self.load_bytes_per_s = rate if self.load_bytes_per_s is None else (
                    0.8 * self.load_bytes_per_s + 0.2 * rate)
            else:
                self.stats.load_failures += 1
            load.finished = True
            self._done.append(load)
            self._load_done.set()

