"""`pdserve worker`: run ONE prefill or decode worker of a topology on this node.

What a Kubernetes pod (deploy/helm/pdserve) runs after `ray start --address=...`, and
what a `ray up` node can run: it joins the Ray cluster as a driver, makes sure the
prefill queue exists with the topology's settings, starts one worker actor through
`cluster.launcher.start_worker_actor` (the one way workers are started) placed on this
node (`node:<this node's address>`), waits for its `start()`, prints its endpoints and
blocks. SIGTERM or SIGINT drains the worker (no new work, in-flight work finishes, it
leaves etcd) and stops its actor; the process then exits 0. A worker actor that is gone
for good (Ray gave up restarting it) ends the process with 1, so that its supervisor
(kubelet) starts a fresh one.

`--check` validates every argument and the topology, prints what would run and exits
without starting anything (the chart's tests run it on every rendered command).

Worker replicas started this way all use the topology's base ports (replica 0): each
runs on a node (pod) of its own with its own address.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.observability_args import add_observability_flags, with_observability

if TYPE_CHECKING:  # (`plan` and `--check` load neither Ray nor torch: imports are where they are used)
    from pdserve.cluster.actors import StartedWorker
    from pdserve.cluster.topology import Topology

START_TIMEOUT_S = 1800.0  # loading a large model from a network volume can take many minutes
DEFAULT_DRAIN_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0  # the actor's drain() (already done) and stop() calls, each
LIVENESS_EVERY_S = 5.0
PLACEMENT = 0.01  # of the node's own `node:<address>` resource: placement, not capacity


@dataclass
class WorkerPlan:
    """A `pdserve worker` invocation, validated: what it will start and where."""

    topology_file: str
    topology: Topology
    role: str
    worker_id: str
    etcd_endpoints: list[str]
    ray_address: str
    model: str  # a directory, or "auto" (made on start)
    drain_timeout_s: float

    def describe(self) -> str:
        t = self.topology
        return (f"{self.role} worker {self.worker_id} of cluster {t.cluster}: model {self.model}, "
                f"etcd {','.join(self.etcd_endpoints)}, ray {self.ray_address} (auth {t.ray.auth}), "
                f"namespace {t.ray.namespace}, "
                f"drain timeout {self.drain_timeout_s:g} s")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "worker", help="run one prefill or decode worker on this node (Kubernetes pods, ray up nodes)",
        description=(
            "Join the Ray cluster, start ONE worker of the topology on this node (a Ray actor placed "
            "on this node's address) and block. SIGTERM/SIGINT drains it (no new work, in-flight work "
            "finishes, it leaves etcd), stops it and exits 0. Run it after `ray start --address=...` "
            "on the node; every worker started this way listens on the topology's base ports. "
            "--check validates the arguments and the topology and exits without starting anything."))
    p.add_argument("--role", required=True, choices=("prefill", "decode"), help="which worker to run")
    p.add_argument("--topology", required=True, metavar="FILE", help="topology YAML (configs/topologies/*.yaml)")
    p.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="the Ray head's GCS address (default: the topology's ray.address, else the one "
                        "`pdserve up` recorded for this cluster on this host). 'auto' joins whatever cluster "
                        "Ray's current-cluster file names, which the last `ray start` on the host overwrote: "
                        "never a default")
    p.add_argument("--etcd", default=None, metavar="ENDPOINTS",
                   help="etcd endpoints host:port[,host:port] (default: the topology's etcd.endpoints, else "
                        "those `pdserve up` recorded for this cluster on this host; with etcd.gate: the "
                        "gate's endpoint, which `pdserve up` prints)")
    p.add_argument("--worker-id", default=None, metavar="ID",
                   help="this worker's id in etcd, e.g. the pod name (default: <role>-<hostname>)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="model directory (default: the topology's model.path)")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM, how long in-flight work may take to finish (default: %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="validate the arguments and the topology, print the plan, start nothing")
    add_observability_flags(p)
    p.set_defaults(func=run)


def _recorded(topo):
    """What `pdserve up` recorded for this topology's cluster on this host (its state file), or None."""
    from pdserve.state import ClusterState, state_path

    path = state_path(topo)
    try:
        return ClusterState.load(path) if path.is_file() else None
    except (OSError, ValueError, TypeError):  # unreadable: as if absent (the flags then say what is missing)
        return None


def plan(args) -> WorkerPlan:
    """Validate `args` (ValueError naming the flag at fault); imports neither Ray nor torch."""
    from pdserve.cluster.keys import check_name, parse_endpoints
    from pdserve.cluster.topology import TopologyError, load_topology
    from pdserve.ray_auth import token_source

    if not Path(args.topology).is_file():
        raise ValueError(f"--topology {args.topology}: no such file")
    try:
        topo = load_topology(args.topology)
    except TopologyError as exc:
        raise ValueError(f"--topology {exc}") from None
    try:
        token_source(topo.ray, topo.resolve)  # with ray.auth: token, a token must be there
    except ValueError as exc:
        raise ValueError(f"--topology {args.topology}: {exc}") from None
    topo = with_observability(topo, args)  # --otlp-traces-*, --log-format over its observability section
    recorded = _recorded(topo)
    role = args.role
    if role == "prefill" and topo.roles.prefill.replicas == 0:
        raise ValueError(f"--role prefill: the topology {args.topology} has roles.prefill.replicas 0, so its decode "
                         "workers never send remote prefills; set the count there first")
    if args.etcd is not None:
        endpoints = [e.strip() for e in args.etcd.split(",") if e.strip()]
        try:
            parse_endpoints(endpoints)
        except ValueError as exc:
            raise ValueError(f"--etcd {args.etcd!r}: {exc}") from None
    elif topo.etcd.endpoints:
        endpoints = list(topo.etcd.endpoints)
    elif recorded is not None:
        endpoints = recorded.worker_etcd_endpoints
    else:
        raise ValueError("no etcd endpoints: pass --etcd HOST:PORT[,HOST:PORT] or set etcd.endpoints in "
                         f"{args.topology} (a worker started on its own cannot start an embedded etcd)")
    worker_id = args.worker_id if args.worker_id is not None else f"{role}-{socket.gethostname()}"
    check_name("--worker-id", worker_id)
    try:
        topo.worker_etcd_tls(worker_id)  # with etcd TLS, this worker's certificate (or the shared one)
    except ValueError as exc:
        raise ValueError(f"--topology {args.topology}: {exc}") from None
    if not args.drain_timeout > 0:
        raise ValueError(f"--drain-timeout {args.drain_timeout:g}: must be > 0 seconds")
    # Always a named cluster: a bare "auto" joins what Ray's current-cluster file names, and a
    # second cluster started on this host takes that file over.
    ray_address = args.ray_address or topo.ray.address or (recorded.ray_address if recorded is not None else None)
    if not ray_address:
        raise ValueError(f"no Ray cluster named: pass --ray-address HOST:PORT, set ray.address in {args.topology}, "
                         f"or start the cluster with `pdserve up --topology {args.topology}` on this host first "
                         "(its address is then read from the state file). --ray-address auto joins whatever "
                         "Ray cluster this host's last `ray start` made")
    if ray_address != "auto":
        host, sep, port = ray_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            flag = "--ray-address" if args.ray_address else "ray.address (topology)"
            raise ValueError(f"{flag} {ray_address!r} must look like host:port or be 'auto'")
    if args.model is not None:
        if not args.model.strip():
            raise ValueError("--model: empty path")
        model = args.model
    else:
        model = "auto" if topo.model.is_auto else str(topo.model_path)
    return WorkerPlan(args.topology, topo, role, worker_id, endpoints, ray_address, model, args.drain_timeout)


def run(args) -> int:
    p = plan(args)
    if args.check:
        print(f"OK: {p.describe()}")
        return 0
    return Worker(p).run()


class Worker:
    """Owns this process's Ray connection and the one worker actor it started."""

    def __init__(self, p: WorkerPlan):
        self.p = p
        self.stop = threading.Event()
        self.started: StartedWorker | None = None

    def say(self, line: str) -> None:
        print(f"pdserve worker: {line}", flush=True)

    def run(self) -> int:
        import ray

        from pdserve.protection import exposure_warnings
        from pdserve.ray_auth import apply_ray_auth

        p = self.p
        ray_auth = apply_ray_auth(p.topology)  # before ray.init: this driver and its workers
        for warning in exposure_warnings(p.topology, p.ray_address):
            self.say(f"WARNING: {warning}")
        self.say(f"ray {p.ray_address}: {ray_auth}")
        self._handle_signals()
        model = self._model()
        ray.init(address=p.ray_address, namespace=p.topology.ray.namespace, log_to_driver=False)
        self._handle_signals()  # again: a Ray driver's own SIGTERM handler exits at once (sys.exit)
        try:
            node = self._node_address()
            self._ensure_queue()
            return self._serve(model, node)
        finally:
            if self.started is not None:
                self._shutdown(self.started)
            ray.shutdown()

    def _handle_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())

    def _model(self) -> str:
        if self.p.model == "auto":
            from pdserve.engine.model_maker import resolve_model

            return resolve_model(self.p.topology)
        if not Path(self.p.model).is_dir():
            raise FileNotFoundError(f"--model / model.path {self.p.model}: not a directory on this node")
        return self.p.model

    def _node_address(self) -> str:
        """This process's Ray node address: what `node:<address>` places the actor on."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node["NodeID"] == node_id:
                return node["NodeManagerAddress"]
        raise RuntimeError(f"this process's Ray node {node_id} is not in the cluster's node list")

    def _ensure_queue(self) -> None:
        """The prefill queue with the topology's settings, detached (it outlives this driver).
        The first worker of the cluster creates it; an existing queue keeps its settings."""
        from pdserve.cluster.queue import get_or_create_queue

        t = self.p.topology
        q = t.queue
        get_or_create_queue(q.name, t.ray.namespace, q.capacity, detached=True, wire_bind=q.wire,
                            on_head=True, wire_tls=q.server_tls(t.resolve), stall_s=q.stall_timeout_s)

    def _serve(self, model: str, node: str) -> int:
        import ray

        from pdserve.launcher import start_worker_actor

        p = self.p
        self.started = started = start_worker_actor(p.topology, p.role, 0, model=model,
                                                    etcd_endpoints=p.etcd_endpoints, worker_id=p.worker_id,
                                                    resources={f"node:{node}": PLACEMENT})
        self.say(f"starting {p.describe()} on node {node}")
        deadline = time.monotonic() + START_TIMEOUT_S
        info = None
        while info is None:
            if self.stop.is_set():
                self.say("stopped before the worker finished starting")
                return 0
            try:
                info = ray.get(started.start_ref, timeout=1.0)
            except ray.exceptions.GetTimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{p.worker_id} did not start within {START_TIMEOUT_S:.0f} s") from None
        self.say(f"ready {json.dumps({'role': p.role, 'node': node, **info}, sort_keys=True)}")
        next_check = time.monotonic() + LIVENESS_EVERY_S
        while not self.stop.wait(0.5):
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + LIVENESS_EVERY_S
                try:
                    ray.get_actor(started.name, namespace=p.topology.ray.namespace)
                except ValueError:  # a dead detached actor's name is released: Ray gave up on it
                    self.say(f"{p.worker_id}: its actor is dead and Ray no longer restarts it; exiting 1")
                    self.started = None
                    return 1
        return 0

    def _shutdown(self, started: StartedWorker) -> None:
        """Drain (bounded by the drain timeout), stop the actor, clear this worker's drain key."""
        import ray

        from pdserve.cluster.actors import stop_actor

        p, name = self.p, started.name
        self.say(f"draining {p.worker_id} (up to {p.drain_timeout_s:g} s)")
        try:
            actor = ray.get_actor(name, namespace=p.topology.ray.namespace)
            deadline = time.monotonic() + p.drain_timeout_s
            ray.get(actor.drain.remote(p.drain_timeout_s), timeout=p.drain_timeout_s + 5)
            _wait_idle(actor, p.role, deadline)
        except Exception as exc:  # noqa: BLE001  (stop_actor kills a dead or stuck worker anyway)
            self.say(f"drain of {p.worker_id}: {exc.__class__.__name__}: {exc}")
        stop_actor(name, p.topology.ray.namespace, STOP_TIMEOUT_S, self.say)
        self.started = None
        _clear_drain_key(p)


def _wait_idle(actor, role: str, deadline: float) -> None:
    """Until the worker holds no request, or `deadline`. A decode worker's drain started by
    its etcd drain key (the preStop hook's `pdserve drain`) waits only the worker's default
    time, and a second drain() waits for that first one: requests longer than it would be
    cut by stop(). Its `stats()` says how many are still in flight."""
    import ray

    if role != "decode":
        return  # a prefill worker's drain() waits for its batch itself
    while time.monotonic() < deadline:
        if not ray.get(actor.stats.remote(), timeout=10).get("inflight"):
            return
        time.sleep(0.1)


def _clear_drain_key(p: WorkerPlan) -> None:
    """The drain key is not leased; a pod's worker id never comes back, so remove it now.
    Under etcd RBAC the worker identity may not (drain/ is the operator's): the key stays,
    and a worker started again under this id ignores it (cluster/join.py)."""
    import asyncio

    from pdserve.cluster.registry import Registry

    async def go() -> int:
        async with Registry(p.etcd_endpoints, p.topology.cluster, tls=p.topology.worker_etcd_tls(p.worker_id)) as reg:
            return await reg.clear_drain(p.worker_id)

    try:
        left = asyncio.run(asyncio.wait_for(go(), 10.0))
    except Exception as exc:  # noqa: BLE001  (a left-over key only matters if the id is reused)
        print(f"pdserve worker: could not clear the drain key of {p.worker_id}: {exc!r}", file=sys.stderr)
        return
    if left:
        print(f"pdserve worker: the drain key of {p.worker_id} stays (the worker identity may not delete it)",
              file=sys.stderr)
