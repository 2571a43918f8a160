"""A simulated decode worker (`DecodeSim`): the product's admission, routing, cost model and
step plan on the simulation's clock (sim/cluster.py, which runs it).

Its admission builds the router's inputs with router/assess.py, the very functions
decode/frontend.py builds them with, and runs the product's `router.admit` on them; its cost
model is the router's `RouterState` (router/state.py), calibrated at boot from simulated steps
of engine/calibrate.py's shapes and fed as decode/worker.py, decode/kv_arrival.py and
decode/breakdown.py feed it; its engine's step plan is kept current by engine/step_plan.py
`StepPlanFeed`, as decode/worker.py keeps it.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common import Priority
from pdserve.engine import calibrate
from pdserve.engine.request import Request
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.step_budget import StepCost, StepTargets, attention_pairs
from pdserve.engine.step_plan import StepPlanFeed
from pdserve.gateway.pick import WorkerState
from pdserve.kvtransfer.task import PrefillTask
from pdserve.router import ArrivalRate, ClusterSnapshot, RequestFeatures, admit
from pdserve.router.assess import cluster_snapshot, priced_tier, request_features
from pdserve.router.qos import Admission
from pdserve.router.state import RouterState
from pdserve.router.values import Decision, Route

from .engine import StepInfo, worker_engine
from .profile import CostProfile, StepModel
from .records import RequestRecord
from .workload import SimRequest

if TYPE_CHECKING:
    from .cluster import Simulation


@dataclass
class _Track:
    """A request in flight on a decode worker (what decode/frontend.py keeps per stream)."""

    rec: RequestRecord
    eff: int
    remote: bool
    decision: Decision
    residual_ms: float
    req: Request  # the engine's Request (its prefill's progress)
    gateway_units: int = 0
    backlog: int = 0  # the local backlog at admission (decode/ingress.py Prepared.local_backlog)


class DecodeSim:
    """A decode worker: its engine, its cost model and policy, and the frontend's counters."""

    def __init__(self, sim: Simulation, wid: str, model: StepModel) -> None:
        self.sim, self.wid = sim, wid
        prof = sim.profile
        self.engine = worker_engine(model, prof, sim.topology.decode_tp, clock=lambda: sim.now, rng=sim.rng,
                                    shared_load=sim.stream_load, streams=True)
        self._wake_at: float | None = None  # a wake-up already set for a tier load (`_step`)
        self.state = RouterState(prof.kv_bytes_per_token, sim.policy)
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
        self.started_at: float = sim.now
        self.ended_at: float | None = None
        self.counts = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "decode_steps": 0,
                       "decode_ms": 0.0, "decode_seqs": 0, "mixed_steps": 0, "mixed_ms": 0.0}
        self._ids = itertools.count()
        # Prompts held for KV room (qos.kv_full_wait_ms), in arrival order: (request, record, id, until).
        self.held: collections.deque[tuple[SimRequest, RequestRecord, str, float]] = collections.deque()

    # -- the engine's plan (decode/worker.py _update_step_plan) ----------------------------
    def _apply_plan(self, cost: StepCost, targets: StepTargets) -> None:
        self.engine.scheduler.step_cost, self.engine.scheduler.step_targets = cost, targets

    def _apply_fixed(self, tokens: int) -> None:
        self.engine.scheduler.prefill_token_budget = tokens

    def _update_plan(self) -> None:
        q = self.state.policy.qos
        self.feed.update(self.state.costs.snapshot(), q.tpot_slo_ms, q.ttft_slo_ms)

    # -- admission and routing (decode/frontend.py prepare) --------------------------------
    def snapshot(self, tokens: int, cached: int) -> ClusterSnapshot:
        """decode/frontend.py snapshot: the same function (router/assess.py) on this worker's values."""
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
            # decode/frontend.py prefill_budget_tokens
            local_prefill_budget_tokens=eng.scheduler.predicted_budget(
                tokens, cached, self.num_decoding + self.num_prefilling, backlog),
            step_in_flight_ms=costs.step_left_ms(self.in_flight, sim.now),
        )

    def assess(self, r: SimRequest, rid: str, ids: list[int]
               ) -> tuple[int, dict[str, int], RequestFeatures, ClusterSnapshot, Admission]:
        """decode/frontend.py `_admit`'s assess(): the prompt's hit in this worker's pool, what the
        prefill workers hold of it, what this worker's tier holds past its pool; the features
        and the snapshot built by router/assess.py; the product's admission on them. Returns
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
        queued = False
        if remote:
            # the scheduler reserves its blocks (engine/remote_kv.py), here at once
            res = self.engine.scheduler.reserve_now(req)
            if res is None:  # no room: queued for a local prefill (decode/remote.py "no_kv_space")
                track.remote, rec.fell_back, rec.route = False, True, "local"
                queued = True
            else:
                self.pending_remote_tokens += eff
                self.pending_remote_requests += 1
                cached_len, blocks = res.cached_len, res.block_ids
                task = PrefillTask(request_id=rid, epoch=1, token_ids=ids, cached_len=cached_len,
                                   target_worker_id=self.wid, target_block_ids=blocks,
                                   priority=Priority.parse(r.priority), arrival_time=sim.now,
                                   prefix_hint=hint)  # decode/remote.py: the admission's hint
                sim.at(sim.now + sim.profile.queue_hop_ms / 1e3, self._put, task)
                return "admitted"
        self.local_prefills[rid] = track
        if not queued:
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

    def _stepped(self, out: SchedulerOutput, info: StepInfo) -> None:
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

    def _token(self, req: Request, finished: bool) -> None:
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
            assert rec.last_token is not None  # set with the first token
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
        route: Route = "remote" if track.remote else "local"
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


def _calibration_steps(model: StepModel, prof: CostProfile) -> list[tuple[float, int, int, int]]:
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
