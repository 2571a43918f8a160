"""The discrete-event simulation of an XpYd cluster: the product's decisions on a simulated clock.

Events (arrivals, engine steps, queue hops, KV arrivals, load reports, planner ticks) are
taken from one heap in time order; ties keep the order they were made in, and every random
draw comes from one seeded generator, so a run is a function of its inputs (same seed, same
result).

What is the product's own code, called as the workers call it:

* admission and the local/remote decision: `router.admit` (which calls `router.decide`) on the
  `RequestFeatures` and `ClusterSnapshot` that `router/assess.py` builds from the worker's
  values, the very functions `decode/frontend.py` builds them with: the prompt's hit in this
  worker's pool (its prefix cache), what each prefill worker holds of it (`remote_cached_len`;
  in the product the KV index's hint, here read off the simulated prefill workers' pools and
  tiers at once, without the index's event lag), what this worker's second tier holds past
  its pool (`tier_cached_len`, when the profile gives workers a tier) and the tier's load
  cost; `peer_reads` is False (prefix loans are not simulated), as the product sets it for a
  worker that does not borrow. The hint also rides on each remote task (`prefix_hint`), so
  the queue's prefix-aware dispatch is the product's too; with the decode worker's own
  `CostModel` (`router/state.py` `RouterState`, what decode/policy_state.py's `PolicyState`
  holds), calibrated at boot from simulated steps of `engine/calibrate.py`'s shapes and fed
  every simulated step, transfer, remote prefill and TTFT as `decode/worker.py`,
  `decode/kv_arrival.py` and `decode/breakdown.py` feed it;
* each engine's step plan: `engine/scheduler.py` over `engine/block_manager.py` (sim/engine.py),
  with the decode worker's SLO-aware budget kept current by `engine/step_plan.py`
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

The workers are sim/decode_sim.py (`DecodeSim`) and sim/prefill_sim.py (`PrefillSim`); what a
run is given and records, sim/records.py (`SimTopology`, `RequestRecord`).

What is modelled: step times (sim/profile.py), the KV transfer, tier loads and queue hops, and
the made-up tokens (every request runs to its output length, as with ``ignore_eos``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.common.block_hash import block_hashes
from pdserve.gateway.pick import choose
from pdserve.router import RouterPolicy
from pdserve.cluster.queue.core import QueueCore

from .decode_sim import DecodeSim
from .engine import StreamLoad
from .prefill_sim import PrefillSim
from .profile import CostProfile
from .records import RequestRecord, SimTopology
from .workload import SimRequest

if TYPE_CHECKING:
    from .autoscale import Autoscaler

__all__ = ["RequestRecord", "SimTopology", "Simulation", "check_profile"]

LOAD_REPORT_S = 1.0  # how often a simulated worker's load record refreshes (the gateway reads it)
SAMPLE_EVERY_S = 1.0  # queue depth and busy workers over time, for the report

# One event on the heap: (time s, sequence number: ties in the order they were made, call, its arguments).
_Event = tuple[float, int, Callable[..., object], tuple[Any, ...]]


class Simulation:
    """One run: ``Simulation(...).run()`` returns the records and the event counts."""

    def __init__(self, requests: list[SimRequest], profile: CostProfile, policy: RouterPolicy,
                 topology: SimTopology, *, seed: int = 0, prefill_profile: CostProfile | None = None,
                 calibrate_at_boot: bool = True, autoscale: Autoscaler | None = None) -> None:
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
        self._heap: list[_Event] = []
        self._seq = itertools.count()
        self.events = 0
        self.open = 0  # requests arrived that have neither finished nor been refused
        self.records: list[RequestRecord] = []
        self.itls_ms: list[float] = []
        self.samples: list[dict] = []  # over time: queue depth, in flight, busy workers
        self.queue = QueueCore(capacity=1 << 30, clock=lambda: self.now)
        self.decode: list[DecodeSim] = []
        self.prefill: list[PrefillSim] = []
        self.retired: list[DecodeSim | PrefillSim] = []  # workers drained by the autoscaler (their figures still count)
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
    def at(self, t: float, fn: Callable[..., object], *args: Any) -> None:
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

    def _stall(self, heap: list[_Event]) -> None:
        """The host stops at ``_next_stall`` for a drawn time: every event due from then on
        happens that much later (a step under way ends later, an arrival is sent later)."""
        prof, start = self.profile, self._next_stall
        ms = prof.stall_median_ms * self._stall_rng.lognormvariate(0.0, prof.stall_sigma)
        heap[:] = [(t + ms / 1e3, seq, fn, args) if t >= start else (t, seq, fn, args) for t, seq, fn, args in heap]
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
            assert pick.chosen is not None  # live workers, none excluded: one is chosen
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


def check_profile(profile: CostProfile, topology: SimTopology) -> None:
    """Refuse a run the profile cannot time (ProfileError names what is missing)."""
    profile.step(topology.decode_tp)
    if topology.prefill:
        profile.step(topology.prefill_tp)
