"""KV block pool, prefix cache and per-request block tables.

A block is free when no request references it (``ref_cnt == 0``). Free
blocks sit in an LRU queue; a free block that still holds a cached prefix
keeps its hash until it is reused (lazy eviction), so a later request with
the same prefix can take it back. Hashes chain over full blocks:
``hash(parent_hash, token_ids, salt)``, so a hit on block i implies hits on
blocks 0..i-1 and the lookup stops at the first miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, cast

from pdserve.common.block_hash import block_hashes, hash_block  # noqa: F401  (the engine's names for them)

if TYPE_CHECKING:
    from .kv_events import KVEventLog
    from .lora_request import LoRARequest
    from .kv_tier_types import SecondTier


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # While cached: the previous block's hash and this block's tokens (its KV events say them).
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    # Bumped each time the block is taken for new KV: a copy of it started before then is stale
    # (engine/kv_tier.py).
    generation: int = 0
    prev: "Block | None" = None
    next: "Block | None" = None


class FreeBlockQueue:
    """Doubly linked LRU list of free blocks: O(1) append, popleft and remove."""

    def __init__(self, blocks: list[Block]):
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    # Every block in the list has both links (the sentinels ``head`` and ``tail`` bound it):
    # the casts below say so to the checker.
    def append(self, b: Block) -> None:
        last = cast(Block, self.tail.prev)
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.size += 1

    def remove(self, b: Block) -> None:
        prev, nxt = cast(Block, b.prev), cast(Block, b.next)
        prev.next, nxt.prev = nxt, prev
        b.prev = b.next = None
        self.size -= 1

    def first(self, n: int) -> Iterator[Block]:
        """The next ``n`` blocks `popleft` would return, without taking them."""
        b = cast(Block, self.head.next)
        while n > 0 and b is not self.tail:
            yield b
            b = cast(Block, b.next)
            n -= 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise RuntimeError("no free KV blocks")
        b = cast(Block, self.head.next)
        self.remove(b)
        return b


class BlockPool:
    """All KV blocks of the pool plus the prefix-cache index over them."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, events: "KVEventLog | None" = None,
                 tier: "SecondTier | None" = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.enable_caching = enable_caching
        self.events = events  # engine/kv_events.py: what the prefix cache gains and loses
        self.tier = tier  # engine/kv_tier.py: told of each cached block before it is evicted

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks obtainable now: truly free plus evictable cached ones."""
        return self.free.size

    def lookup(self, hashes: list[bytes]) -> list[Block]:
        """Cached blocks for the longest prefix of ``hashes`` (stops at the first miss)."""
        hits: list[Block] = []
        if not self.enable_caching:
            return hits
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cache hits, pulling free ones out of the LRU queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free.remove(b)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        if n > self.free.size:
            raise RuntimeError(f"need {n} KV blocks, {self.free.size} free")
        out = []
        for _ in range(n):
            b = self.free.popleft()
            if b.block_hash is not None:  # lazy eviction of a cached prefix block
                if self.cached.get(b.block_hash) is b:
                    if self.tier is not None:
                        self.tier.evicting(b)
                    del self.cached[b.block_hash]
                    if self.events is not None:
                        self.events.removed(b.block_hash)
                b.block_hash, b.parent_hash, b.token_ids = None, None, ()
            b.generation += 1
            b.ref_cnt = 1
            out.append(b)
        return out

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference per block; blocks reaching zero join the LRU tail.

        Callers pass a request's blocks in reverse order so that its tail
        blocks (least likely to be shared) are evicted first.
        """
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt < 0:
                raise RuntimeError(f"block {b.block_id} released more often than taken")
            if b.ref_cnt == 0:
                self.free.append(b)

    def cache(self, block: Block, block_hash: bytes, parent: bytes | None = None, token_ids=(),
              lora: LoRARequest | None = None) -> None:
        """Register a full block whose KV has been written under its content hash (``parent``:
        the previous block's hash, ``token_ids`` its tokens, ``lora`` the adapter that computed
        it: what its KV event says)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; keep the first
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, tuple(token_ids)
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent, block.token_ids, lora=lora)

    def num_cached_free(self) -> int:
        return sum(1 for b in self.cached.values() if b.ref_cnt == 0)


class KVCacheManager:
    """Per-request block tables over a `BlockPool`.

    Owns *where a request's KV lives*: prefix-cache hits, new blocks for the
    tokens scheduled this step, registration of newly full blocks, release,
    and reservations for KV that another worker will write.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: "KVEventLog | None" = None, tier: "SecondTier | None" = None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching, events, tier)
        self.tables: dict[str, list[Block]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already registered
        self.hashes: dict[str, list[bytes]] = {}
        # per request: (the table object, its block ids), what block_ids last returned; a table
        # is never changed in place (every change makes a new list), so the same object means
        # the same ids
        self._ids: dict[str, tuple[list[Block], list[int]]] = {}

    # -- lookup -----------------------------------------------------------
    def _hashes(self, req_id: str, token_ids: list[int], salt: bytes | None) -> list[bytes]:
        hs = block_hashes(token_ids, self.block_size, salt, self.hashes.get(req_id))
        self.hashes[req_id] = hs
        return hs

    def computed_blocks(self, req_id: str, token_ids: list[int], salt: bytes | None = None
                        ) -> tuple[list[Block], int]:
        """Cached prefix blocks for a new request and how many tokens they cover.

        At least the last token is always left to compute: its logits are
        needed to sample, so a fully cached prompt still recomputes its last block.
        """
        hs = self._hashes(req_id, token_ids, salt)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits = self.pool.lookup(hs[:max_blocks])
        return hits, len(hits) * self.block_size

    # -- allocation -------------------------------------------------------
    def allocate(self, req_id: str, num_total_tokens: int, new_hits: list[Block] | None = None
                 ) -> bool:
        """Ensure the request's table covers ``num_total_tokens`` tokens.

        ``new_hits`` are prefix-cache hits being adopted now (first schedule).
        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        table = self.tables.get(req_id, [])
        hits = new_hits or []
        need = -(-num_total_tokens // self.block_size) - len(table) - len(hits)
        # Hits that sit in the free queue stop being obtainable once touched.
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if max(need, 0) > self.pool.num_free - free_hits:
            return False
        if hits:
            self.pool.touch(hits)
            table = table + hits
            self.num_cached_blocks[req_id] = len(table)
        if need > 0:
            table = table + self.pool.allocate(need)
        self.tables[req_id] = table
        return True

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block ids, in order (not to be changed: the list is shared until the
        table changes; made again only then, not on each of the step's several reads)."""
        table = self.tables.get(req_id)
        if table is None:
            return []
        held = self._ids.get(req_id)
        if held is not None and held[0] is table:
            return held[1]
        ids = [b.block_id for b in table]
        self._ids[req_id] = (table, ids)
        return ids

    def cache_full_blocks(self, req_id: str, token_ids: list[int], num_computed: int,
                          salt: bytes | None = None, lora: LoRARequest | None = None) -> None:
        """Register blocks that became full and whose KV is now written (``salt`` folds in the
        request's adapter, engine/lora_request.py; ``lora`` names it in the KV events)."""
        if not self.pool.enable_caching:
            return
        table = self.tables.get(req_id)
        if not table:
            return
        n_full = min(num_computed // self.block_size, len(table))
        done = self.num_cached_blocks.get(req_id, 0)
        if n_full <= done:
            return
        hs = self._hashes(req_id, token_ids[: n_full * self.block_size], salt)
        bs = self.block_size
        for i in range(done, n_full):
            self.pool.cache(table[i], hs[i], hs[i - 1] if i else None, token_ids[i * bs:(i + 1) * bs], lora)
        self.num_cached_blocks[req_id] = n_full

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens (tail first): speculative
        positions that were rejected (engine/spec_step.py). Never full, so never cached."""
        table = self.tables.get(req_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return
        assert keep >= self.num_cached_blocks.get(req_id, 0)
        self.tables[req_id], tail = table[:keep], table[keep:]
        self.pool.release(list(reversed(tail)))

    def free(self, req_id: str) -> None:
        """Release every block of the request (tail first) and forget it."""
        table = self.tables.pop(req_id, [])
        self.pool.release(list(reversed(table)))
        self.num_cached_blocks.pop(req_id, None)
        self.hashes.pop(req_id, None)
        self._ids.pop(req_id, None)

    # -- remote KV ----------------------------------------------------------
    def reserve_remote(self, req_id: str, token_ids: list[int], salt: bytes | None = None
                       ) -> tuple[int, list[int]] | None:
        """Pin the cached prefix and reserve blocks for every remaining prompt position.

        Another worker will write the KV of positions ``[cached_len, n)`` into
        the returned block ids. Returns ``(cached_len, target_block_ids)``, where
        the targets are the blocks after the cached ones, or None if the pool
        cannot hold the prompt now.
        """
        if req_id in self.tables:
            raise ValueError(f"request {req_id!r} already holds blocks")
        hits, cached_len = self.computed_blocks(req_id, token_ids, salt)
        if not self.allocate(req_id, len(token_ids), hits):
            self.hashes.pop(req_id, None)
            return None
        return cached_len, self.block_ids(req_id)[len(hits):]

    def rename(self, req_id: str, new_id: str) -> None:
        """Move a request's blocks under another key (e.g. to quarantine a
        reservation that a late remote write may still hit)."""
        if new_id in self.tables:
            raise ValueError(f"{new_id!r} already holds blocks")
        self.tables[new_id] = self.tables.pop(req_id, [])
        self._ids.pop(req_id, None)
        self.num_cached_blocks[new_id] = self.num_cached_blocks.pop(req_id, 0)
        self.hashes.pop(req_id, None)

    def release_reservation(self, req_id: str) -> None:
        """Give back a reservation whose remote fill failed or was abandoned."""
        self.free(req_id)

    # -- accounting ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks
