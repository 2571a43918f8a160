"""A prefix lent between workers of different TP sizes (kvtransfer/lending.py over
kvtransfer/nixl/tp_sender.py `TPSender.read_blocks`): real tensor-parallel engines (rank
processes, each rank with its own NIXL agent over its own HND pool). Each borrower rank reads
its KV heads from the holder ranks that hold them, the holder is released once every read
arrived, its rank 0 confirms the loan before any rank's pages are used (a loan whose blocks the
holder reused meanwhile is answered stale and computed), and the borrower computes only the
rest of the prompt, token-exact. A rank whose read cannot be posted fails the borrow: computed
instead, token-exact, the rank 0 read that may still land kept out of use until it can no
longer land, and no block left taken."""

from __future__ import annotations

import contextlib
import random
import time

import pytest
from test_lending import GREEDY, prompts, reference  # noqa: F401  (the TP=1 loans' prompts and reference)

from pdserve.engine import LLMEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV
from pdserve.kvtransfer.lend import LendGrant, LendRelease
from pdserve.kvtransfer.borrower import Borrower
from pdserve.kvtransfer.lender import Lender
from pdserve.kvtransfer.lending import route_notification
from pdserve.kvtransfer.nixl.ranks import rank_agent_name
from pdserve.kvtransfer.nixl.tp_transport import open_worker_transport, with_rank_transport

pytestmark = [pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}"),
              pytest.mark.timeout(300)]

NUM_BLOCKS = 48


@contextlib.contextmanager
def worker(model: str, worker_id: str, tp: int, **engine_args):
    """An engine and its transport over every rank, opened as a worker opens them, with the
    sender a worker lends and borrows through."""
    engine_args.setdefault("num_gpu_blocks_override", NUM_BLOCKS)
    eng = LLMEngine(EngineConfig.from_kwargs(model, **with_rank_transport(
        {"tensor_parallel_size": tp, "kv_layout": "HND", **engine_args})))
    transport = None
    try:
        transport = open_worker_transport(worker_id, eng, LOOPBACK_UCX_ENV)
        yield eng, transport.sender(), transport.record
    finally:
        if transport is not None:
            transport.agent.close()
        eng.close()


def generate(eng: LLMEngine, prompt: list[int], rid: str):
    eng.add_request(prompt, GREEDY, request_id=rid)
    while eng.has_work():
        eng.step()
    return eng.release(rid)


class Pair:
    """A holder's `Lender` and a borrower's `Borrower`, driven as the workers' loops drive them."""

    def __init__(self, holder_sender, borrower_eng, borrower_sender, holder_eng, quarantine_s=0.5, **borrower_args):
        self.skew = 0.0  # seconds the holder's clock runs ahead (a paused or skewed holder)
        self.lender = Lender(holder_eng.connector, holder_sender, clock=lambda: time.monotonic() + self.skew)
        self.borrower = Borrower(borrower_eng.connector, borrower_sender, quarantine_s=quarantine_s, **borrower_args)
        self.holder_sender, self.borrower_sender = holder_sender, borrower_sender
        # Messages held back (both agents are still polled: NIXL moves nothing for an agent
        # nobody polls), so that a test orders what each side learns when.
        self.hold_grants = self.hold_releases = False
        self.held_grants: list = []
        self.held_releases: list = []

    def drive(self) -> None:
        self.drive_holder()
        self.drive_borrower()

    def drive_holder(self) -> None:
        res = self.holder_sender.poll()
        for note in res.notifications:
            msg = route_notification(note.payload)
            if self.hold_releases and isinstance(msg, LendRelease):
                self.held_releases.append((note.sender, msg))
            elif msg is not None:
                self.lender.handle(note.sender, msg)
        self.lender.expire()

    def drive_borrower(self) -> None:
        res = self.borrower_sender.poll()
        for note in res.notifications:
            msg = route_notification(note.payload)
            if self.hold_grants and isinstance(msg, LendGrant):
                self.held_grants.append((note.sender, msg))
            elif msg is not None:
                self.borrower.handle(note.sender, msg)
        self.borrower.transfers(res.completed, res.failed)
        self.borrower.expire()

    def borrow(self, prompt, holder, blocks, timeout_s=30.0):
        lend_id = self.borrower.start(prompt, holder, blocks)
        assert lend_id is not None
        return self.borrow_result(lend_id, timeout_s)

    def borrow_result(self, lend_id, timeout_s=30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.drive()
            for r in self.borrower.take_results():
                return r
            time.sleep(0.001)
        raise AssertionError("the borrow did not end")

    def settle(self, until, timeout_s=20.0, drive=None) -> None:
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            (drive or self.drive)()
            time.sleep(0.005)


@pytest.mark.parametrize("holder_tp,borrower_tp", [(2, 2), (2, 1), (1, 2)])
def test_a_prefix_lent_across_tp_sizes_is_read_rank_by_rank_and_token_exact(llama_dir, reference, holder_tp,
                                                                             borrower_tp):
    shared, prompt = prompts(holder_tp * 10 + borrower_tp)
    with worker(llama_dir, f"h{holder_tp}{borrower_tp}", holder_tp) as (he, hs, h_record), \
            worker(llama_dir, f"b{holder_tp}{borrower_tp}", borrower_tp) as (be, bs, b_record):
        holder = bs.add_peer(h_record)
        hs.add_peer(b_record)
        generate(he, shared + [7, 7], "warm")  # the holder caches the 10 shared blocks
        generate(be, shared[:32], "own")  # the borrower holds the first two itself
        pair = Pair(hs, be, bs, he)
        got = pair.borrow(prompt, holder, 10)
        assert got.outcome == "read", got
        assert got.read_tokens == 8 * 16  # only what it lacked, every rank its heads
        out = generate(be, prompt, "r")
        assert out.num_cached_tokens == 160 and out.token_ids == reference(prompt)
        # The release reached the holder once every rank's read was over, and its confirm the
        # borrower before it used any rank's pages: nothing stays lent.
        pair.settle(lambda: pair.lender.counters["released"] == 1)
        assert dict(pair.lender.counters) == {"granted": 1, "released": 1, "confirmed": 1}
        assert pair.borrower.counters["confirmed"] == 1
        assert pair.lender.table.lent_blocks == 0
        for eng in (he, be):
            assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks  # no block left taken


def test_a_rank_whose_read_cannot_be_posted_fails_the_borrow_and_it_is_computed(llama_dir, reference):
    shared, prompt = prompts(7)
    with worker(llama_dir, "hq", 2) as (he, hs, h_record), worker(llama_dir, "bq", 2) as (be, bs, b_record):
        holder = bs.add_peer(h_record)
        hs.add_peer(b_record)
        # The borrower's rank 1 forgets the holder's rank 1: its read cannot be posted, while
        # rank 0's is (and may still be landing when the failure is known).
        be.runner.group.call("remove_peer", names=[rank_agent_name(holder, 1)])
        generate(he, shared + [7, 7], "warm")
        pair = Pair(hs, be, bs, he, quarantine_s=0.5)
        got = pair.borrow(prompt, holder, 10)
        assert got.outcome == "failed" and "rank 1" in got.detail, got
        out = generate(be, prompt, "r")
        assert out.num_cached_tokens == 0 and out.token_ids == reference(prompt)  # computed, token-exact
        pair.settle(lambda: not pair.borrower.quarantined and pair.lender.counters["released"] == 1)
        assert not pair.borrower.quarantined
        assert dict(pair.lender.counters) == {"granted": 1, "released": 1}  # released on the failure
        for eng in (he, be):
            assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_a_borrow_into_blocks_the_tier_is_saving_waits_for_every_rank_to_save_them(llama_dir, reference, tmp_path):
    """At TP=2 with a second tier, rank 1 repeats rank 0's tier copies before its next forward;
    a borrow's reads land sooner. So taking the borrow's target blocks (which evicts cached
    ones into the tier) hands those copies to rank 1 at once: else rank 1 would save the
    lent KV as the evicted prefix's, and that prefix would come back wrong on its heads."""
    rng = random.Random(3)
    a = [rng.randrange(3, 32000) for _ in range(200)]
    shared, prompt = prompts(8)
    with worker(llama_dir, "ht", 2) as (he, hs, h_record), \
            worker(llama_dir, "bt", 2, num_gpu_blocks_override=16, max_model_len=240, kv_offload_bytes=1 << 22,
                   kv_offload_path=str(tmp_path)) as (be, bs, b_record):
        holder = bs.add_peer(h_record)
        hs.add_peer(b_record)
        generate(he, shared + [7, 7], "warm")
        first = generate(be, a, "a1")  # the borrower's pool: a's 12 cached blocks of its 16
        pair = Pair(hs, be, bs, he)
        got = pair.borrow(prompt, holder, 10)  # its 10 targets evict 6 of a's blocks into the tier
        assert got.outcome == "read", got
        out = generate(be, prompt, "p")
        assert out.num_cached_tokens == 160 and out.token_ids == reference(prompt)
        again = generate(be, a, "a2")  # a's evicted blocks come back from both ranks' tiers
        assert be.tier.snapshot()["loaded_blocks"] >= 6, be.tier.snapshot()
        assert [first.token_ids, again.token_ids] == [reference(a)] * 2
        pair.settle(lambda: pair.lender.counters["released"] == 1)
        assert be.kv.pool.num_free == be.kv.pool.num_blocks and pair.lender.table.lent_blocks == 0


def test_a_tp2_holder_loads_a_chain_back_from_every_ranks_tier_before_it_lends_it(llama_dir, reference, tmp_path):
    """The TP=2 holder's pool evicted the shared prefix's tail into its tier: it loads it back
    (rank 0 at once, rank 1 by the copies handed over before the grant leaves) and lends it;
    the borrower's ranks read it token-exact."""
    rng = random.Random(5)
    shared, prompt = prompts(9)
    others = [[rng.randrange(3, 32000) for _ in range(200)] for _ in range(2)]
    with worker(llama_dir, "hl", 2, num_gpu_blocks_override=24, max_model_len=240, kv_offload_bytes=1 << 22,
                kv_offload_path=str(tmp_path)) as (he, hs, h_record), \
            worker(llama_dir, "bl", 2) as (be, bs, b_record):
        holder = bs.add_peer(h_record)
        hs.add_peer(b_record)
        generate(he, shared + [7, 7], "warm")
        for i, other in enumerate(others):  # 2 x 13 blocks through a 24-block pool
            generate(he, other, f"o{i}")
        pooled = he.connector.cached_prefix_len(prompt)
        assert pooled < 160 and pooled + he.connector.tier_prefix_len(prompt, pooled) == 160
        pair = Pair(hs, be, bs, he)
        got = pair.borrow(prompt, holder, 10)
        assert got.outcome == "read", got
        out = generate(be, prompt, "r")
        assert out.num_cached_tokens == 160 and out.token_ids == reference(prompt)
        pair.settle(lambda: pair.lender.counters["released"] == 1)
        assert pair.lender.counters["granted_from_tier"] == 1 and pair.lender.table.lent_blocks == 0
        assert he.kv.pool.num_free == he.kv.pool.num_blocks


def test_at_tp_blocks_the_holder_reused_before_the_read_are_never_used_on_any_rank(llama_dir, reference):
    """TP 2->2. The holder's lease ends early (its clock jumps) and it reuses the lent blocks for
    other prompts before the borrower's ranks read them. Every rank's read completes well
    inside the borrower's deadline and the release goes to the holder's rank 0; until the
    confirm comes back nothing is used on any rank, and the confirm says stale: the borrower
    computes, token-exact, and no block stays taken."""
    shared, prompt = prompts(31)
    rng = random.Random(31)
    with worker(llama_dir, "hs", 2) as (he, hs, h_record), worker(llama_dir, "bs", 2) as (be, bs, b_record):
        holder = bs.add_peer(h_record)
        hs.add_peer(b_record)
        generate(he, shared + [7, 7], "warm")
        pair = Pair(hs, be, bs, he, lease_ms=60_000)
        pair.hold_grants = True  # the borrower reads only once the holder reused the blocks
        lend_id = pair.borrower.start(prompt, holder, 10)
        assert lend_id is not None
        pair.settle(lambda: pair.held_grants)
        [loan] = pair.lender.table.loans.values()
        granted = he.runner.kv_cache[:, list(loan.block_ids)].clone()
        pair.skew = 61.0  # past the 60 s lease, on the holder's clock only
        pair.drive_holder()
        assert pair.lender.table.lent_blocks == 0 and pair.lender.counters["expired"] == 1
        for i in range(12):  # other prompts through its 48-block pool overwrite the lent blocks
            now = he.runner.kv_cache[:, list(loan.block_ids)]
            if all(not now[:, j].equal(granted[:, j]) for j in range(len(loan.block_ids))):
                break
            generate(he, [rng.randrange(3, 32000) for _ in range(200)], f"other{i}")
        else:
            raise AssertionError("the holder did not reuse every lent block")
        # Every rank reads and the release leaves for the holder's rank 0, which does not answer
        # yet: nothing is used on any rank meanwhile.
        pair.hold_grants, pair.hold_releases = False, True
        for sender, msg in pair.held_grants:
            pair.borrower.handle(sender, msg)
        ticket = pair.borrower.tickets[lend_id]
        pair.settle(lambda: pair.held_releases)
        assert lend_id in pair.borrower.tickets and not pair.borrower.results, pair.borrower.results
        assert be.connector.cached_prefix_len(prompt) == 0
        assert ticket.arrived and ticket.handle.done and ticket.handle.notified
        pair.hold_releases = False
        for sender, msg in pair.held_releases:
            pair.lender.handle(sender, msg)
        got = pair.borrow_result(lend_id)
        assert (got.outcome, got.cached_tokens) == ("stale", 0), got
        out = generate(be, prompt, "r")
        assert out.num_cached_tokens == 0 and out.token_ids == reference(prompt)
        assert dict(pair.lender.counters) == {"granted": 1, "expired": 1, "stale": 1}
        assert not pair.borrower.quarantined  # the reads were over: their blocks freed at once
        for eng in (he, be):
            assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
