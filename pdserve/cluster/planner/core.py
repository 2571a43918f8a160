"""The planner loop: observe, decide, record, act; one planner per cluster, state in etcd.

Every `interval_s` the planner takes a `Snapshot` (queue stats + every worker's
load record), derives per-role figures from it and the previous one, updates
what it has learned about capacity, decides per role (decide.py) and acts
through a backend: `start(role, worker_id)` for a new worker, and for a
scale-down a drain by etcd: the victim's drain key is written (its lease is
kept, so its peers keep serving what it holds), the worker finishes its
in-flight work and leaves the registry, then the backend stops its process.

Crash safety: the planner holds a leased leader key (one planner per cluster;
a second one waits), and its state (workers it is starting or draining, the
time of each role's last action, learned capacity, the decision sequence)
is written to etcd before each action. A restarted planner reads it back, so
it finishes a drain it had begun instead of starting another, and honours the
cooldown of an action taken by its previous incarnation.

Every decision goes to the log, to etcd (`planner/decisions/<seq>`, the last
`history` kept) and to Prometheus (desired vs actual replicas, decisions by
reason). The policy is the router package's autoscale policy, parsed by a
callable handed in (the control plane does not import the router); it is
reloaded from its file and from etcd's `config/autoscale`, and a version that
does not validate is refused with its key and line while the old one stays.

The loop is here; `Planner` takes its election from leader.py (`Leadership`), its
acting on decisions from act.py (`Acting`), and its state and metrics from state.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from pdserve.cluster.keys import ROLES
from pdserve.cluster.records import TRANSIENT_ERRORS, short_error
from pdserve.cluster.registry import Registry

from pdserve.cluster.planner.act import Acting
from pdserve.cluster.planner.decide import Decision, decide, learn
from pdserve.cluster.planner.leader import Leadership
from pdserve.cluster.planner.observe import Observation, Snapshot, observe
from pdserve.cluster.planner.state import PlannerMetrics, PlannerState, PlannerStateError, current_replicas

if TYPE_CHECKING:
    from pdserve.cluster.watch import PolicyWatch

log = logging.getLogger(__name__)

LEADER_TTL_S = 10
HISTORY = 200
RECONCILE_S = 1.0  # how often starts and drains in progress are checked between decisions


class Planner(Leadership, Acting):
    """One cluster's planner. `backend` has async `start(role, worker_id)` and `stop(worker_id)`;
    `queue_stats()` returns the prefill queue's stats as a dict (None when unreachable);
    `parse_policy(text, source)` returns the autoscale policy (raises naming key and line);
    `units[role]`: budget units one replica uses on a CPU role (its CPUs), None for a GPU role
    (the policy's gpus_per_replica)."""

    def __init__(self, *, cluster: str, etcd_endpoints: list[str], policy: Any, backend,
                 queue_stats: Callable[[], Awaitable[dict | None]], units: dict[str, int | None],
                 parse_policy: Callable[[str, str], Any] | None = None, policy_path: str | None = None,
                 dry_run: bool = False, clock: Callable[[], float] = time.time, history: int = HISTORY,
                 leader_ttl_s: int = LEADER_TTL_S, metrics_host: str = "127.0.0.1", metrics_port: int | None = 0,
                 known_workers: Sequence[str] = (), etcd_tls=None, worker_slots: dict[str, int] | None = None):
        self.cluster = cluster
        self.registry = Registry(etcd_endpoints, cluster, tls=etcd_tls)  # etcd_tls: the operator identity
        self.keys = self.registry.keys
        self.policy = policy  # the parsed AutoscalePolicy; `.autoscale` is what decide() reads
        self.policy_source = policy_path or "initial"
        self.backend = backend
        self.queue_stats = queue_stats
        self.units = dict(units)
        self.parse_policy = parse_policy
        self.policy_path = policy_path
        self.dry_run = dry_run
        self.clock = clock
        self.history = history
        self.leader_ttl_s = leader_ttl_s
        self.id = f"planner-{uuid.uuid4().hex[:8]}"
        self.state = PlannerState()
        self.metrics = PlannerMetrics()
        self.metrics_host, self.metrics_port = metrics_host, metrics_port
        self.known_workers = list(known_workers)  # ids started outside the planner (the topology's)
        # Per role, how many ids <role>-0.. have an etcd identity (etcd.tls.workers): new workers
        # take the lowest free one, never one beyond. {}: ids are not bounded (they only grow).
        self.worker_slots = dict(worker_slots or {})
        self.prev: Snapshot | None = None  # the snapshot of the last decision
        self.recent: list[Snapshot] = []  # every tick's snapshot over the last few intervals (rates)
        self.last_decision_at: float | None = None
        self.leader = False
        self._lease = None
        self._keepalive: asyncio.Task[None] | None = None
        self._policy_mtime: int | None = None
        self._policy_watch: PolicyWatch | None = None
        self.log: list[str] = []  # recent events, newest last (for tests and `explain`)

    @property
    def section(self):
        return self.policy.autoscale

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def metrics_address(self) -> str | None:
        ep = self.metrics._endpoint
        return ep.address if ep is not None else None

    async def start(self, acquire_timeout_s: float | None = None) -> None:
        """Serve metrics, become leader, load state, follow the policy key in etcd."""
        self.metrics.serve(self.metrics_host, self.metrics_port)
        if not await self.acquire(acquire_timeout_s):
            raise TimeoutError(f"cluster {self.cluster} already has a planner (see planner/leader in etcd)")
        await self.load_state()
        if self.parse_policy is not None:
            parse = self.parse_policy  # (set once, by __init__)
            self._policy_watch = await self.registry.watch_policy(
                "autoscale", lambda text: parse(text, f"etcd {self.keys.policy('autoscale').decode()}"),
                on_change=lambda p: self._set_policy(p, "etcd"), on_reject=self._reject_policy)
        if self.policy_path:
            self._policy_mtime = _mtime(self.policy_path)
        self._event(f"planner {self.id} started (mode {self.section.mode}, interval {self.section.interval_s:g} s, "
                    f"{'dry run' if self.dry_run else 'acting through ' + getattr(self.backend, 'name', 'backend')})")

    async def close(self) -> None:
        await self._resign()
        await self.registry.close(deregister=False)
        self.metrics.close()

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until `stop` is set or leadership is lost."""
        while not stop.is_set() and self.leader:
            try:
                await self.tick()
            except TRANSIENT_ERRORS as exc:
                log.warning("planner tick: etcd unreachable (%s); next tick retries", short_error(exc))
            except Exception:  # noqa: BLE001  (a bad tick must not end the planner)
                log.exception("planner tick failed")
            try:
                await asyncio.wait_for(stop.wait(), min(RECONCILE_S, self.section.interval_s))
            except asyncio.TimeoutError:
                pass

    # -- state -----------------------------------------------------------------------------
    async def load_state(self) -> None:
        reply = await self.registry.client().get(self.keys.planner_state())
        self.state = PlannerState.from_json(None if reply is None else reply.value)
        snaps = await self.registry.client().get(self.keys.planner_snapshots())
        if snaps is not None:
            body = json.loads(snaps.value)
            if body.get("current"):
                self.prev = Snapshot.from_json(json.dumps(body["current"]))
                self.recent = [self.prev]
        if self.state.pending:
            self._event("resumed: " + ", ".join(f"{w} {p['state']}" for w, p in sorted(self.state.pending.items())))

    async def save_state(self) -> None:
        if not self.leader:
            raise PlannerStateError("not the leader: state not written")
        await self.registry.client().put(self.keys.planner_state(), self.state.to_json())

    # -- policy ----------------------------------------------------------------------------
    def _set_policy(self, policy, source: str) -> None:
        self.policy, self.policy_source = policy, source
        self.metrics.events.labels(event="policy_reloaded").inc()
        self._event(f"policy reloaded from {source} (mode {self.section.mode})")

    def _reject_policy(self, rejection) -> None:
        self.metrics.events.labels(event="policy_rejected").inc()
        self._event(f"policy refused, keeping the active one: {getattr(rejection, 'message', rejection)}",
                    level=logging.ERROR)

    def check_policy_file(self) -> None:
        """Reload the policy file if it changed; an invalid version is refused, the old stays."""
        if not self.policy_path or self.parse_policy is None:
            return
        mtime = _mtime(self.policy_path)
        if mtime is None or mtime == self._policy_mtime:
            return
        self._policy_mtime = mtime
        try:
            with open(self.policy_path) as f:
                policy = self.parse_policy(f.read(), self.policy_path)
        except Exception as exc:  # noqa: BLE001  (PolicyError names key and line)
            self._reject_policy(str(exc))
            return
        self._set_policy(policy, self.policy_path)

    # -- one tick --------------------------------------------------------------------------
    async def snapshot(self) -> Snapshot:
        return await take_snapshot(self.registry, self.queue_stats, self.clock)

    async def tick(self) -> list[Decision] | None:
        """Check starts and drains in progress; every `interval_s`, decide and act. Returns the
        decisions when it decided this tick."""
        self.check_policy_file()
        snap = await self.snapshot()
        await self.reconcile(snap)
        now = self.clock()
        past = self.recent
        keep_s = 3 * self.section.interval_s + 10.0
        self.recent = [s for s in self.recent if now - s.t <= keep_s] + [snap]
        if self.last_decision_at is not None and now - self.last_decision_at < self.section.interval_s:
            self._export(snap)
            return None
        self.last_decision_at = now
        obs = observe(past, snap, min_span_s=self.section.interval_s)
        learn(self.state.memory, obs)
        decisions = self.decide(obs, snap, now)
        await self.record(decisions, snap)
        if not self.dry_run:
            await self.act_all(decisions, snap)
        self.prev = snap
        await self.save_state()
        self._export(snap)
        return decisions

    def role_units(self) -> dict[str, int]:
        """Budget units per replica: a GPU role counts the policy's gpus_per_replica; a CPU
        role (units given at construction) counts its CPUs."""
        return {r: self.units.get(r) or getattr(self.section, r).gpus_per_replica for r in ROLES}

    def decide(self, obs: Observation, snap: Snapshot, now: float) -> list[Decision]:
        counted, _ = current_replicas(snap, self.state)
        busy = {r: sum(1 for p in self.state.pending.values() if p["role"] == r) for r in ROLES}
        return decide(self.section, obs, self.state.memory, current=counted, units=self.role_units(), now=now,
                      in_progress=busy)

    async def record(self, decisions: list[Decision], snap: Snapshot) -> None:
        """Log, count and store each decision; holds are stored when their reason changes."""
        client = self.registry.client()
        for d in decisions:
            self.metrics.decisions.labels(role=d.role, action=d.action, reason=d.reason).inc()
            body = {**d.to_dict(), "dry_run": self.dry_run, "planner": self.id, "policy": self.policy_source}
            previous = self.state.last.get(d.role, {})
            self.state.last[d.role] = {k: body[k] for k in ("action", "reason", "current", "desired", "at", "dry_run")}
            self.state.desired[d.role] = d.desired
            if d.action == "hold" and previous.get("reason") == d.reason and previous.get("action") == "hold":
                continue
            self.state.seq += 1
            body["seq"] = self.state.seq
            await client.put(self.keys.planner_decision(self.state.seq), json.dumps(body).encode())
            level = logging.INFO if d.action == "hold" else logging.WARNING
            log.log(level, "planner decision %d: %s%s | %s", self.state.seq, d.summary(),
                    " [dry run]" if self.dry_run else "", " | ".join(d.explanation))
            self.log.append(f"decision {self.state.seq}: {d.summary()}")
        cutoff = self.state.seq - self.history
        if cutoff > 0:
            await client.delete_range(self.keys.planner_decisions_prefix(), self.keys.planner_decision(cutoff + 1))
        snaps = {"previous": None if self.prev is None else json.loads(self.prev.to_json()),
                 "current": json.loads(snap.to_json())}
        await client.put(self.keys.planner_snapshots(), json.dumps(snaps).encode())

    def _export(self, snap: Snapshot) -> None:
        counted, serving = current_replicas(snap, self.state)
        for role in ROLES:
            self.metrics.actual.labels(role=role).set(len(serving[role]))
            self.metrics.desired.labels(role=role).set(self.state.desired.get(role, counted[role]))
            self.metrics.starting.labels(role=role).set(len(self.state.pending_ids(role, "starting")))
            self.metrics.draining.labels(role=role).set(len(self.state.pending_ids(role, "draining")))

    def _event(self, text: str, level: int = logging.INFO) -> None:
        log.log(level, "planner: %s", text)
        self.log.append(text)
        del self.log[:-200]


async def take_snapshot(registry: Registry, queue_stats: Callable[[], Awaitable[dict | None]],
                        clock: Callable[[], float] = time.time) -> Snapshot:
    """The registered workers' records and the queue's stats (None when it cannot be reached)."""
    members = await registry.members()
    try:
        queue = await queue_stats()
    except Exception as exc:  # noqa: BLE001  (a queue restarting: decide on the workers alone)
        log.warning("planner: queue stats unavailable (%r)", exc)
        queue = None
    return Snapshot(t=clock(), queue=queue, workers={w: {"role": m.role, "load": dict(m.load)}
                                                    for w, m in members.items()})


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


