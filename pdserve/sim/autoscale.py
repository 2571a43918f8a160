"""The planner on the simulated clock: the product's observe, learn and decide, every
``interval_s``, on the load records the simulated workers publish.

Each tick builds a `planner.observe.Snapshot` (the queue's depth and tokens, each worker's
`load`, as cluster/load.py names its keys), calls `observe`, `learn` and `decide` (cluster/planner/)
with the workers serving plus those still starting, and acts as cluster/planner/act.py does: a
scale-up starts a worker that serves ``start_s`` later (loading weights, registering); a
scale-down drains the newest worker of the role (no new requests or tasks; it leaves once it
holds none). Role flips are acted as a drain and a start. Every decision is kept with its
explanation (the report prints them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.cluster.planner.decide import AutoscaleSection, Memory, decide, learn
from pdserve.cluster.planner.observe import Snapshot, observe

from .decode_sim import DecodeSim
from .prefill_sim import PrefillSim

if TYPE_CHECKING:
    from .cluster import Simulation

ROLES = ("prefill", "decode")


class Autoscaler:
    def __init__(self, section: AutoscaleSection, start_s: float = 30.0) -> None:
        """``section``: a parsed autoscale block (cluster/planner/policy.py AutoscaleSection)."""
        self.section = section
        self.start_s = start_s
        self.memory = Memory()
        self.recent: list[Snapshot] = []
        self.starting = {r: 0 for r in ROLES}
        self.decisions: list[dict] = []
        self._last: dict[str, str] = {}
        self.timeline: list[dict] = []  # (t, role, replicas) after each change
        self._sim: Simulation | None = None
        self._ids = itertools.count(100)

    def attach(self, sim: Simulation) -> None:
        self._sim = sim
        sim.at(self.section.interval_s, self.tick)

    @property
    def sim(self) -> Simulation:
        """The simulation this autoscaler acts on (set by `attach`)."""
        if self._sim is None:
            raise RuntimeError("the autoscaler is not attached to a simulation")
        return self._sim

    def units(self) -> dict[str, int]:
        topo = self.sim.topology
        return {"prefill": topo.prefill_tp, "decode": topo.decode_tp}

    def snapshot(self) -> Snapshot:
        sim = self.sim
        workers: dict[str, dict] = {}
        for d in sim.decode:
            workers[d.wid] = {"role": "decode", "load": d.load_record()}
        for p in sim.prefill:
            workers[p.wid] = {"role": "prefill", "load": p.load_record()}
        queue = {"depth": len(sim.queue), "queued_tokens": sim.queue.queued_tokens}
        return Snapshot(t=sim.now, queue=queue, workers=workers)

    def serving(self, role: str) -> list[DecodeSim | PrefillSim]:
        workers: Sequence[DecodeSim | PrefillSim] = self.sim.decode if role == "decode" else self.sim.prefill
        return [w for w in workers if not w.draining]

    def tick(self) -> None:
        sim, sec = self.sim, self.section
        now = sim.now
        snap = self.snapshot()
        keep_s = 3 * sec.interval_s + 10.0
        past = self.recent
        self.recent = [s for s in self.recent if now - s.t <= keep_s] + [snap]
        obs = observe(past, snap, min_span_s=sec.interval_s)
        learn(self.memory, obs)
        current = {r: len(self.serving(r)) + self.starting[r] for r in ROLES}
        decisions = decide(sec, obs, self.memory, current=current, units=self.units(), now=now,
                           in_progress=dict(self.starting))
        for d in decisions:
            if d.action != "hold" or self._last.get(d.role) != d.reason:  # a hold is kept when its reason changes
                self._last[d.role] = d.reason
                self.decisions.append({"t": round(now, 3), "role": d.role, "action": d.action, "reason": d.reason,
                                       "current": d.current, "desired": d.desired,
                                       "explanation": " | ".join(d.explanation)})
            if d.action == "hold":
                continue
            self.memory.last_action_at[d.role] = now
            if d.action == "up":
                for _ in range(d.step):
                    self.starting[d.role] += 1
                    sim.at(now + self.start_s, self._started, d.role)
            else:
                newest = sorted(self.serving(d.role), key=lambda w: w.started_at, reverse=True)
                for w in newest[:-d.step]:
                    self._drain(w)
        if not sim._idle() or sim.now < max((r.t for r in sim.requests), default=0.0):
            sim.at(now + sec.interval_s, self.tick)

    def _started(self, role: str) -> None:
        sim = self.sim
        self.starting[role] -= 1
        wid = f"{role}-{next(self._ids)}"
        sim.add_decode(wid) if role == "decode" else sim.add_prefill(wid)
        self._note(role)

    def _drain(self, worker: DecodeSim | PrefillSim) -> None:
        worker.draining = True
        self._note("decode" if isinstance(worker, DecodeSim) else "prefill")
        self._leave_when_idle(worker)

    def _leave_when_idle(self, worker: DecodeSim | PrefillSim) -> None:
        sim = self.sim
        busy = worker.inflight if isinstance(worker, DecodeSim) else worker.jobs
        if busy:
            sim.at(sim.now + 1.0, self._leave_when_idle, worker)
            return
        if isinstance(worker, DecodeSim):
            sim.decode.remove(worker)
        else:
            sim.prefill.remove(worker)
        worker.ended_at = sim.now
        sim.retired.append(worker)

    def _note(self, role: str) -> None:
        self.timeline.append({"t": round(self.sim.now, 3), "role": role, "serving": len(self.serving(role)),
                              "starting": self.starting[role]})
