"""How the planner acts on its decisions: starts, drains, role flips, and their follow-up.

`Acting` holds the `Planner` methods that change the cluster: an up-decision starts
workers under new ids (the lowest free slot where ids have an etcd identity), a
down-decision drains the serving workers holding the least work through their drain
key, a role flip moves a worker to the other role in place, and `reconcile` follows
each start and drain in progress until it registered, left, or timed out. Each is
written to the planner's state before the backend is called. The planner provides
`state`, `metrics`, `section`, `backend`, `registry`, `save_state` and `_event`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from pdserve.cluster.planner.decide import Decision
from pdserve.cluster.planner.observe import Snapshot
from pdserve.cluster.planner.state import current_replicas

if TYPE_CHECKING:
    from pdserve.cluster.planner.state import PlannerMetrics, PlannerState
    from pdserve.cluster.registry import Registry

log = logging.getLogger(__name__)


class NoWorkerSlot(RuntimeError):
    """Every worker id of a role that has an etcd identity (etcd.tls.workers) is in use."""


def _index_of(worker_id: str, role: str) -> int | None:
    prefix = f"{role}-"
    tail = worker_id[len(prefix):] if worker_id.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


class Acting:
    """The acting half of `Planner` (see the module docstring)."""

    # The Planner's (declared here for the checker; no value is set)
    state: PlannerState
    metrics: PlannerMetrics
    backend: Any
    registry: Registry
    id: str
    cluster: str
    clock: Callable[[], float]
    dry_run: bool
    known_workers: list[str]
    worker_slots: dict[str, int]
    if TYPE_CHECKING:
        @property
        def section(self) -> Any: ...

        async def save_state(self) -> None: ...

        def _event(self, text: str, level: int = logging.INFO) -> None: ...

    async def act_all(self, decisions: list[Decision], snap: Snapshot) -> None:
        """Act on one tick's decisions: role flips first (paired up/down), then the rest."""
        by = {d.role: d for d in decisions}
        flips = 0
        if all(d.reason == "role_flip" for d in decisions):
            up = next(d for d in decisions if d.action == "up")
            down = by["prefill" if up.role == "decode" else "decode"]
            flips = up.figures.get("flip", 0)
            for d in (up, down):
                self.state.memory.last_action_at[d.role] = d.at
            for victim in self._drain_victims(down.role, flips, snap):
                await self.flip(victim, up.role, snap)
        for d in decisions:
            if d.action != "hold":
                await self.act(d, snap, skip=flips)

    async def flip(self, wid: str, role: str, snap: Snapshot) -> None:
        """Move worker `wid` to `role` in place under a new worker id."""
        try:
            new = self._next_worker_id(role, snap)
        except NoWorkerSlot as exc:
            self.metrics.events.labels(event="no_worker_slot").inc()
            self._event(f"not flipping {wid}: {exc}", level=logging.ERROR)
            return
        actor = self.state.actor_of.pop(wid, None)
        now = self.clock()
        self.state.pending[wid] = {"role": snap.workers[wid]["role"], "state": "flipping", "since": now,
                                   "reason": "role_flip", "into": new}
        self.state.pending[new] = {"role": role, "state": "starting", "since": now, "reason": "role_flip",
                                   "flipped_from": wid}
        self.state.actor_of[new] = actor or self.backend.actor_name(wid)
        await self.save_state()
        self._event(f"flipping {wid} -> {new} (drains as {snap.workers[wid]['role']}, then serves as {role}; "
                    "engine kept)")
        try:
            await self.backend.flip(wid, role, new, actor=self.state.actor_of[new])
        except Exception as exc:  # noqa: BLE001  (the start timeout cleans up after it)
            self.metrics.events.labels(event="flip_failed").inc()
            self._event(f"flip of {wid} failed: {exc!r}", level=logging.ERROR)

    async def act(self, d: Decision, snap: Snapshot, skip: int = 0) -> None:
        """Start or drain `d.step` workers, less `skip` already moved by role flips."""
        self.state.memory.last_action_at[d.role] = d.at
        if d.action == "up":
            for _ in range(d.step - skip):
                try:
                    wid = self._next_worker_id(d.role, snap)
                except NoWorkerSlot as exc:
                    self.metrics.events.labels(event="no_worker_slot").inc()
                    self._event(f"not starting a {d.role} worker: {exc}", level=logging.ERROR)
                    break
                self.state.pending[wid] = {"role": d.role, "state": "starting", "since": self.clock(), "reason": d.reason}
                await self.save_state()  # before acting: a crash after the start still knows it
                self._event(f"starting {wid} ({d.reason})")
                try:
                    await self.backend.start(d.role, wid, flexible=bool(getattr(self.section, "allow_role_flip", False)))
                except Exception as exc:  # noqa: BLE001  (the backend refused: counted, retried later)
                    self.state.pending.pop(wid, None)
                    self.metrics.events.labels(event="start_failed").inc()
                    self._event(f"start of {wid} failed: {exc!r}", level=logging.ERROR)
        else:
            for wid in self._drain_victims(d.role, -d.step - skip, snap):
                self.state.pending[wid] = {"role": d.role, "state": "draining", "since": self.clock(), "reason": d.reason}
                await self.save_state()
                self._event(f"draining {wid} ({d.reason})")
                await self.registry.request_drain(wid, f"planner {self.id}: {d.reason}", revoke_lease=False)

    def _next_worker_id(self, role: str, snap: Snapshot) -> str:
        if role in self.worker_slots:
            return self._free_slot(role, snap)
        taken = set(snap.workers) | set(self.state.pending) | set(self.known_workers)
        start = self.state.next_index.get(role, 0)
        indexes = [i for i in (_index_of(w, role) for w in taken) if i is not None]
        n = max([start, *(i + 1 for i in indexes)])
        self.state.next_index[role] = n + 1
        return f"{role}-{n}"

    def _free_slot(self, role: str, snap: Snapshot) -> str:
        """The lowest `<role>-<n>` below the role's slot count that is free: not registered,
        not starting, draining or changing role, not the process of a worker that changed role
        (it keeps the actor name of the id it started under), and not one of the topology's
        own workers unless the planner stopped it (a restarting one is briefly unregistered)."""
        taken = set(snap.workers) | set(self.state.pending) | (set(self.known_workers) - set(self.state.stopped))
        taken |= {name.removeprefix(f"{self.cluster}-") for name in self.state.actor_of.values()}
        slots = self.worker_slots[role]
        for n in range(slots):
            if f"{role}-{n}" not in taken:
                return f"{role}-{n}"
        raise NoWorkerSlot(
            f"all {slots} {role} worker ids with an etcd identity ({role}-0 .. {role}-{slots - 1}) are in use; "
            f"raise etcd.tls.workers.slots.{role} (default: the larger of roles.{role}.replicas and the autoscale "
            "policy's max_replicas), issue the new ids' certificates (`pdserve certs workers DIR --topology FILE`) "
            "and restart the cluster so that etcd gets their users")

    def _drain_victims(self, role: str, n: int, snap: Snapshot) -> list[str]:
        """The `n` serving workers of `role` holding the least work (newest first on ties)."""
        _, serving = current_replicas(snap, self.state)

        def held(wid: str) -> tuple:
            load = snap.workers[wid].get("load") or {}
            work = load.get("inflight", 0) + load.get("running", 0) + load.get("waiting", 0)
            return work, -(_index_of(wid, role) or 0)

        return sorted(serving[role], key=held)[:n]

    async def reconcile(self, snap: Snapshot) -> None:
        """Starts that registered or timed out; drains that finished or timed out."""
        now, changed = self.clock(), False
        for wid, p in sorted(self.state.pending.items()):
            age = now - p["since"]
            if p["state"] == "starting":
                if wid in snap.workers:
                    del self.state.pending[wid]
                    self.metrics.events.labels(event="started").inc()
                    self._event(f"{wid} registered {age:.1f} s after its start")
                elif age > self.section.start_timeout_s:
                    del self.state.pending[wid]
                    await self._stop(wid)
                    self.metrics.events.labels(event="start_timeout").inc()
                    self._event(f"{wid} did not register within start_timeout_s "
                                f"{self.section.start_timeout_s:g}; stopped", level=logging.ERROR)
                else:
                    continue
            elif p["state"] == "flipping":
                if wid in snap.workers and age <= self.section.drain_timeout_s:
                    continue
                del self.state.pending[wid]
                self.state.stopped = [w for w in self.state.stopped if w != wid][-99:] + [wid]
                if wid in snap.workers:
                    self.metrics.events.labels(event="flip_drain_timeout").inc()
                    self._event(f"{wid} did not leave within drain_timeout_s while changing role", level=logging.ERROR)
                else:
                    self.metrics.events.labels(event="flipped").inc()
                    self._event(f"{wid} drained and left its role ({age:.1f} s); it comes back as {p.get('into')}")
            else:
                if wid not in snap.workers:
                    await self._stop(wid)
                    del self.state.pending[wid]
                    self.metrics.events.labels(event="drained").inc()
                    self._event(f"{wid} drained in {age:.1f} s and stopped")
                elif age > self.section.drain_timeout_s:
                    await self.registry.request_drain(wid, f"planner {self.id}: drain timed out")
                    await self._stop(wid)
                    del self.state.pending[wid]
                    self.metrics.events.labels(event="drain_timeout").inc()
                    self._event(f"{wid} still held work after drain_timeout_s {self.section.drain_timeout_s:g}; "
                                "its lease was revoked and it was stopped", level=logging.ERROR)
                else:
                    continue
            changed = True
        if changed:
            await self.save_state()

    async def _stop(self, wid: str) -> None:
        if self.dry_run:
            return
        self.state.stopped = [w for w in self.state.stopped if w != wid][-99:] + [wid]
        try:
            await self.backend.stop(wid, actor=self.state.actor_of.pop(wid, None))
        except Exception as exc:  # noqa: BLE001  (already gone)
            log.warning("planner: stopping %s: %r", wid, exc)
