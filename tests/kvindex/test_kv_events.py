"""KV events: the engine records what its prefix cache gains and loses, a publisher sends it
in vLLM's format and protocol (ZMQ PUB + ROUTER), and a subscriber's view of a worker stays
equal to that worker's cache: across a gap it replays, after a restart or a loss the
publisher no longer covers it starts from a snapshot. The worker is a real child process."""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import time

import msgpack
import pytest
from kv_worker import kv_worker_main

from pdserve.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
)
from pdserve.engine import LLM, SamplingParams
from pdserve.cluster.kvindex.index import ClusterKVIndex
from pdserve.cluster.kvindex.subscriber import KVEventSubscriber
from pdserve.cluster.kvindex.view import WorkerKVView

pytestmark = pytest.mark.timeout(300)

# vLLM 0.32's msgspec encoder on KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[b"\x01" * 4],
# parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None, medium="GPU",
# lora_name=None), BlockRemoved(block_hashes=[b"\x02" * 4], medium="GPU"), AllBlocksCleared()]).
VLLM_BYTES = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c40401010101b170"
    "6172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f69"
    "64c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68"
    "617368657391c40402020202a66d656469756da347505581a474797065b0416c6c426c6f636b73436c6561726564c0")
VLLM_BATCH = KVEventBatch(1.5, (BlockStored((b"\x01" * 4,), None, (1, 2, 3, 4), 4, "GPU"),
                                BlockRemoved((b"\x02" * 4,), "GPU"), AllBlocksCleared()))


def test_the_wire_format_is_vllms_byte_for_byte():
    assert encode_batch(VLLM_BATCH) == VLLM_BYTES
    assert decode_batch(VLLM_BYTES) == VLLM_BATCH


def test_a_view_holds_a_block_in_every_tier_it_is_in_and_counts_the_fastest():
    h, g = b"\x01" * 4, b"\x02" * 4
    view = WorkerKVView()
    view.apply(KVEventBatch(1.0, (BlockStored((h, g), None, (1, 2, 3, 4) * 2, 4, "GPU"),
                                  BlockStored((h,), None, (1, 2, 3, 4), 4, "STORAGE"))))
    assert view.blocks[h] == (None, "GPU") and view.media[h] == {"GPU", "STORAGE"}
    view.apply(KVEventBatch(2.0, (BlockRemoved((h, g), "GPU"),)))  # evicted from the pool, kept in the tier
    assert view.blocks == {h: (None, "STORAGE")} and view.longest_prefix([h, g]) == 1
    view.apply(KVEventBatch(3.0, (BlockRemoved((h,), "STORAGE"),)))
    assert view.blocks == {} and view.media == {}


def test_decoding_takes_int_hashes_and_later_fields_and_names_what_is_malformed():
    raw = [2.0, [{"type": "BlockStored", "block_hashes": [7, -3], "parent_block_hash": 5, "token_ids": [1] * 8,
                  "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0}], 1]
    batch = decode_batch(msgpack.packb(raw))
    (e,) = batch.events
    assert batch.data_parallel_rank == 1 and len(e.block_hashes) == 2 and e.parent_block_hash is not None
    assert len(set(e.block_hashes)) == 2 and e.medium == "CPU"
    for bad, what in ((b"\xc1", "not msgpack"), (msgpack.packb({"ts": 1}), r"\[ts, events"),
                      (msgpack.packb([1.0, [{"type": "Nope"}]]), "unknown event type 'Nope'"),
                      (msgpack.packb([1.0, [{"type": "BlockRemoved"}]]), "BlockRemoved")):
        with pytest.raises(KVEventDecodeError, match=what):
            decode_batch(bad)


def _workload(seed: int, n: int) -> list[list[int]]:
    """Prompts sharing a few system prefixes (cache hits) with random tails (misses, evictions)."""
    fixed = random.Random(0)  # the same system prompts in every workload
    systems = [[fixed.randrange(3, 200) for _ in range(12)] for _ in range(3)]
    rng = random.Random(seed)
    return [rng.choice(systems) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 14))] for _ in range(n)]


def test_the_event_log_and_a_view_of_its_batches_equal_the_prefix_cache(llama_dir):
    llm = LLM(llama_dir, kv_events=True, num_gpu_blocks_override=24, block_size=4, device="cpu")
    log, view = llm.engine.kv_events, WorkerKVView()
    removed = 0
    for rnd in range(4):
        llm.generate(_workload(rnd, 6), SamplingParams(max_tokens=3, temperature=0.0))
        taken = log.take_batch()
        assert taken is not None and taken[0] == rnd  # one batch per round, numbered from 0
        removed += sum(len(e.block_hashes) for e in taken[1].events if isinstance(e, BlockRemoved))
        view.apply(decode_batch(encode_batch(taken[1])))
        cached = set(llm.engine.kv.pool.cached)
        assert log.cached_hashes() == cached and view.hashes() == cached
    assert removed > 0, "the pool never evicted: the test does not cover removals"
    _, seq, snap = log.snapshot()
    fresh = WorkerKVView()
    fresh.apply(snap)
    assert seq == 3 and fresh.blocks == view.blocks  # same blocks, same parents and media


@contextlib.contextmanager
def spawned_kv_worker(model: str, max_pending: int = 100_000, interval_s: float = 0.005):
    """A KV worker child process: (its pipe, its publisher's endpoints); stopped on exit."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=kv_worker_main, args=(child, model, 24, max_pending, interval_s), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "the KV worker did not start"
        yield parent, parent.recv()
    finally:
        try:
            parent.send({"op": "exit"})
            parent.poll(10) and parent.recv()
        except (OSError, EOFError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.fixture
def kv_worker(llama_dir, request):
    """The child: (pipe, endpoints); params (max_pending, interval_s) from the test's marker."""
    with spawned_kv_worker(llama_dir, *getattr(request, "param", ())) as worker:
        yield worker


def _call(conn, **cmd):
    conn.send(cmd)
    assert conn.poll(120), f"no answer to {cmd['op']}"
    return conn.recv()


def _synced(sub: KVEventSubscriber, conn, timeout_s: float = 20.0) -> dict:
    """Poll until the subscriber's view equals the worker's cache; the worker's report."""
    deadline = time.monotonic() + timeout_s
    while True:
        sub.poll(0.1)
        report = _call(conn, op="cached")
        assert report["pool"] == report["log"]
        if sorted(sub.view.hashes()) == report["pool"]:
            return report
        assert time.monotonic() < deadline, "the subscriber's view never matched the worker's cache"


def test_a_subscriber_follows_a_worker_and_a_restarted_one_resyncs(kv_worker):
    conn, ends = kv_worker
    with KVEventSubscriber(ends["endpoint"], ends["replay_endpoint"]) as sub:
        for rnd in range(3):
            assert _call(conn, op="generate", prompts=_workload(rnd, 5)) == "ok"
            _synced(sub, conn)
        assert sub.snapshots == 1 and sub.view.applied_batches > 1  # joined by a snapshot, then live batches
    # The subscriber is gone while the worker stores and evicts more: a new one catches up.
    for rnd in range(3, 6):
        assert _call(conn, op="generate", prompts=_workload(rnd, 5)) == "ok"
    with KVEventSubscriber(ends["endpoint"], ends["replay_endpoint"]) as sub:
        report = _synced(sub, conn)
        assert sub.snapshots == 1 and len(report["pool"]) > 0


@pytest.mark.parametrize("kv_worker", [(6, 0.3)], indirect=True)
def test_events_the_engine_dropped_make_a_gap_that_a_snapshot_closes(kv_worker):
    """The publisher is slow (every 0.3 s) and the log holds 6 events: a round stores more, so
    the log drops them and skips a number; the subscriber sees the gap, the replay buffer
    cannot fill it, and it starts over from a snapshot: its view still equals the cache."""
    conn, ends = kv_worker
    with KVEventSubscriber(ends["endpoint"], ends["replay_endpoint"]) as sub:
        _synced(sub, conn)
        for rnd in range(3):
            assert _call(conn, op="generate", prompts=_workload(10 + rnd, 6)) == "ok"
            report = _synced(sub, conn)
        assert report["gaps"] > 0 and sub.gaps > 0 and sub.snapshots > 1


class LosesOneMessage(KVEventSubscriber):
    """A subscriber whose socket loses the first live message after it joined (as a full
    socket drops one): the next one shows the gap."""

    lost: int | None = None

    def _apply(self, seq: int, payload: bytes) -> int:
        if self.lost is None and self.next_seq is not None and seq >= self.next_seq and not self._replaying:
            self.lost = seq
            return 0
        return super()._apply(seq, payload)

    _replaying = False

    def _catch_up(self, upto: int) -> int:
        self._replaying = True
        try:
            return super()._catch_up(upto)
        finally:
            self._replaying = False


def test_a_message_the_subscriber_lost_is_replayed_from_the_publishers_buffer(kv_worker):
    conn, ends = kv_worker
    with LosesOneMessage(ends["endpoint"], ends["replay_endpoint"]) as sub:
        _synced(sub, conn)
        for rnd in range(3):
            assert _call(conn, op="generate", prompts=_workload(20 + rnd, 4)) == "ok"
        _synced(sub, conn)
        assert sub.lost is not None and sub.gaps >= 1 and sub.replayed >= 1 and sub.snapshots == 1


@pytest.mark.parametrize("seed", [1, 2])
def test_the_cluster_index_is_the_union_of_the_workers_caches_and_finds_each_ones_prefix(llama_dir, seed):
    """Two workers, random workloads over shared system prompts (each stores, hits and evicts):
    the index built from their events holds exactly the union of their caches, and for random
    prompts the prefix it reports per worker is what that worker's own cache holds."""
    rng = random.Random(seed)
    with spawned_kv_worker(llama_dir) as (c0, e0), spawned_kv_worker(llama_dir) as (c1, e1), \
            KVEventSubscriber(e0["endpoint"], e0["replay_endpoint"]) as s0, \
            KVEventSubscriber(e1["endpoint"], e1["replay_endpoint"]) as s1:
        index = ClusterKVIndex(block_size=4)
        conns, subs = {"w0": c0, "w1": c1}, {"w0": s0, "w1": s1}
        for rnd in range(3):
            for w, conn in conns.items():
                assert _call(conn, op="generate", prompts=_workload(rng.randrange(1000), 5)) == "ok"
        caches = {w: set(_synced(subs[w], conns[w])["pool"]) for w in conns}
        for w, sub in subs.items():
            index.set_view(w, sub.view)
        assert index.hashes() == caches["w0"] | caches["w1"]
        assert caches["w0"] != caches["w1"]  # different workloads: the union is more than either
        found = 0
        for prompt in _workload(seed, 12):
            chain = index.prompt_hashes(prompt)
            got = {h.worker_id: h.blocks for h in index.longest_prefixes(prompt)}
            for w, cache in caches.items():
                want = next((i for i, h in enumerate(chain) if h not in cache), len(chain))
                assert got[w] == want, f"{w}: index says {got[w]} blocks, the cache holds {want}"
                found += want
        assert found > 0, "no prompt hit any cache: the prefix answers were never tested"
        assert index.queries == 12 and sum(index.asked_blocks.values()) > 0
