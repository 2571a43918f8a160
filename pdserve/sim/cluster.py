"""The discrete-event simulation of an XpYd cluster: the product's decisions on a simulated clock.

Events (arrivals, engine steps, queue hops, KV arrivals, load reports, planner ticks) are
taken from one heap in time order; ties keep the order they were made in, and every random
draw comes from one seeded generator, so a run is a function of its inputs (same seed, same
result).

What is the product's own code, called as the workers call it:

* admission and the local/remote decision: `router.admit` (which calls `router.decide`) on the
  `RequestFeatures` and `ClusterSnapshot` that `decode/assess.py` builds from the worker's
  values, the very functions `decode/frontend.py` builds them with: the prompt's hit in this
  worker's pool (its prefix cache), what each prefill worker holds of it (`remote_cached_len`;
  in the product the KV index's hint, here read off the simulated prefill workers' pools and
  tiers at once, without the index's event lag), what this worker's second tier holds past
  its pool (`tier_cached_len`, when the profile gives workers a tier) and the tier's load
  cost; `peer_reads` is False (prefix loans are not simulated), as the product sets it for a
  worker that does not borrow. The hint also rides on each remote task (`prefix_hint`), so
  the queue's prefix-aware dispatch is the product's too; with the decode worker's own
  `CostModel` (`decode/policy_state.py` `PolicyState`), calibrated at boot from simulated
  steps of `engine/calibrate.py`'s shapes and fed every simulated step, transfer, remote
  prefill and TTFT as `decode/worker.py`, `decode/kv_arrival.py` and `decode/breakdown.py`
  feed it;
* each engine's step plan: `engine/scheduler.py` over `engine/block_manager.py` (sim/engine.py),
  with the decode worker's SLO-aware budget kept current by `decode/prefill_budget.py`
  `StepPlanFeed`;
* the prefill queue: `cluster/queue/core.py` `QueueCore` (order, budgeted batches, prefix-aware
  dispatch) with `handoff` `PrefillTask`s;
* the front door across decode workers: `gateway/pick.py` `choose` (``ingress: gateway``);
* autoscaling: `cluster/planner/observe.py` and `cluster/planner/decide.py` on load records the simulated
  workers publish (sim/autoscale.py).

A prefill worker pushes KV as prefill/batch.py does (``push_as_computed``): a request's KV
transfer starts when the engine step its prefill ends in is over, not when the batch's last
step is; and as there, the batch goes on (its next step, or its next batch) only once the
writes it posted are over.

What is modelled: step times (sim/profile.py), the KV transfer, tier loads and queue hops, and
the made-up tokens (every request runs to its output length, as with ``ignore_eos``).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import random
from dataclasses import dataclass

from pdserve.common import Priority
from pdserve.common.block_hash import block_hashes
from pdserve.decode.assess import cluster_snapshot, priced_tier, request_features
from pdserve.decode.policy_state import PolicyState
from pdserve.decode.prefill_budget import StepPlanFeed
from pdserve.engine import calibrate
from pdserve.engine.step_budget import attention_pairs
from pdserve.gateway.pick import WorkerState, choose
from pdserve.kvtransfer.task import PrefillTask
from pdserve.router import ArrivalRate, ClusterSnapshot, RouterPolicy, admit
from pdserve.cluster.queue.core import QueueCore

from .engine import SimEngine, SimTier, StreamLoad
from .profile import CostProfile
from .workload import SimRequest

INGRESS = ("round_robin", "random", "gateway")
LOAD_REPORT_S = 1.0  # how often a simulated worker's load record refreshes (the gateway reads it)
SAMPLE_EVERY_S = 1.0  # queue depth and busy workers over time, for the report
# An idle prefill worker's long poll (prefill/worker.py poll_timeout_ms): a put wakes it at once,
# and without one it takes again after this long (a task the queue kept for the worker holding
# its prefix, cluster/queue/core.py `_keep_for_prefix`, is handed to another at such a take).
POLL_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class SimTopology:
    """How many workers of each role, their tensor-parallel sizes, and how requests get in."""

    prefill: int = 0
    decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    ingress: str = "round_robin"  # round_robin | random | gateway (gateway/pick.py, by predicted TTFT)

    def __post_init__(self):
        if self.decode < 1 or self.prefill < 0:
            raise ValueError(f"a topology needs decode >= 1 and prefill >= 0 (got {self.prefill}P{self.decode}D)")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("tensor-parallel sizes must be >= 1")
        if self.ingress not in INGRESS:
            raise ValueError(f"ingress must be one of {', '.join(INGRESS)} (got {self.ingress!r})")

    @property
    def label(self) -> str:
        if self.prefill == 0:
            tp = "" if self.decode_tp == 1 else f" (TP {self.decode_tp})"
        else:
            tp = "" if self.prefill_tp == self.decode_tp == 1 else f" (TP {self.prefill_tp}/{self.decode_tp})"
        return f"{self.prefill}P{self.decode}D{tp}"

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp


@dataclass
class RequestRecord:
    """What happened to one request (sim/report.py summarises them)."""

    rid: int
    arrival: float
    prompt_len: int
    output_len: int
    priority: str
    worker: str = ""
    refused: str | None = None  # the admission's reason code when refused
    held_since: float | None = None  # held for KV room (qos.kv_full_wait_ms) from then
    route: str = ""
    reason: str = ""
    predicted_ttft_ms: float = 0.0  # the route taken's
    predicted_local_ms: float = 0.0  # both routes' predictions, as a real worker's breakdown gives them
    predicted_remote_ms: float = 0.0
    cached_len: int = 0
    remote_cached_len: int = 0  # the most a prefill worker held of its prompt at admission (the hint)
    tier_cached_len: int = 0  # what its decode worker's second tier held past cached_len then
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    tokens: int = 0
    max_itl_ms: float = 0.0
    fell_back: bool = False


@dataclass
class _Track:
    """A request in flight on a decode worker (what decode/frontend.py keeps per stream)."""

    rec: RequestRecord
    eff: int
    remote: bool
    decision: object
    residual_ms: float
    gateway_units: int = 0
    req: object = None  # the engine's Request (its prefill's progress)
    backlog: int = 0  # the local backlog at admission (decode/ingress.py Prepared.local_backlog)


class Simulation:
    """One run: ``Simulation(...).run()`` returns the records and the event counts."""

    def __init__(self, requests: list[SimRequest], profile: CostProfile, policy: RouterPolicy,
                 topology: SimTopology, *, seed: int = 0, prefill_profile: CostProfile | None = None,
                 calibrate_at_boot: bool = True, autoscale=None):
        self.requests = requests
        self.profile = profile
        self.prefill_profile = prefill_profile or profile
        self.policy = policy
        self.topology = topology
        self.rng = random.Random(seed)
        # Host stalls (CostProfile.stall_*): their own draws, so a profile without them runs as before.
        self._stall_rng = random.Random(seed * 7919 + 17)
        self._next_stall = (self._stall_rng.expovariate(profile.stall_rate_per_s)
                            if profile.stall_rate_per_s > 0 and profile.stall_median_ms > 0 else math.inf)
        self.stalls: list[tuple[float, float]] = []  # (start s, length ms) of the stalls that happened
        self.stream_load = StreamLoad()  # every decode worker's streams, for a profile whose workers share a host
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.events = 0
        self.open = 0  # requests arrived that have neither finished nor been refused
        self.records: list[RequestRecord] = []
        self.itls_ms: list[float] = []
        self.samples: list[dict] = []  # over time: queue depth, in flight, busy workers
        self.queue = QueueCore(capacity=1 << 30, clock=lambda: self.now)
        self.decode: list[DecodeSim] = []
        self.prefill: list[PrefillSim] = []
        self.retired: list = []  # workers drained by the autoscaler (their figures still count)
        self._calibrate = calibrate_at_boot
        for i in range(topology.decode):
            self.add_decode(f"decode-{i}")
        for i in range(topology.prefill):
            self.add_prefill(f"prefill-{i}")
        self._rr = itertools.count()
        self.autoscale = autoscale  # sim/autoscale.py Autoscaler, or None
        if autoscale is not None:
            autoscale.attach(self)

    # -- the clock --------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self, until_s: float | None = None) -> Simulation:
        for r in self.requests:
            self.at(r.t, self._arrive, r)
        self.at(0.0, self._sample)
        self.at(0.0, self._report_loads)
        self._last_arrival = max((r.t for r in self.requests), default=0.0)
        heap = self._heap
        while heap:
            if heap[0][0] >= self._next_stall:
                self._stall(heap)
                continue
            t, _, fn, args = heapq.heappop(heap)
            if until_s is not None and t > until_s:
                break
            self.now = t
            self.events += 1
            fn(*args)
            if t > self._last_arrival and self._idle():
                break  # only the periodic events are left
        return self

    def _stall(self, heap: list) -> None:
        """The host stops at ``_next_stall`` for a drawn time: every event due from then on
        happens that much later (a step under way ends later, an arrival is sent later)."""
        prof, start = self.profile, self._next_stall
        ms = prof.stall_median_ms * self._stall_rng.lognormvariate(0.0, prof.stall_sigma)
        heap[:] = [(t + ms / 1e3, *rest) if t >= start else (t, *rest) for t, *rest in heap]
        heapq.heapify(heap)
        if self._last_arrival >= start:
            self._last_arrival += ms / 1e3
        self.stalls.append((start, ms))
        self._next_stall = start + ms / 1e3 + self._stall_rng.expovariate(prof.stall_rate_per_s)

    def _idle(self) -> bool:
        return self.open == 0 and all(not d.inflight for d in self.decode) and not len(self.queue) and all(
            not p.jobs for p in self.prefill)

    # -- workers ----------------------------------------------------------------------
    def add_decode(self, wid: str) -> DecodeSim:
        d = DecodeSim(self, wid, self.profile.step(self.topology.decode_tp))
        self.decode.append(d)
        return d

    def add_prefill(self, wid: str) -> PrefillSim:
        p = PrefillSim(self, wid, self.prefill_profile.step(self.topology.prefill_tp))
        self.prefill.append(p)
        if len(self.queue):
            p.poll()
        return p

    def live_prefill(self) -> list[PrefillSim]:
        return [p for p in self.prefill if not p.draining]

    def prefix_hint(self, token_ids: list[int]) -> dict[str, int]:
        """Per live prefill worker, the tokens of this prompt's prefix it holds (pool or tier),
        0s left out: what the KV index tells a decode worker (cluster/kvindex/service.py cached_tokens,
        over every full block of the prompt), read at once here (the index follows KV events)."""
        live = self.live_prefill()
        if not live:
            return {}
        bs = self.prefill_profile.block_size
        hashes = block_hashes(token_ids, bs)
        hint = {}
        for p in live:
            n = p.engine.held_prefix_len(hashes)
            if n:
                hint[p.wid] = n
        return hint

    def beat(self) -> None:
        """Every live prefill worker is heard from now: in the product each beats the queue every
        0.25 s, busy or idle, and the queue's prefix-aware dispatch keeps a task only for a live
        worker (cluster/queue/liveness.py)."""
        for p in self.prefill:
            if not p.draining:
                self.queue.alive(p.wid)

    # -- arrivals and the front door ----------------------------------------------------
    def _arrive(self, r: SimRequest) -> None:
        # sent now: r.t, unless a host stall held the client (its TTFT counts from the send)
        rec = RequestRecord(r.rid, self.now, r.prompt_len, r.output_len, r.priority)
        self.records.append(rec)
        self.open += 1
        live = [d for d in self.decode if not d.draining]
        ing = self.topology.ingress
        if len(live) == 1:
            worker = live[0]
        elif ing == "round_robin":
            worker = live[next(self._rr) % len(live)]
        elif ing == "random":
            worker = self.rng.choice(live)
        else:
            by = {d.wid: d for d in live}
            pick = choose([d.gateway for d in live], r.prompt_len, {}, self.now, self.rng)
            worker = by[pick.chosen]
        rec.worker = worker.wid
        overhead = self.profile.request_overhead_ms + self.profile.request_ms_per_prompt_token * r.prompt_len
        if overhead:  # the way in (and out: the same ms, for TTFT) outside the engine
            self.at(self.now + overhead / 1e3, worker.arrive, r, rec)
        else:
            worker.arrive(r, rec)

    def workers(self, role: str) -> list:
        """Every worker of ``role`` the run had, those the autoscaler retired included."""
        live = self.decode if role == "decode" else self.prefill
        return live + [w for w in self.retired if isinstance(w, DecodeSim if role == "decode" else PrefillSim)]

    def kick_prefill(self) -> None:
        for p in self.prefill:
            if p.idle and not p.draining:
                p.poll()

    # -- periodic ---------------------------------------------------------------------
    def _sample(self) -> None:
        self.samples.append({
            "t": round(self.now, 3), "queue_depth": len(self.queue),
            "in_flight": sum(len(d.inflight) for d in self.decode),
            "decode_workers": len(self.decode), "prefill_workers": len(self.prefill),
            "prefill_busy": sum(1 for p in self.prefill if p.jobs),
        })
        self.at(self.now + SAMPLE_EVERY_S, self._sample)

    def _report_loads(self) -> None:
        for d in self.decode:
            d.gateway.set_load(d.load_record())
        self.at(self.now + LOAD_REPORT_S, self._report_loads)


class DecodeSim:
    """A decode worker: its engine, its cost model and policy, and the frontend's counters."""

    def __init__(self, sim: Simulation, wid: str, model):
        self.sim, self.wid = sim, wid
        prof = sim.profile
        self.engine = _engine(sim, model, prof, sim.topology.decode_tp, streams=True)
        self._wake_at: float | None = None  # a wake-up already set for a tier load (`_step`)
        self.state = PolicyState(prof.kv_bytes_per_token, sim.policy)
        if sim._calibrate:
            self.state.costs.calibrate(_calibration_steps(model, prof))
        self.feed = StepPlanFeed(self._apply_plan, self._apply_fixed)
        self._update_plan()
        self.arrivals = ArrivalRate()
        self.inflight: dict[str, _Track] = {}
        self.pending_remote_tokens = self.pending_remote_requests = 0
        self.local_prefills: dict[str, _Track] = {}  # local, first token not yet out
        self.num_prefilling = self.num_decoding = 0
        self.stepping = False
        self.in_flight: tuple[float, int, int, int] | None = None  # the step under way (decode/async_engine.py)
        self.draining = False
        self.gateway = WorkerState(wid, "")
        self.started_at, self.ended_at = sim.now, None
        self.counts = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "decode_steps": 0,
                       "decode_ms": 0.0, "decode_seqs": 0, "mixed_steps": 0, "mixed_ms": 0.0}
        self._ids = itertools.count()
        # Prompts held for KV room (qos.kv_full_wait_ms), in arrival order: (request, record, id, until).
        self.held: collections.deque[tuple[SimRequest, RequestRecord, str, float]] = collections.deque()

    # -- the engine's plan (decode/worker.py _update_step_plan) ----------------------------
    def _apply_plan(self, cost, targets) -> None:
        self.engine.scheduler.step_cost, self.engine.scheduler.step_targets = cost, targets

    def _apply_fixed(self, tokens: int) -> None:
        self.engine.scheduler.prefill_token_budget = tokens

    def _update_plan(self) -> None:
        q = self.state.policy.qos
        self.feed.update(self.state.costs.snapshot(), q.tpot_slo_ms, q.ttft_slo_ms)

    # -- admission and routing (decode/frontend.py prepare) --------------------------------
    def snapshot(self, tokens: int, cached: int) -> ClusterSnapshot:
        """decode/frontend.py snapshot: the same function (decode/assess.py) on this worker's values."""
        sim, eng = self.sim, self.engine
        costs = self.state.costs.snapshot()
        backlog = self.local_backlog()
        return cluster_snapshot(
            costs, queue_depth=len(sim.queue), queue_tokens=sim.queue.queued_tokens,
            pool_size=len(sim.live_prefill()), pending_remote_requests=self.pending_remote_requests,
            pending_remote_tokens=self.pending_remote_tokens, num_decoding=self.num_decoding,
            num_prefilling=self.num_prefilling, local_backlog=backlog, kv_usage=eng.kv.usage,
            kv_free_tokens=eng.kv.num_free_blocks * eng.kv.block_size,
            arrival_rate_per_s=self.arrivals.rate(sim.now),
            # decode/worker.py _predicted_budget
            local_prefill_budget_tokens=eng.scheduler.predicted_budget(
                tokens, cached, self.num_decoding + self.num_prefilling, backlog),
            step_in_flight_ms=costs.step_left_ms(self.in_flight, sim.now),
        )

    def assess(self, r: SimRequest, rid: str, ids: list[int]):
        """decode/frontend.py `_admit`'s assess(): the prompt's hit in this worker's pool, what the
        prefill workers hold of it, what this worker's tier holds past its pool; the features
        and the snapshot built by decode/assess.py; the product's admission on them. Returns
        (cached, hint, features, snapshot, admission)."""
        eng = self.engine
        cached = eng.cached_prefix_len(rid, ids)
        hint = self.sim.prefix_hint(ids)
        feats = request_features(len(ids), cached, priority=r.priority, ttft_slo_ms=r.ttft_slo_ms, route="auto",
                                 max_tokens=r.output_len, resumed=False, hint=hint,
                                 tier_cached_len=eng.tier_prefix_len(ids, cached),
                                 peer_reads=False)  # prefix loans are not simulated (docs/simulator.md)
        snap = priced_tier(self.snapshot(max(0, len(ids) - cached), cached), feats, eng.tier_load_ms_per_token())
        return cached, hint, feats, snap, admit(feats, snap, self.state.policy)

    def local_backlog(self) -> int:
        """decode/frontend.py local_backlog: what the local prefills still have to compute."""
        return sum(min(t.eff, max(0, t.req.num_tokens - t.req.num_computed_tokens))
                   for t in self.local_prefills.values())

    def arrive(self, r: SimRequest, rec: RequestRecord) -> None:
        rid = f"{self.wid}-{next(self._ids)}"
        self.arrivals.observe(self.sim.now)
        wait_ms = self.state.policy.qos.kv_full_wait_ms
        self._admit(r, rec, rid, self.sim.now + wait_ms / 1e3 if wait_ms > 0 else None)

    def _retry_held(self) -> None:
        """decode/frontend.py _hold_for_room: after a step, the first prompt held for KV room is
        assessed again (then the next, while they get in); one past its wait is refused."""
        now = self.sim.now
        for entry in [e for e in self.held if e[3] <= now]:
            self.held.remove(entry)
            self._admit(*entry[:3], None)
        while self.held:
            r, rec, rid, deadline = self.held.popleft()
            if self._admit(r, rec, rid, deadline) == "held":
                return

    def _admit(self, r: SimRequest, rec: RequestRecord, rid: str, hold_until: float | None) -> str:
        sim = self.sim
        ids = r.token_ids()
        cached, hint, feats, snap, adm = self.assess(r, rid, ids)
        rec.cached_len = cached
        rec.remote_cached_len, rec.tier_cached_len = feats.remote_cached_len, feats.tier_cached_len
        if not adm.ok:
            if adm.reason == "kv_pool_full" and hold_until is not None and sim.now < hold_until:
                if rec.held_since is None:  # first refusal: to the back of the line
                    rec.held_since = sim.now
                    self.held.append((r, rec, rid, hold_until))
                else:  # the first in line, still without room: it stays first
                    self.held.appendleft((r, rec, rid, hold_until))
                return "held"
            rec.refused = adm.reason
            sim.open -= 1
            return "refused"
        d = adm.decision
        rec.route, rec.reason, rec.predicted_ttft_ms = d.route, d.reason, d.predicted_ttft_ms
        rec.predicted_local_ms, rec.predicted_remote_ms = d.predicted_ttft_local_ms, d.predicted_ttft_remote_ms
        max_tokens = adm.max_tokens or r.output_len
        eff = len(ids) - cached
        residual = (snap.costs.ttft_residual_remote_ms if d.route == "remote"
                    else snap.costs.ttft_residual_local_ms) if eff > 0 else 0.0
        req = self.engine.request(rid, ids, max_tokens, r.priority, sim.now)
        remote = d.route == "remote" and bool(sim.live_prefill())
        track = _Track(rec, eff, remote, d, residual, req=req, backlog=snap.local_prefill_queue_tokens)
        self.inflight[rid] = track
        self.num_prefilling += 1
        if sim.topology.ingress == "gateway":
            track.gateway_units = self.gateway.queued_tokens + eff
            self.gateway.queued_tokens += eff
            self.gateway.streams += 1
        if remote:
            res = self.engine.scheduler.add_remote(req)
            if res is None:  # no room for the reservation: local (decode/remote.py "no_kv_space")
                track.remote, rec.fell_back, rec.route = False, True, "local"
            else:
                self.pending_remote_tokens += eff
                self.pending_remote_requests += 1
                cached_len, blocks = res
                task = PrefillTask(request_id=rid, epoch=1, token_ids=ids, cached_len=cached_len,
                                   target_worker_id=self.wid, target_block_ids=blocks,
                                   priority=Priority.parse(r.priority), arrival_time=sim.now,
                                   prefix_hint=hint)  # decode/remote.py: the admission's hint
                sim.at(sim.now + sim.profile.queue_hop_ms / 1e3, self._put, task)
                return "admitted"
        self.local_prefills[rid] = track
        self.engine.scheduler.add(req)
        self.kick()
        return "admitted"

    def _put(self, task: PrefillTask) -> None:
        self.sim.queue.put(task)
        self.sim.kick_prefill()

    # -- the engine loop (decode/async_engine.py, decode/worker.py _on_step) ---------------
    def kick(self) -> None:
        if not self.stepping:
            self._step()

    def _step(self) -> None:
        out, info = self.engine.plan()
        if info is None:
            self.stepping = False
            # Only tier loads to wait for: the product's engine loop waits for one
            # (engine/llm_engine.py), so this worker steps again when the first is over.
            at = self.engine.next_load_at()
            if at is not None and self._wake_at != at:
                self._wake_at = at
                self.sim.at(max(at, self.sim.now), self._wake)
            return
        self.stepping = True
        self.in_flight = (self.sim.now, info.decodes, info.prompt_tokens, info.pairs)  # decode/async_engine.py
        self.sim.at(self.sim.now + info.ms / 1e3, self._stepped, out, info)

    def _stepped(self, out, info) -> None:
        self.in_flight = None
        emitted = self.engine.commit(out, info)
        for req, finished in emitted:
            self._token(req, finished)
        costs = self.state.costs
        costs.observe_step(info.ms, info.decodes, info.prompt_tokens, info.pairs)
        costs.observe_drain(self.sim.now, info.ms, info.prompt_tokens, self.local_backlog())
        if info.prompt_tokens == 0 and info.decodes:
            costs.observe_decode_step(info.ms, info.seqs)
            self.counts["decode_steps"] += 1
            self.counts["decode_ms"] += info.ms
            self.counts["decode_seqs"] += info.seqs
        elif info.prompt_tokens:
            self.counts["mixed_steps"] += 1
            self.counts["mixed_ms"] += info.ms
        self._update_plan()
        if self.held:
            self._retry_held()
        gap = self.sim.profile.stream_gap_ms_per_token * len(emitted)
        if gap > 0:  # the worker streams what the step emitted before it steps again
            self.sim.at(self.sim.now + gap / 1e3, self._step)
        else:
            self._step()

    def _wake(self) -> None:
        self._wake_at = None
        self.kick()

    def _token(self, req, finished: bool) -> None:
        track = self.inflight.get(req.request_id)
        if track is None:
            return
        rec, now = track.rec, self.sim.now
        if rec.first_token is None:
            rec.first_token = now
            self._prefill_done(track)
            self.num_decoding += 1
            self._check_prediction(track, (now - rec.arrival) * 1e3)
        else:
            gap = (now - rec.last_token) * 1e3
            self.sim.itls_ms.append(gap)
            rec.max_itl_ms = max(rec.max_itl_ms, gap)
        rec.last_token = now
        rec.tokens += 1
        self.counts["output_tokens"] += 1
        if finished:
            rec.finished = now
            self.sim.open -= 1
            self.num_decoding -= 1
            del self.inflight[req.request_id]
            if self.sim.topology.ingress == "gateway":
                self.gateway.streams -= 1

    def _prefill_done(self, track: _Track) -> None:
        if track.remote:
            self.pending_remote_tokens -= track.eff
            self.pending_remote_requests -= 1
        else:
            self.local_prefills.pop(track.req.request_id, None)
        self.num_prefilling -= 1
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += track.rec.prompt_len
        if self.sim.topology.ingress == "gateway":
            g = self.gateway
            g.queued_tokens -= track.eff
            g.observe_ttft((self.sim.now - track.rec.arrival) * 1e3, track.gateway_units, now=self.sim.now)

    def _check_prediction(self, track: _Track, measured_ms: float) -> None:
        """decode/breakdown.py check_prediction: the route's residual learns the error."""
        d = track.decision
        route = "remote" if track.remote else "local"
        if route != d.route or track.rec.fell_back or track.eff <= 0 or d.predicted_ttft_ms <= 0:
            return
        if route == "local" and track.backlog:
            return
        formula = d.predicted_ttft_ms - track.residual_ms
        outlier = self.state.policy.router.cost_model.ema_outlier_factor
        if formula > 0:
            measured_ms = min(max(measured_ms, formula / outlier), formula * outlier)
        self.state.costs.observe_ttft(route, measured_ms, formula)

    # -- the remote path (decode/kv_arrival.py) ---------------------------------------------
    def kv_arrived(self, task: PrefillTask, batch_tokens: int, prefill_ms: float, transfer_ms: float) -> None:
        track = self.inflight.get(task.request_id)
        if track is None:
            return
        sched = self.engine.scheduler
        req = sched.remote_ready(task.request_id)
        costs = self.state.costs
        # decode/kv_arrival.py: the prefill worker's speed is learned only from batches that
        # computed this prompt alone (a batch of several has another shape of attention work)
        if batch_tokens == len(task.token_ids) - task.cached_len and prefill_ms > 0:
            costs.observe_remote_prefill(batch_tokens, task.cached_len, prefill_ms)
        tokens = len(task.token_ids) - task.cached_len
        costs.observe_transfer(tokens * self.sim.profile.kv_bytes_per_token, transfer_ms)
        # the blocks written are the request's now (engine/kv_connector.py remote_ready)
        finished = self.engine.append(req, self.sim.now)
        self._token(req, finished)
        self.kick()

    # -- what the worker publishes (cluster/load.py) -------------------------------------------
    def load_record(self) -> dict:
        eng = self.engine
        sched = eng.scheduler
        return {"t": self.sim.now, "busy_s": eng.busy_ms / 1e3, "kv_usage": eng.kv.usage,
                "running": len(sched.running), "waiting": len(sched.waiting) + len(sched.remote),
                "inflight": len(self.inflight), **self.counts}


class PrefillSim:
    """A prefill worker: takes batches from the queue, computes them, sends each task's KV after
    the step its prefill ends in (prefill/batch.py)."""

    def __init__(self, sim: Simulation, wid: str, model):
        self.sim, self.wid = sim, wid
        prof = sim.prefill_profile
        self.engine = _engine(sim, model, prof, sim.topology.prefill_tp)
        self.jobs: dict[str, PrefillTask] = {}
        self.idle = True
        self.draining = False
        self.started_at, self.ended_at = sim.now, None
        self.tasks = 0
        self.batch_started = 0.0
        self._computed_before = 0  # the engine's prompt tokens computed when the batch started
        self._repoll_at: float | None = None
        # Each task's KV: (the step its prefill ended in, when its write landed), for tests and reports.
        self.pushed: dict[str, tuple[float, float]] = {}

    def poll(self) -> None:
        """get_batch: the next batch (prefill/worker.py), or idle until a put wakes it."""
        sim = self.sim
        if self.draining:
            self.idle = True
            return
        sim.beat()
        batch = sim.queue.take(self.wid, sim.prefill_profile.prefill_batch_tokens)
        if not batch:
            self.idle = True
            if len(sim.queue) and self._repoll_at is None:
                # what is queued was kept for another worker (prefix-aware dispatch): the long
                # poll takes again when it times out
                self._repoll_at = sim.now + POLL_TIMEOUT_S
                sim.at(self._repoll_at, self._repoll)
            return
        self.idle = False
        sim.at(sim.now + sim.prefill_profile.queue_hop_ms / 1e3, self._start, batch)

    def _repoll(self) -> None:
        self._repoll_at = None
        if self.idle and not self.draining:
            self.poll()

    def _start(self, batch: list[PrefillTask]) -> None:
        now = self.sim.now
        self.batch_started = now
        self._computed_before = self.engine.prompt_tokens_computed
        for t in batch:
            req = self.engine.request(t.request_id, t.token_ids, 1, t.priority, now)
            self.engine.scheduler.add(req)
            self.jobs[t.request_id] = t
        self._step()

    def _step(self) -> None:
        out, info = self.engine.plan()
        if info is None:
            at = self.engine.next_load_at()
            if at is None:
                raise RuntimeError(f"{self.wid}: a batch that cannot be scheduled (its prompt exceeds the KV pool)")
            self.sim.at(max(at, self.sim.now), self._step)  # only tier loads to wait for
            return
        self.sim.at(self.sim.now + info.ms / 1e3, self._stepped, out, info)

    def _stepped(self, out, info) -> None:
        sim = self.sim
        emitted = self.engine.commit(out, info)
        sim.queue.alive(self.wid)  # the worker's heartbeat carries its compute progress
        # prefill/batch.py push_as_computed: the tasks whose prefill ended in this step are
        # written and announced now, while the batch's other prompts go on. Their PrefillDone
        # reports the batch's time and the tokens it computed so far.
        done = [self.jobs[req.request_id] for req, _ in emitted if req.request_id in self.jobs]
        wait_ms = self._push(done) if done else 0.0
        # prefill/batch.py _push waits for the writes it posted before the batch goes on: its next
        # step, or (the batch over) the worker's next batch
        nxt = self._step if self.engine.has_work() else self._batch_over
        if wait_ms > 0:
            sim.at(sim.now + wait_ms / 1e3, nxt)
        else:
            nxt()

    def _push(self, done: list[PrefillTask]) -> float:
        """Send each task's KV to its decode worker; returns the longest write (ms)."""
        sim, prof = self.sim, self.sim.prefill_profile
        compute_ms = (sim.now - self.batch_started) * 1e3
        batch_tokens = self.engine.prompt_tokens_computed - self._computed_before
        target = {d.wid: d for d in sim.decode}
        longest = 0.0
        for t in done:
            tokens = len(t.token_ids) - t.cached_len
            tr = prof.transfer_ms(tokens, compute_ms)
            sim.at(sim.now + tr / 1e3, target[t.target_worker_id].kv_arrived, t, batch_tokens, compute_ms, tr)
            self.pushed[t.request_id] = (sim.now, sim.now + tr / 1e3)
            longest = max(longest, tr)
        return longest

    def _batch_over(self) -> None:
        self.sim.queue.complete(self.wid, list(self.jobs))
        self.tasks += len(self.jobs)
        self.jobs = {}
        if not self.draining:
            self.poll()
        else:
            self.idle = True

    def load_record(self) -> dict:
        eng = self.engine
        return {"t": self.sim.now, "busy_s": eng.busy_ms / 1e3, "kv_usage": eng.kv.usage,
                "tokens": eng.prompt_tokens_computed, "tasks": self.tasks, "inflight": len(self.jobs)}


def _engine(sim: Simulation, model, prof: CostProfile, tp: int, streams: bool = False) -> SimEngine:
    """A worker's engine on the simulation's clock and generator, with its profile's limits, the
    streaming load its steps contend with (its own, or the shared host's) and its second tier
    (``tier_blocks``; each rank holds its heads of a block, so a load moves 1/tp of it per rank)."""
    load = sim.stream_load if prof.contention_scope == "cluster" else StreamLoad()
    tier = None
    if prof.tier_blocks:
        tier = SimTier(prof.tier_blocks, max(1, prof.block_size * prof.kv_bytes_per_token // tp), prof.tier_gb_per_s,
                       lambda: sim.now)
    return SimEngine(model, block_size=prof.block_size, max_num_batched_tokens=prof.max_num_batched_tokens,
                     max_num_seqs=prof.max_num_seqs, clock=lambda: sim.now, rng=sim.rng, noise_cv=prof.noise_cv,
                     contention_ms_per_token=prof.contention_ms_per_token, load=load, streams=streams, tier=tier)


def _calibration_steps(model, prof: CostProfile) -> list[tuple[float, int, int, int]]:
    """The boot calibration's steps (engine/calibrate.py: the same shapes), timed by the model."""
    steps = []
    longest = prof.max_num_batched_tokens
    for n in calibrate.PROMPT_LENGTHS:
        if n <= longest:
            steps.append((model.step_ms(0, n, attention_pairs(n, 0)), 0, n, attention_pairs(n, 0)))
    chunk = min(calibrate.LONG_CHUNK, longest // 2)
    if chunk >= 64:
        for start in (0, chunk):
            pairs = attention_pairs(chunk, start)
            steps.append((model.step_ms(0, chunk, pairs), 0, chunk, pairs))
    for batch in calibrate.DECODE_BATCHES:
        for k in range(calibrate.DECODE_STEPS):
            steps.append((model.step_ms(batch, 0, 0, batch * (17 + k)), batch, 0, 0))
    pairs = attention_pairs(128, 0)
    steps.append((model.step_ms(max(calibrate.DECODE_BATCHES), 128, pairs, 8 * 20), 8, 128, pairs))
    return steps


def check_profile(profile: CostProfile, topology: SimTopology) -> None:
    """Refuse a run the profile cannot time (ProfileError names what is missing)."""
    profile.step(topology.decode_tp)
    if topology.prefill:
        profile.step(topology.prefill_tp)

