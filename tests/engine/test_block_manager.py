"""Block pool, LRU free queue, chained hashes, prefix lookup, reservations."""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockPool, FreeBlockQueue, KVCacheManager, Block, block_hashes


def test_free_queue_is_lru_with_o1_remove():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.append(blocks[2])
    assert [q.popleft().block_id for _ in range(5)] == [0, 1, 3, 4, 2]
    with pytest.raises(RuntimeError):
        q.popleft()


def test_hash_chain_depends_on_parent_and_salt():
    a = block_hashes(list(range(32)), 16)
    b = block_hashes([99] + list(range(1, 32)), 16)
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different parent
    assert block_hashes(list(range(32)), 16, salt=b"tenant")[0] != a[0]
    assert len(block_hashes(list(range(31)), 16)) == 1  # partial blocks are never hashed


def test_lookup_stops_at_first_miss():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(16))
    assert kv.allocate("a", 16)
    kv.cache_full_blocks("a", toks, 16)
    kv.pool.cached.pop(kv.hashes["a"][1])  # forget block 1 only
    hits, n = kv.computed_blocks("b", toks + [100])
    assert n == 4 and [b.block_id for b in hits] == kv.block_ids("a")[:1]


def test_refcount_shared_prefix_and_lazy_eviction():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    toks = list(range(9))
    assert kv.allocate("a", 9)
    kv.cache_full_blocks("a", toks, 9)
    hits, n = kv.computed_blocks("b", toks)
    assert n == 8
    assert kv.allocate("b", 9, hits)
    assert [b.ref_cnt for b in hits] == [2, 2]
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 4
    assert len(kv.pool.cached) == 2  # still cached while free
    assert kv.allocate("c", 16)  # needs all four: evicts the cached ones lazily
    assert kv.pool.cached == {}
    kv.free("c")


def test_freed_tail_blocks_are_evicted_first():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    assert kv.allocate("a", 6)
    kv.cache_full_blocks("a", [1, 2, 3, 4, 5, 6], 6)
    ids = kv.block_ids("a")
    kv.free("a")
    assert kv.allocate("b", 2)
    assert kv.block_ids("b") == [ids[2]]  # the last block of "a" goes first
    hits, n = kv.computed_blocks("c", [1, 2, 3, 4, 9])
    assert n == 4  # the prefix blocks survived


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.allocate("a", 8)
    assert not kv.allocate("b", 1)
    assert "b" not in kv.tables and kv.num_free_blocks == 0


def test_reserve_and_release_remote():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    toks = list(range(12))
    assert kv.allocate("a", 12)
    kv.cache_full_blocks("a", toks, 12)
    kv.free("a")
    cached_len, targets = kv.reserve_remote("r", toks[:8] + [50, 51, 52, 53, 54])
    assert cached_len == 8 and len(targets) == 2
    assert set(targets).isdisjoint(kv.block_ids("r")[:2])
    with pytest.raises(ValueError):
        kv.reserve_remote("r", toks)
    kv.release_reservation("r")
    assert kv.num_free_blocks == 10 and kv.tables == {}
    assert kv.reserve_remote("big", list(range(100))) is None
    assert kv.tables == {} and kv.num_free_blocks == 10


def test_release_more_than_taken_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError):
        pool.release([b])


def test_block_ids_follow_every_change_of_the_table_and_are_made_once_per_table():
    """block_ids hands out one list per table (a step reads a request's ids several times) and
    a new one after each change: growth, trim, free, rename, a table set from outside."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 5)
    first = kv.block_ids("a")
    assert len(first) == 2 and kv.block_ids("a") is first
    assert kv.allocate("a", 8) and kv.block_ids("a") is first  # (still two blocks: no change)
    assert kv.allocate("a", 9)
    grown = kv.block_ids("a")
    assert grown[:2] == first and len(grown) == 3 and len(first) == 2
    kv.trim("a", 4)
    assert kv.block_ids("a") == first[:1]
    kv.rename("a", "b")
    assert kv.block_ids("a") == [] and kv.block_ids("b") == first[:1]
    kv.tables["b"] = kv.tables["b"] + [kv.pool.allocate(1)[0]]  # (as the KV connector's quarantine sets one)
    assert len(kv.block_ids("b")) == 2
    kv.free("b")
    assert kv.block_ids("b") == [] and kv.pool.num_free == 8
