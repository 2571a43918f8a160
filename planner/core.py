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
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

from pdserve.control.keys import ROLES
from pdserve.control.records import TRANSIENT_ERRORS, short_error
from pdserve.control.registry import Registry

from .decide import Decision, Memory, decide, learn
from .observe import Observation, Snapshot, observe

log = logging.getLogger(__name__)

LEADER_TTL_S = 10
HISTORY = 200
RECONCILE_S = 1.0  # how often starts and drains in progress are checked between decisions


class PlannerStateError(RuntimeError):
    """The planner's etcd state could not be read or written."""


class NoWorkerSlot(RuntimeError):
    """Every worker id of a role that has an etcd identity (etcd.tls.workers) is in use."""


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
        from pdserve.control.runtime import MetricsEndpoint

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
    serving = {r: [] for r in ROLES}
    for wid, rec in snapshot.workers.items():
        if rec.get("role") in serving and state.pending.get(wid, {}).get("state") not in ("draining", "flipping"):
            serving[rec["role"]].append(wid)
    counted = {r: len(serving[r]) + sum(1 for w in state.pending_ids(r, "starting") if w not in snapshot.workers)
               for r in ROLES}
    return counted, {r: sorted(v) for r, v in serving.items()}


def _index_of(worker_id: str, role: str) -> int | None:
    prefix = f"{role}-"
    tail = worker_id[len(prefix):] if worker_id.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


class Planner:
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
                 known_workers: list[str] = (), etcd_tls=None, worker_slots: dict[str, int] | None = None):
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
        self._keepalive: asyncio.Task | None = None
        self._policy_mtime: int | None = None
        self._policy_watch = None
        self.log: list[str] = []  # recent events, newest last (for tests and `explain`)

    @property
    def section(self):
        return self.policy.autoscale

    # -- leadership ------------------------------------------------------------------------
    async def acquire(self, timeout_s: float | None = None) -> bool:
        """Become the cluster's planner: create the leased leader key, or wait for the current
        holder's lease to end (`timeout_s` None: wait for ever). True once leader."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        client = self.registry.client()
        key, waited = self.keys.planner_leader(), False
        while True:
            try:
                lease = await client.lease(self.leader_ttl_s)
                value = json.dumps({"planner": self.id, "host": socket.gethostname(), "pid": os.getpid(),
                                    "since": self.clock(), "metrics": self.metrics_address}).encode()
                ok, _ = await client.transaction(compare=[client.transactions.create(key) == 0],
                                                 success=[client.transactions.put(key, value, lease=lease.id)],
                                                 failure=[])
                if ok:
                    self._lease, self.leader = lease.id, True
                    self._keepalive = asyncio.get_running_loop().create_task(self._keep_leadership())
                    log.info("planner %s is the planner of cluster %s", self.id, self.cluster)
                    return True
                await client.revoke_lease(lease.id)
            except TRANSIENT_ERRORS as exc:
                log.warning("planner: etcd unreachable while electing (%s)", short_error(exc))
            if not waited:
                holder = await self.leader_record()
                log.info("planner %s: cluster %s already has a planner (%s); waiting for it to go",
                         self.id, self.cluster, holder)
                waited = True
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(1.0)

    async def leader_record(self) -> dict | None:
        reply = await self.registry.client().get(self.keys.planner_leader())
        return None if reply is None else json.loads(reply.value)

    async def _keep_leadership(self) -> None:
        client = self.registry.client()
        while True:
            await asyncio.sleep(self.leader_ttl_s / 3)
            try:
                reply = await client.refresh_lease(self._lease)
            except TRANSIENT_ERRORS as exc:
                log.warning("planner: leader lease refresh failed (%s)", short_error(exc))
                continue
            if reply is None or reply.TTL <= 0:
                log.error("planner %s lost its leader lease; it stops acting", self.id)
                self.leader = False
                return

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
            self._policy_watch = await self.registry.watch_policy(
                "autoscale", lambda text: self.parse_policy(text, f"etcd {self.keys.policy('autoscale').decode()}"),
                on_change=lambda p: self._set_policy(p, "etcd"), on_reject=self._reject_policy)
        if self.policy_path:
            self._policy_mtime = _mtime(self.policy_path)
        self._event(f"planner {self.id} started (mode {self.section.mode}, interval {self.section.interval_s:g} s, "
                    f"{'dry run' if self.dry_run else 'acting through ' + getattr(self.backend, 'name', 'backend')})")

    async def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
        if self._lease is not None and self.leader:
            try:
                await self.registry.client().revoke_lease(self._lease)
            except TRANSIENT_ERRORS:
                pass
        self.leader = False
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

    # -- acting ----------------------------------------------------------------------------
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
