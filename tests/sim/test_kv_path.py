"""The simulated KV path as the product runs it: KV pushed after the step a prefill ends in
(prefill/batch.py push_as_computed), and the KV hierarchy's routing inputs (what the prefill
workers hold: `remote_cached_len` and each task's prefix hint; what a decode worker's second
tier holds: `tier_cached_len`, loaded back by the product's scheduler).

Profiles here are plain values without noise, so times are exact sums of step models."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.router import DEFAULT_POLICY
from pdserve.sim import cluster as sim_cluster
from pdserve.sim import decode_sim
from pdserve.sim.cluster import SimTopology, Simulation
from pdserve.sim.profile import CostProfile, ProfileError, StepModel, profile_from_dict
from pdserve.sim.search import with_mode
from pdserve.sim.workload import SimRequest

# A step: 10 ms + 1 ms per prompt token; steps of at most 256 tokens, batches of up to 2048.
PLAIN = CostProfile(name="plain", source="hand-written", kv_bytes_per_token=1000,
                    steps={1: StepModel(10.0, 0.0, 1.0, kv_blocks=512)}, block_size=16,
                    max_num_batched_tokens=256, batch_max_tokens=2048, transfer_setup_ms=2.0,
                    transfer_gb_per_s=1.0, transfer_overlap=0.0, queue_hop_ms=1.0, noise_cv=0.0)
REMOTE = with_mode(DEFAULT_POLICY, "always_remote")


def test_a_prompt_that_ends_in_the_first_step_of_a_batch_gets_its_kv_before_the_batch_ends():
    """C (256 tokens) keeps the prefill worker busy while A (64) and B (700) queue; they are then
    taken as one batch of three steps: A (64) beside the first 192 of B, then 256, then 252.
    A's KV goes out after the first step and lands a transfer later (2 ms + 64 KB at 1 GB/s); the
    batch waits for that write and goes on; B's goes out two steps later."""
    reqs = [SimRequest(0, 0.0, 256, 4), SimRequest(1, 0.05, 64, 4), SimRequest(2, 0.06, 700, 4)]
    sim = Simulation(reqs, PLAIN, REMOTE, SimTopology(1, 1), seed=1).run()
    p = sim.prefill[0]  # the decode worker names requests in arrival order: decode-0-0 is C
    a_step, a_landed = p.pushed["decode-0-1"]
    b_step, b_landed = p.pushed["decode-0-2"]
    transfer_a = 2.0 + 64 * 1000 / 1e6
    assert (a_landed - a_step) * 1e3 == pytest.approx(transfer_a)
    # the two later steps (10 + 256 and 10 + 252 ms) start once A's write is over
    assert (b_step - a_step) * 1e3 == pytest.approx(transfer_a + 266.0 + 262.0)
    assert a_landed < b_step  # A's KV is on its decode worker before the batch's last step ends
    rec = {r.rid: r for r in sim.records}
    assert rec[1].first_token == pytest.approx(a_landed)  # its first token is delivered with its KV
    assert rec[1].first_token < rec[2].first_token
    assert rec[2].first_token == pytest.approx(b_landed)
    assert all(r.route == "remote" and r.tokens == 4 for r in sim.records)


def test_a_batch_within_one_step_pushes_after_it_and_the_next_batch_waits_for_the_writes():
    """The whole-batch case: one step computes both prompts, both are pushed after it, and the
    worker's next batch starts only once both writes are over (prefill/batch.py waits for them)."""
    reqs = [SimRequest(0, 0.0, 100, 2), SimRequest(1, 0.01, 64, 2), SimRequest(2, 0.02, 80, 2),
            SimRequest(3, 0.03, 48, 2)]
    sim = Simulation(reqs, PLAIN, REMOTE, SimTopology(1, 1), seed=1).run()
    p = sim.prefill[0]
    order = sorted(p.pushed.items(), key=lambda kv: kv[1])
    first, rest = order[0], order[1:]
    assert len({step for _, (step, _) in rest}) == 1  # the three queued behind the first: one batch, one step
    step = rest[0][1][0]
    assert step > first[1][1]  # it started after the first batch's write was over
    landed = max(done for _, (_, done) in rest)
    assert landed - step == pytest.approx((2.0 + 80 * 1000 / 1e6) / 1e3)


def _spy(monkeypatch):
    seen = []
    real = decode_sim.admit

    def admit(feats, snap, policy):
        seen.append((feats, snap))
        return real(feats, snap, policy)

    monkeypatch.setattr(decode_sim, "admit", admit)
    return seen


def test_what_the_prefill_workers_hold_reaches_the_router_and_the_queue(monkeypatch):
    """1P2D, round robin: the first prompt of a prefix group goes through decode-0 and is
    prefilled remotely; the second, on decode-1, misses that worker's pool but the prefill
    worker holds the 512-token prefix: remote_cached_len 512 (the KV index's hint), the task
    carries the hint to the queue, and the prefill worker computes only past the prefix."""
    seen = _spy(monkeypatch)
    put = []
    real_put = sim_cluster.QueueCore.put
    monkeypatch.setattr(sim_cluster.QueueCore, "put", lambda self, task: put.append(task) or real_put(self, task))
    reqs = [SimRequest(0, 0.0, 600, 2, prefix_group=3, prefix_len=512),
            SimRequest(1, 2.0, 600, 2, prefix_group=3, prefix_len=512)]
    sim = Simulation(reqs, PLAIN, REMOTE, SimTopology(1, 2, ingress="round_robin"), seed=1).run()
    (f0, _), (f1, _) = seen
    assert (f0.cached_len, f0.remote_cached_len) == (0, 0)
    assert (f1.cached_len, f1.remote_cached_len, f1.tier_cached_len, f1.peer_reads) == (0, 512, 0, False)
    assert put[0].prefix_hint == {} and put[1].prefix_hint == {"prefill-0": 512}
    rec = {r.rid: r for r in sim.records}
    assert (rec[1].worker, rec[1].remote_cached_len) == ("decode-1", 512)
    assert sim.prefill[0].engine.prompt_tokens_computed == 600 + (600 - 512)


TIERED = dataclasses.replace(PLAIN, steps={1: StepModel(5.0, 0.2, 0.5, kv_blocks=64)}, tier_blocks=256,
                             tier_gb_per_s=2.0)


def _evicting(tier_blocks: int) -> Simulation:
    """0P1D, a pool of 64 blocks: a prompt behind a 512-token prefix, two 600-token prompts that
    evict it from the pool, then the prefix again."""
    prof = dataclasses.replace(TIERED, tier_blocks=tier_blocks)
    reqs = [SimRequest(0, 0.0, 600, 2, prefix_group=5, prefix_len=512), SimRequest(1, 1.0, 600, 2),
            SimRequest(2, 2.0, 600, 2), SimRequest(3, 3.0, 600, 2, prefix_group=5, prefix_len=512)]
    return Simulation(reqs, prof, DEFAULT_POLICY, SimTopology(0, 1), seed=1).run()


def test_a_prefix_the_pool_evicted_is_found_in_the_tier_and_loaded_back(monkeypatch):
    seen = _spy(monkeypatch)
    tiered = _evicting(256)
    last, snap = seen[-1]
    assert (last.cached_len, last.tier_cached_len) == (0, 512)  # gone from the pool, whole in the tier
    eng = tiered.decode[0].engine
    assert eng.scheduler.tier_loaded_tokens == 512  # the product's scheduler loaded it back
    assert eng.tier.stats["loads"] == 1
    # priced as the product prices it: 0 before the tier's first load (then measured: 16 blocks
    # of 16 tokens x 1000 bytes at 2 GB/s is 0.0005 ms a token)
    assert snap.costs.tier_load_ms_per_token == 0.0
    assert eng.tier_load_ms_per_token() == pytest.approx(16 * 1000 / 16 / 2e9 * 1e3)
    seen.clear()
    plain = _evicting(0)
    assert seen[-1][0].tier_cached_len == 0 and plain.decode[0].engine.tier is None

    def ttft(sim):
        r = next(r for r in sim.records if r.rid == 3)
        return r.first_token - r.arrival

    # computing 88 tokens after a 16 KB-per-block load beats computing all 600
    assert ttft(tiered) < ttft(plain) - 0.2
    for sim in (tiered, plain):
        assert all(r.tokens == 2 for r in sim.records) and not sim.decode[0].inflight


def test_a_tier_the_profile_gives_is_checked():
    body = PLAIN.to_dict()
    assert profile_from_dict({**body, "tier_blocks": 128}).tier_blocks == 128
    with pytest.raises(ProfileError, match="tier_blocks must be a whole number"):
        profile_from_dict({**body, "tier_blocks": 1.5})
    with pytest.raises(ProfileError, match="tier_gb_per_s must be > 0"):
        profile_from_dict({**body, "tier_gb_per_s": 0})
    with pytest.raises(ProfileError, match="batch_max_tokens must be >= 0"):
        profile_from_dict({**body, "batch_max_tokens": -1})
    assert PLAIN.prefill_batch_tokens == 2048 and dataclasses.replace(PLAIN, batch_max_tokens=0).prefill_batch_tokens == 256


def test_the_simulated_tier_is_an_lru_that_keeps_what_a_load_pins():
    from types import SimpleNamespace

    from pdserve.sim.engine import SimTier

    now = [0.0]
    tier = SimTier(2, block_bytes=1000, load_gb_per_s=1.0, clock=lambda: now[0])

    def block(h):
        return SimpleNamespace(block_hash=h, parent_hash=None, token_ids=(1, 2))

    tier.evicting(block(b"a"))
    tier.evicting(block(b"b"))
    tier.evicting(block(b"c"))  # full: the least recent (a) gives way
    assert (tier.leading([b"a"]), tier.leading([b"b", b"c"])) == (0, 2)
    load = tier.start_load("r", [b"b", b"c", b"x"], ["blk0", "blk1", "blk2"], [])
    assert load.hashes == [b"b", b"c"] and load.blocks == ["blk0", "blk1"]  # what the tier still holds
    assert tier.next_load_at() == pytest.approx(2 * 1000 / 1e9)
    tier.evicting(block(b"d"))  # both slots pinned by the load: dropped
    assert tier.stats["dropped"] == 1 and not tier.holds(b"d")
    assert tier.finished_loads() == [] and tier.load_bytes_per_s is None  # not over yet
    now[0] = 1.0
    assert tier.finished_loads() == [load] and load.finished and tier.load_bytes_per_s == 1e9
    tier.evicting(block(b"d"))  # unpinned now: b, made recent before c by the load, gives way
    assert tier.holds(b"d") and tier.holds(b"c") and not tier.holds(b"b")
