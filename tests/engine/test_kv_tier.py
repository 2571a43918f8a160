"""The second KV tier (engine/kv_tier.py): evicted prefix blocks come back token-exact.

Real engines on the test model, the file tier (a CPU engine's), a pool small enough that
prompts evict each other's prefixes. Outputs are compared with an engine without prefix
caching (itself equal to HF transformers: test_hf_parity.py)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.common.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from pdserve.engine.block_manager import BlockPool
from pdserve.engine.config import ConfigError
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.kv_tier import KVTier
from pdserve.engine.kv_tier_store import TierMirror, host_copy
from pdserve.engine.offline import LLM
from pdserve.engine.request import SamplingParams

from .markers import needs_shm

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def prompt(rng, n):
    return [rng.randrange(5, 500) for _ in range(n)]


def settle(tier, timeout_s=10.0):
    """Wait until the copy thread has nothing in flight."""
    deadline = time.monotonic() + timeout_s
    while tier.snapshot()["in_flight"]:
        assert time.monotonic() < deadline, "the tier's copy thread never caught up"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, enable_prefix_caching=False)
    yield lambda prompts: [o.token_ids for o in llm.generate(prompts, GREEDY)]
    llm.close()


def test_a_prefix_evicted_from_the_pool_is_loaded_back_from_the_tier_token_exact(llama_dir, reference, tmp_path):
    rng = random.Random(0)
    a, b = prompt(rng, 200), prompt(rng, 200)
    llm = LLM(llama_dir, num_gpu_blocks_override=16, max_model_len=240, kv_offload_bytes=1 << 22,
              kv_offload_path=str(tmp_path), kv_events=True)
    try:
        outs = [llm.generate([p], GREEDY)[0] for p in (a, b, a)]
        assert [o.token_ids for o in outs] == reference([a, b, a])
        eng = llm.engine
        tier = eng.tier.snapshot()
        assert tier["medium"] == MEDIUM_STORAGE and tier["backend"] == "file"
        # b evicted a's last ten blocks; a's second run found 3 in the pool, 9 in the tier (its
        # 13th block holds the last prompt token, always computed).
        assert outs[2].num_cached_tokens == 12 * 16, outs[2].num_cached_tokens
        assert tier["loads"] == 1 and tier["loaded_blocks"] == 9 and tier["load_failures"] == 0, tier
        assert eng.scheduler.tier_loaded_tokens == 9 * 16
        assert eng.kv.pool.num_free == eng.kv.pool.num_blocks and tier["pinned"] == 0  # nothing leaked
        assert not list(tmp_path.iterdir())  # the tier's file was unlinked once mapped
    finally:
        llm.close()


def test_a_random_shared_prefix_workload_is_token_exact_and_leaks_nothing(llama_dir, reference):
    rng = random.Random(7)
    systems = [prompt(rng, 16 * rng.randrange(3, 8)) for _ in range(4)]
    prompts = [rng.choice(systems) + prompt(rng, rng.randrange(1, 40)) for _ in range(24)]
    llm = LLM(llama_dir, num_gpu_blocks_override=20, max_model_len=300, kv_offload_bytes=40 * 12288,
              kv_events=True, max_num_seqs=3)
    try:
        got = []
        for i in range(0, len(prompts), 3):  # a few at a time: the pool turns over between batches
            got += [o.token_ids for o in llm.generate(prompts[i:i + 3], GREEDY)]
        assert got == reference(prompts)
        eng = llm.engine
        settle(eng.tier)
        snap = eng.tier.snapshot()
        assert snap["loaded_blocks"] > 0 and snap["evicted"] > 0, snap  # the tier both served and turned over
        assert eng.kv.pool.num_free == eng.kv.pool.num_blocks and snap["pinned"] == 0
        assert not eng.scheduler.loading
        # The events say exactly what each tier holds.
        assert eng.kv_events.cached_hashes(MEDIUM_STORAGE) == set(eng.tier._slots)
        assert eng.kv_events.cached_hashes(MEDIUM_CPU) == set(eng.kv.pool.cached)
    finally:
        llm.close()


def test_a_request_aborted_while_its_prefix_loads_frees_every_block(llama_dir, tmp_path):
    rng = random.Random(3)
    a, b = prompt(rng, 200), prompt(rng, 200)
    llm = LLM(llama_dir, num_gpu_blocks_override=16, max_model_len=240, kv_offload_bytes=1 << 22)
    try:
        llm.generate([a], GREEDY)
        llm.generate([b], GREEDY)
        eng = llm.engine
        req = eng.add_request(a, GREEDY)
        eng.step()  # admission starts the load; the request waits for it
        assert req.request_id in eng.scheduler.loading
        assert eng.abort_request(req.request_id)
        deadline = time.monotonic() + 10
        while eng.tier.snapshot()["loads"] + eng.tier.snapshot()["load_failures"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        eng.step()  # the finished load is given back
        assert not eng.scheduler.loading and not eng.has_work()
        assert eng.kv.pool.num_free == eng.kv.pool.num_blocks and eng.tier.snapshot()["pinned"] == 0
    finally:
        llm.close()


def pool_and_tier(tmp_path, blocks=4, slots=2, events=None):
    pool_t = torch.zeros(2, blocks, 2, 16, 2, 8)  # [layers, blocks, K/V, block_size, heads, dim]
    per_block = 2 * 2 * 16 * 2 * 8 * 4
    pool = BlockPool(blocks, events=events)
    tier = KVTier(pool_t, slots * per_block, "file", str(tmp_path), events, window=blocks)
    pool.tier = tier
    return pool_t, pool, tier


def cache_block(pool, pool_t, i, value):
    [blk] = pool.allocate(1)
    pool_t[:, blk.block_id] = value
    pool.cache(blk, bytes([i]) * 32, None, [i] * 16)
    pool.release([blk])
    return blk


def test_a_copy_of_a_block_taken_before_the_copy_was_checked_is_dropped(tmp_path):
    pool_t, pool, tier = pool_and_tier(tmp_path, blocks=1)
    try:
        blk = cache_block(pool, pool_t, 1, 1.0)
        with tier._lock:  # the copy thread cannot start the copy before the block is taken
            assert tier.offer_lru_head(pool) == 1
            pool.tier = None  # (the eviction-time copy is the other path; off for this case)
            [taken] = pool.allocate(1)
            assert taken is blk
            pool_t[:, blk.block_id] = 2.0  # the step that took it writes other KV
        settle(tier)
        snap = tier.snapshot()
        assert snap["dropped"] == 1 and snap["stored"] == 0 and tier.leading([bytes([1]) * 32]) == 0
    finally:
        tier.close()


def test_an_offered_block_is_stored_and_one_evicted_unoffered_is_copied_at_eviction(tmp_path):
    log = KVEventLog(16, MEDIUM_CPU)
    pool_t, pool, tier = pool_and_tier(tmp_path, blocks=2, slots=2, events=log)
    try:
        cache_block(pool, pool_t, 1, 1.0)
        tier.offer_lru_head(pool)
        settle(tier)
        assert tier.snapshot()["stored"] == 1
        assert torch.equal(tier.store.view()[tier._slots[bytes([1]) * 32]], pool_t[:, 0])
        cache_block(pool, pool_t, 2, 3.0)  # takes the other (never used) block
        # Both blocks are taken now: block 1's hash is evicted, its copy already in the tier;
        # block 2 was never offered, so it is copied at eviction.
        pool.allocate(2)
        snap = tier.snapshot()
        assert snap["sync_copies"] == 1 and snap["blocks"] == 2
        assert torch.equal(tier.store.view()[tier._slots[bytes([2]) * 32]], torch.full_like(pool_t[:, 0], 3.0))
        # A third block evicts the least recent slot, and the events say so with the tier's medium.
        pool.release(pool.blocks)
        pool_t[:, 0] = 4.0
        pool.cache(pool.blocks[0], bytes([3]) * 32, None, [3] * 16)
        pool.allocate(2)
        flushed, _, snapshot = log.snapshot()
        stored = {(e.block_hashes, e.medium) for e in snapshot.events if isinstance(e, BlockStored)}
        assert stored == {((bytes([2]) * 32,), MEDIUM_STORAGE), ((bytes([3]) * 32,), MEDIUM_STORAGE)}
        removed = [e for e in flushed[1].events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE]
        assert [e.block_hashes for e in removed] == [(bytes([1]) * 32,)]
    finally:
        tier.close()


def test_tier_settings_that_cannot_work_are_refused_naming_the_setting(llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="kv_offload_bytes=100 holds no block"):
        LLM(llama_dir, kv_offload_bytes=100)
    with pytest.raises(ConfigError, match="kv_offload_backend='memory' on a CPU engine"):
        LLM(llama_dir, kv_offload_bytes=1 << 20, kv_offload_backend="memory")
    with pytest.raises(ConfigError, match="kv_offload_path=.* is not a directory"):
        LLM(llama_dir, kv_offload_bytes=1 << 20, kv_offload_path=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        LLM(llama_dir, kv_offload_bytes=1 << 20, enable_prefix_caching=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_copy_moves_a_strided_block_exactly_in_every_pool_dtype(dtype):
    # The copy thread's copies go through numpy (no OpenMP team on that thread): a block is a
    # strided slice of the pool ([layers, blocks, ...]), bfloat16 has no numpy dtype.
    pool = torch.randn(3, 5, 2, 16, 4, 8).to(dtype)
    slot = torch.zeros(3, 2, 16, 4, 8, dtype=dtype)
    host_copy(slot, pool[:, 2])
    assert torch.equal(slot, pool[:, 2])
    host_copy(pool[:, 4], slot)
    assert torch.equal(pool[:, 4], pool[:, 2])
    assert not torch.equal(pool[:, 3], pool[:, 2])  # its neighbours untouched


def test_a_device_load_moves_runs_of_slots_through_staging_chunks_into_the_right_blocks(tmp_path, monkeypatch):
    """The GPU load's copy plan (`load_to_device`: runs of consecutive slots, staging chunks,
    one scatter per chunk) run on the host, where its indexing can be checked against the
    slots block by block; test_kv_tier_gpu.py runs it on a device."""
    import pdserve.engine.kv_tier_store as kv_tier_store

    pool_t = torch.zeros(2, 12, 2, 16, 2, 8)
    per_block = 2 * 2 * 16 * 2 * 8 * 4
    tier = KVTier(pool_t, 8 * per_block, "file", str(tmp_path), None, window=4)
    try:
        data = tier.store.view()
        for s in range(8):
            data[s] = float(s + 1)
        monkeypatch.setattr(kv_tier_store, "STAGING_BYTES", 3 * per_block)  # chunks of 3 blocks cut the runs
        pool = BlockPool(12)
        blocks = pool.allocate(7)
        slots = [0, 1, 2, 3, 6, 5, 7]  # runs [0..3], [6], [5], [7]
        kv_tier_store.load_to_device(pool_t, data, slots, [b.block_id for b in blocks], tier.block_bytes)
        for slot, blk in zip(slots, blocks):
            assert torch.equal(pool_t[:, blk.block_id], torch.full_like(pool_t[:, 0], float(slot + 1))), (slot, blk)
        untouched = set(range(12)) - {b.block_id for b in blocks}
        assert all(not pool_t[:, i].any() for i in untouched)
    finally:
        tier.close()


# -- tensor parallelism: every rank keeps its heads of each block, rank 0 decides --------------



@needs_shm
def test_at_tp2_an_evicted_prefix_comes_back_from_every_ranks_tier_token_exact(llama_dir, reference, tmp_path):
    """Rank 1 holds half the heads of every block: had it not stored and loaded its half as
    rank 0 did, a's second run would attend to b's KV on those heads."""
    rng = random.Random(0)
    a, b = prompt(rng, 200), prompt(rng, 200)
    with LLM(llama_dir, num_gpu_blocks_override=16, max_model_len=240, kv_offload_bytes=1 << 22,
             kv_offload_path=str(tmp_path), tensor_parallel_size=2) as llm:
        outs = [llm.generate([p], GREEDY)[0] for p in (a, b, a)]
        assert [o.token_ids for o in outs] == reference([a, b, a])
        eng = llm.engine
        tier = eng.tier.snapshot()
        assert outs[2].num_cached_tokens == 12 * 16, outs[2].num_cached_tokens
        assert tier["loads"] == 1 and tier["loaded_blocks"] == 9 and tier["load_failures"] == 0, tier
        assert tier["offered"] == 0 and tier["sync_copies"] == tier["stored"] > 0  # copied when taken, no thread
        assert eng.kv.pool.num_free == eng.kv.pool.num_blocks and tier["pinned"] == 0
        assert not eng.tier._mirror_ops  # every copy went to the other rank
        assert not list(tmp_path.iterdir())  # both ranks' files unlinked once mapped


@needs_shm
def test_at_tp2_a_random_shared_prefix_workload_is_token_exact_and_leaks_nothing(llama_dir, reference):
    rng = random.Random(7)
    systems = [prompt(rng, 16 * rng.randrange(3, 8)) for _ in range(4)]
    prompts = [rng.choice(systems) + prompt(rng, rng.randrange(1, 40)) for _ in range(24)]
    with LLM(llama_dir, num_gpu_blocks_override=20, max_model_len=300, kv_offload_bytes=12 * 6144,
             max_num_seqs=3, tensor_parallel_size=2) as llm:
        got = []
        for i in range(0, len(prompts), 3):
            got += [o.token_ids for o in llm.generate(prompts[i:i + 3], GREEDY)]
        assert got == reference(prompts)
        snap = llm.engine.tier.snapshot()
        assert snap["loaded_blocks"] > 0 and snap["evicted"] > 0, snap
        assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks and snap["pinned"] == 0
        assert not llm.engine.scheduler.loading


@needs_shm
def test_at_tp2_a_remote_reservation_hands_its_evictions_to_the_ranks_before_its_blocks_leave(llama_dir, reference):
    """Another worker writes into a reservation's blocks on every rank, maybe before the next
    step: the copies of what the reservation evicted reach the other rank at once (a control
    call), and what they kept comes back token-exact."""
    rng = random.Random(0)
    a, b = prompt(rng, 200), prompt(rng, 200)
    with LLM(llama_dir, num_gpu_blocks_override=16, max_model_len=240, kv_offload_bytes=1 << 22,
             tensor_parallel_size=2) as llm:
        eng = llm.engine
        first = llm.generate([a], GREEDY)[0]
        stored = eng.tier.snapshot()["stored"]
        req = eng.make_request(b, GREEDY, request_id="remote-b")
        assert eng.connector.reserve(req) is not None
        assert eng.tier.snapshot()["stored"] > stored and not eng.tier._mirror_ops  # handed over already
        eng.connector.abort("remote-b")
        again = llm.generate([a], GREEDY)[0]
        assert [first.token_ids, again.token_ids] == reference([a, a])
        assert eng.tier.snapshot()["loaded_blocks"] > 0
        assert eng.kv.pool.num_free == eng.kv.pool.num_blocks


def test_a_mirrored_tier_copies_in_order_and_a_rank_repeats_the_copies(tmp_path):
    """Rank 0's side: with ``mirror``, a block is copied when the pool takes it and a load when
    it starts, each recorded for the other ranks and handed over by ``flush``; a rank's side
    (`TierMirror`) repeats them on its own pool, slot for slot."""
    pool0, pool1 = torch.zeros(2, 4, 2, 16, 2, 8), torch.zeros(2, 4, 2, 16, 2, 8)  # rank 0's heads, rank 1's
    handed = []
    pool = BlockPool(4)
    tier = KVTier(pool0, 2 * (2 * 2 * 16 * 2 * 8 * 4), "file", str(tmp_path), window=4,
                  mirror=lambda slots, ops, now: handed.append((slots, ops, now)))
    pool.tier = tier
    mirror = TierMirror(pool1, "file", str(tmp_path))
    try:
        blk = cache_block(pool, pool0, 1, 1.0)
        pool1[:, blk.block_id] = -1.0  # rank 1 wrote its heads of the same block
        assert tier.offer_lru_head(pool) == 0  # no copy ahead when mirrored
        pool.allocate(4)  # the pool takes every block, the cached one too: copied now
        tier.flush(now=False)
        [(slots, ops, now)] = handed
        assert (slots, now) == (tier.capacity, False) and ops == [("store", blk.block_id, 0)]
        mirror.apply(slots, ops)
        pool0[:, blk.block_id] = 5.0  # the step that took it rewrites it, on both ranks
        pool1[:, blk.block_id] = 5.0
        pool.release(pool.blocks)
        [dst] = pool.allocate(1)
        load = tier.start_load("r", [bytes([1]) * 32], [dst], [dst])
        assert load is not None and load.error is None and tier.finished_loads() == [load]  # done already
        assert torch.equal(pool0[:, dst.block_id], torch.full_like(pool0[:, 0], 1.0))
        tier.flush()
        assert handed[-1] == (tier.capacity, [("load", dst.block_id, 0)], True)
        mirror.apply(*handed[-1][:2])
        assert torch.equal(pool1[:, dst.block_id], torch.full_like(pool1[:, 0], -1.0))  # rank 1's own heads
        assert mirror.copies == 2
        tier.flush()
        assert len(handed) == 2  # nothing new: nothing handed
    finally:
        tier.close()
        mirror.close()
