"""The decode-side glue the simulator shares with the product: what a decode worker's admission
decides on (`RequestFeatures`, `ClusterSnapshot`) is built by router/assess.py for both
decode/frontend.py and sim/decode_sim.py.

Three checks: the functions on plain values; neither caller builds those values itself (so
neither side can drift from the other unnoticed); and the same plain-valued situations driven
through the real worker's admission (`Frontend._admit`, its engine, remote path and counters
stood in by plain values) and through the simulated worker's (`DecodeSim.assess`) give equal
features and snapshots.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve.common import Priority
from pdserve.decode import frontend as frontend_mod
from pdserve.decode.frontend import Frontend
from pdserve.api.ingress import GenerateInput
from pdserve.decode.prefill_pool import PrefillView
from pdserve.engine import SamplingParams
from pdserve.router import DEFAULT_POLICY, assess
from pdserve.router.costs import CostEstimates
from pdserve.sim import decode_sim
from pdserve.sim.decode_sim import DecodeSim
from pdserve.sim.workload import SimRequest

REPO = Path(__file__).resolve().parents[2]
COSTS = CostEstimates.seed(DEFAULT_POLICY.router.cost_model, 16384)


def test_the_functions_on_plain_values():
    feats = assess.request_features(600, 256, priority="high", ttft_slo_ms=800.0, route="remote", max_tokens=32,
                                    resumed=False, hint={"p0": 512, "p1": 128}, tier_cached_len=64, peer_reads=True)
    assert (feats.prompt_len, feats.cached_len, feats.priority, feats.ttft_slo_ms, feats.override) == (
        600, 256, Priority.HIGH, 800.0, "remote")
    assert (feats.remote_cached_len, feats.tier_cached_len, feats.peer_reads, feats.max_tokens) == (512, 64, True, 32)
    resumed = assess.request_features(600, 0, priority="normal", ttft_slo_ms=None, route="remote", max_tokens=None,
                                      resumed=True, hint={}, tier_cached_len=0, peer_reads=False)
    assert resumed.override == "local" and resumed.remote_cached_len == 0  # a migrated stream continues here

    snap = assess.cluster_snapshot(COSTS, queue_depth=1, queue_tokens=900, pool_size=2, pending_remote_requests=3,
                                   pending_remote_tokens=400, num_decoding=5, num_prefilling=7, local_backlog=300,
                                   kv_usage=0.25, kv_free_tokens=4096, arrival_rate_per_s=2.5,
                                   local_prefill_budget_tokens=512, step_in_flight_ms=4.0)
    # the queue is polled: what this worker sent and has not had back is a floor under it
    assert (snap.prefill_queue_depth, snap.prefill_queue_tokens, snap.prefill_pool_size) == (3, 900, 2)
    assert (snap.decode_active_requests, snap.decode_waiting_requests) == (5, 7)
    assert (snap.local_prefill_queue_tokens, snap.local_prefill_queue_requests) == (300, 4)  # 7 waiting less 3 remote
    assert (snap.decode_kv_usage, snap.kv_free_tokens, snap.arrival_rate_per_s) == (0.25, 4096, 2.5)
    assert (snap.local_prefill_budget_tokens, snap.step_in_flight_ms) == (512, 4.0)

    assert assess.priced_tier(snap, feats, 0.02).costs.tier_load_ms_per_token == 0.02
    no_tier = dataclasses.replace(feats, tier_cached_len=0)
    assert assess.priced_tier(snap, no_tier, 0.02) is snap  # no tier hit: the cost model's figure stands


@pytest.mark.parametrize("path", ["decode/frontend.py", "sim/decode_sim.py"])
def test_neither_caller_builds_the_admissions_inputs_itself(path):
    """Both go through router/assess.py: a `RequestFeatures(...)` or `ClusterSnapshot(...)` built
    in either file is glue the other side does not share."""
    tree = ast.parse((REPO / path).read_text())
    built = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not built & {"RequestFeatures", "ClusterSnapshot"}, path
    assert {"request_features", "cluster_snapshot", "priced_tier"} <= built, path
    for mod in (frontend_mod, decode_sim):
        assert mod.request_features is assess.request_features
        assert mod.cluster_snapshot is assess.cluster_snapshot
        assert mod.priced_tier is assess.priced_tier


# -- one situation through both workers ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Situation:
    """What a decode worker reads at one admission, as plain values."""

    prompt_len: int = 600
    max_tokens: int = 24
    cached: int = 0  # its pool's prefix hit
    hint: tuple = ()  # (prefill worker, tokens of the prefix it holds)
    tier: int = 0  # its second tier's tokens past the pool's hit
    tier_ms_per_token: float = 0.0  # the tier's measured load cost
    queue_depth: int = 0
    queue_tokens: int = 0
    pool_size: int = 1
    pending_requests: int = 0
    pending_tokens: int = 0
    decoding: int = 0
    local_prefilling: int = 0
    backlog: int = 0
    kv_usage: float = 0.0
    free_blocks: int = 1000
    block_size: int = 16
    rate: float = 0.0
    budget: int | None = None


SITUATIONS = [
    Situation(),
    Situation(cached=512, hint=(("prefill-0", 512),), decoding=3, rate=1.5, budget=256),
    Situation(cached=128, hint=(("prefill-0", 256), ("prefill-1", 544)), queue_depth=2, queue_tokens=1200,
              pool_size=2, pending_requests=1, pending_tokens=400, decoding=6, local_prefilling=2, backlog=350,
              kv_usage=0.4, free_blocks=300, rate=3.0, budget=512),
    Situation(cached=64, tier=448, tier_ms_per_token=0.004, queue_depth=0, pending_requests=3, pending_tokens=900,
              decoding=9, kv_usage=0.8, free_blocks=12),
    Situation(tier=320, tier_ms_per_token=0.0, pool_size=0, decoding=2, local_prefilling=1, backlog=600),
]


class _Stop(Exception):
    """Raised by the stand-in admission once the frontend has built its inputs."""


def through_the_frontend(s: Situation, monkeypatch):
    """`Frontend._admit` on a worker whose engine, remote path and counters are these values;
    the admission it would call receives (features, snapshot)."""
    ids = list(range(1, s.prompt_len + 1))
    connector = SimpleNamespace(cached_prefix_len=lambda tokens, salt=None: s.cached,
                                tier_prefix_len=lambda tokens, cached, salt=None: s.tier,
                                tier_load_ms_per_token=lambda: s.tier_ms_per_token)
    load = SimpleNamespace(kv_usage=s.kv_usage, num_free_blocks=s.free_blocks)
    # the engine as the frontend reads it (decode/async_engine.py), with the step plan's
    # prediction for the planned streams (decoding + prefilling) and backlog
    streams = s.decoding + s.local_prefilling + s.pending_requests

    def predicted(tokens, cached, planned, backlog):
        assert (planned, backlog) == (streams, s.backlog)
        return s.budget

    engine = SimpleNamespace(connector=connector, load=lambda: load, block_size=s.block_size,
                             prompts_left=lambda rids: dict.fromkeys(rids), predicted_prefill_budget=predicted,
                             in_flight=None,
                             spec_outlook=lambda streams: (None, 1.0))  # neither speculates
    remote = SimpleNamespace(view=PrefillView(pool_size=s.pool_size, queue_depth=s.queue_depth,
                                              queue_tokens=s.queue_tokens),
                             prefix_view=SimpleNamespace(cached_tokens=lambda tokens: dict(s.hint)),
                             available=lambda: s.pool_size > 0, peers=None,
                             pending_requests=s.pending_requests, pending_tokens=s.pending_tokens)
    fe = Frontend.__new__(Frontend)
    fe.engine, fe.remote, fe.plan_local_prefill = engine, remote, True
    fe.policy = SimpleNamespace(policy=DEFAULT_POLICY, costs=SimpleNamespace(snapshot=lambda: COSTS))
    fe.arrivals = SimpleNamespace(observe=lambda t: None, rate=lambda now: s.rate)
    fe.num_decoding = s.decoding
    fe.num_prefilling = s.local_prefilling + s.pending_requests
    fe._local_prefills = {"local-0": s.backlog} if s.backlog else {}
    seen = []

    def admit(feats, snap, policy):
        seen.append((feats, snap))
        raise _Stop

    monkeypatch.setattr(frontend_mod, "admit", admit)
    inp = GenerateInput(prompt=ids, params=SamplingParams(max_tokens=s.max_tokens))
    with pytest.raises(_Stop):
        asyncio.run(fe._admit(inp, 0.0, ids, SamplingParams(max_tokens=s.max_tokens), Priority.NORMAL, "label"))
    return seen[0]


def through_the_simulator(s: Situation):
    """`DecodeSim.assess` on a simulated worker whose engine, cluster and counters are these values."""
    r = SimRequest(rid=1, t=0.0, prompt_len=s.prompt_len, output_len=s.max_tokens)
    ids = list(range(1, s.prompt_len + 1))
    d = DecodeSim.__new__(DecodeSim)
    d.engine = SimpleNamespace(cached_prefix_len=lambda rid, tokens: s.cached,
                               tier_prefix_len=lambda tokens, cached: s.tier,
                               tier_load_ms_per_token=lambda: s.tier_ms_per_token,
                               kv=SimpleNamespace(usage=s.kv_usage, num_free_blocks=s.free_blocks,
                                                  block_size=s.block_size),
                               scheduler=SimpleNamespace(predicted_budget=lambda *a: s.budget))
    queue = type("Queue", (), {"__len__": lambda self: s.queue_depth, "queued_tokens": s.queue_tokens})()
    d.sim = SimpleNamespace(now=0.0, queue=queue, live_prefill=lambda: [object()] * s.pool_size,
                            prefix_hint=lambda tokens: dict(s.hint) if s.pool_size else {})
    d.state = SimpleNamespace(policy=DEFAULT_POLICY, costs=SimpleNamespace(snapshot=lambda: COSTS))
    d.arrivals = SimpleNamespace(rate=lambda now: s.rate)
    d.pending_remote_requests, d.pending_remote_tokens = s.pending_requests, s.pending_tokens
    d.num_decoding = s.decoding
    d.num_prefilling = s.local_prefilling + s.pending_requests
    d.local_backlog = lambda: s.backlog
    d.in_flight = None
    _, _, feats, snap, _ = d.assess(r, "rid-1", ids)
    return feats, snap


@pytest.mark.parametrize("situation", SITUATIONS, ids=range(len(SITUATIONS)))
def test_the_same_situation_gives_the_same_inputs_in_the_worker_and_the_simulator(situation, monkeypatch):
    real = through_the_frontend(situation, monkeypatch)
    simulated = through_the_simulator(situation)
    assert simulated[0] == real[0]  # RequestFeatures
    assert simulated[1] == real[1]  # ClusterSnapshot
    feats, snap = real
    # and the values are the situation's (the stand-ins are read, not defaulted)
    assert (feats.cached_len, feats.tier_cached_len) == (situation.cached, situation.tier)
    assert feats.remote_cached_len == (max((n for _, n in situation.hint), default=0) if situation.pool_size else 0)
    assert snap.prefill_pool_size == situation.pool_size and snap.decode_active_requests == situation.decoding
    if situation.tier:
        assert snap.costs.tier_load_ms_per_token == situation.tier_ms_per_token
