"""What the planner keeps: its state in etcd, its metrics, and the readers of its records.

`PlannerState` is what a planner must not forget across a restart (workers it is
starting, draining or moving to the other role, learned capacity, the decision
sequence), written as JSON at `planner/state` before each action. `PlannerMetrics`
are its Prometheus figures. `current_replicas` counts each role's replicas from a
snapshot and the state. `read_planner`, `read_decisions` and `reset_planner` read
and clear a planner's records for `pdserve planner status`/`explain` and `up`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pdserve.cluster.keys import ROLES
from pdserve.cluster.registry import Registry

from pdserve.cluster.planner.decide import Memory
from pdserve.cluster.planner.observe import Snapshot


class PlannerStateError(RuntimeError):
    """The planner's etcd state could not be read or written."""


@dataclass
class PlannerState:
    """What a planner must not forget across a restart (JSON at planner/state)."""

    memory: Memory = field(default_factory=Memory)
    # worker_id -> {"role", "state": "starting" | "draining", "since": wall time, "reason"}
    pending: dict[str, dict] = field(default_factory=dict)
    next_index: dict[str, int] = field(default_factory=dict)
    seq: int = 0  # last decision sequence number written
    last: dict[str, dict] = field(default_factory=dict)  # role -> its latest decision (any action)
    desired: dict[str, int] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)  # workers it drained and stopped (newest last, bounded)
    # worker_id -> the process (Ray actor name) serving it, for workers that changed role in
    # place: their process keeps the name of the id it started under.
    actor_of: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        body = asdict(self)
        body["memory"] = self.memory.to_dict()
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> "PlannerState":
        if not raw:
            return cls()
        body = json.loads(raw)
        return cls(memory=Memory.from_dict(body.get("memory")), pending=dict(body.get("pending") or {}),
                   next_index={k: int(v) for k, v in (body.get("next_index") or {}).items()},
                   seq=int(body.get("seq", 0)), last=dict(body.get("last") or {}),
                   desired={k: int(v) for k, v in (body.get("desired") or {}).items()},
                   stopped=list(body.get("stopped") or []), actor_of=dict(body.get("actor_of") or {}))

    def pending_ids(self, role: str, state: str) -> list[str]:
        return sorted(w for w, p in self.pending.items() if p["role"] == role and p["state"] == state)


class PlannerMetrics:
    """Prometheus figures of the planner (its own registry; served by `serve`)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = r = CollectorRegistry()
        self.desired = Gauge("pdserve_planner_desired_replicas", "Replicas the planner wants, per role", ["role"], registry=r)
        self.actual = Gauge("pdserve_planner_actual_replicas", "Replicas serving (registered, not draining)", ["role"], registry=r)
        self.starting = Gauge("pdserve_planner_starting_replicas", "Replicas started, not yet registered", ["role"], registry=r)
        self.draining = Gauge("pdserve_planner_draining_replicas", "Replicas draining", ["role"], registry=r)
        self.decisions = Counter("pdserve_planner_decisions", "Decisions by role, action and reason",
                                 ["role", "action", "reason"], registry=r)
        self.events = Counter("pdserve_planner_events", "Starts, drains and policy reloads by outcome", ["event"], registry=r)
        self._endpoint = None

    def serve(self, host: str, port: int | None) -> str | None:
        from pdserve.cluster.runtime import MetricsEndpoint

        if port == 0:
            return None
        self._endpoint = MetricsEndpoint(self.registry, host, port)
        return self._endpoint.address

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None


def current_replicas(snapshot: Snapshot, state: PlannerState) -> tuple[dict[str, int], dict[str, list[str]]]:
    """(replicas counted per role, serving worker ids per role): registered workers that are
    not draining or changing role, plus workers starting (or arriving from the other role)
    that have not registered yet."""
    serving: dict[str, list[str]] = {r: [] for r in ROLES}
    for wid, rec in snapshot.workers.items():
        if rec.get("role") in serving and state.pending.get(wid, {}).get("state") not in ("draining", "flipping"):
            serving[rec["role"]].append(wid)
    counted = {r: len(serving[r]) + sum(1 for w in state.pending_ids(r, "starting") if w not in snapshot.workers)
               for r in ROLES}
    return counted, {r: sorted(v) for r, v in serving.items()}


async def reset_planner(registry: Registry) -> None:
    """Forget a previous cluster's planner: its state, snapshots and decisions (not the leader
    key, which is leased). `pdserve up` calls it before it starts a new planner, since etcd's
    data directory outlives `down`; a planner restarted by Ray must not, and does not."""
    client = registry.client()
    await client.delete(registry.keys.planner_state())
    await client.delete(registry.keys.planner_snapshots())
    await client.delete_prefix(registry.keys.planner_decisions_prefix())


async def read_decisions(registry: Registry, limit: int = 20) -> list[dict]:
    """The last `limit` recorded decisions, oldest first."""
    reply = await registry.client().get_prefix(registry.keys.planner_decisions_prefix())
    items = sorted((kv.key, kv.value) for kv in reply)
    return [json.loads(v) for _, v in items[-limit:]]


async def read_planner(registry: Registry) -> dict:
    """The leader record, the state and the last snapshots, for `status` and `explain`."""
    client = registry.client()
    leader = await client.get(registry.keys.planner_leader())
    state = await client.get(registry.keys.planner_state())
    snaps = await client.get(registry.keys.planner_snapshots())
    return {"leader": None if leader is None else json.loads(leader.value),
            "state": PlannerState.from_json(None if state is None else state.value),
            "snapshots": None if snaps is None else json.loads(snaps.value)}
