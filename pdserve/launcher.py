"""Start, inspect and stop an XpYd deployment described by a topology file.

`Launcher.up()` brings up, in order: etcd (embedded when the topology names
no endpoint), Ray (joins `--ray-address`, else starts a head for this
cluster), the prefill queue actor, the prefill and decode workers (detached
Ray actors built from the topology's entry-point strings, cluster/actors.py,
each given its config dict from cluster/worker_config.py), then waits until
every worker is registered in etcd and every decode worker answers gRPC
health. It writes what it started to a state file (pdserve/state.py) so that
`status` and `down` work from any later process. The control plane never
imports the workers: roles are `module:Class` strings whose class takes a
config dict and has async `start() -> dict`, `drain()` and `stop()`.

Ray restarts a worker actor whose process dies; the restarted actor starts
itself again (`restartable`). The workers are told to exit when their engine
or pull loop dies, for the same reason.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from pdserve.cluster.actors import (
    WORKER_MAX_RESTARTS,
    StartedWorker,
    actor_name,
    load_entrypoint,
    restartable,
    start_worker_actor,
    stop_actor,
    worker_actor_options,
)
from pdserve.cluster.etcd_auth import ClusterAccess, bootstrap_rbac
from pdserve.cluster.etcd_server import EmbeddedEtcd, free_loopback_port
from pdserve.cluster.netaddr import resolve_bind
from pdserve.cluster.resources import head_cpus, ray_demand, shortfall
from pdserve.cluster.security import grpc_channel, internal_client_tls
from pdserve.cluster.topology import Topology
from pdserve.cluster.worker_config import worker_slots

from .processes import port_open, terminate_group
from .protection import exposure_warnings
from .ray_auth import apply_ray_auth, child_env
from .state import ClusterState, state_path

# Also importable from here (tests, bench, the composition root).
__all__ = ["Launcher", "ClusterState", "state_path", "StartedWorker", "start_worker_actor", "actor_name", "restartable", "worker_actor_options", "load_entrypoint",
           "WORKER_MAX_RESTARTS", "READY_TIMEOUT_S", "RAY_START_TIMEOUT_S"]

READY_TIMEOUT_S = 300.0
RAY_START_TIMEOUT_S = 60.0
GATE_START_TIMEOUT_S = 30.0
# A joined Ray cluster gets this long to show the resources the topology needs (nodes joining).
RESOURCES_WAIT_S = 120.0
# A head started here reports its resources within moments of accepting connections.
RESOURCES_SETTLE_S = 10.0


class Launcher:
    """Brings a topology up and down; `progress` receives one line per stage."""

    def __init__(self, topology: Topology, topology_file: str, model_path: str, *,
                 ray_address: str | None = None, progress: Callable[[str], None] = print,
                 max_replicas: dict[str, int] | None = None, flexible: bool = False,
                 resources_wait_s: float = RESOURCES_WAIT_S):
        """`max_replicas`: per role, the most replicas the planner may run (the autoscale
        policy's max_replicas): a Ray head started here gets CPUs for them. `flexible`: start
        workers that can change role in place (the policy's allow_role_flip)."""
        self.topo = topology
        self.max_replicas = dict(max_replicas or {})
        self.flexible = flexible
        self.topology_file = topology_file
        self.model_path = model_path
        self.ray_address = ray_address or topology.ray.address
        self.progress = progress
        self.resources_wait_s = resources_wait_s

    # -- up -----------------------------------------------------------------------------
    def up(self) -> ClusterState:
        import ray

        t = self.topo
        path = state_path(t)
        if path.exists():
            raise RuntimeError(f"{path} exists: cluster {t.cluster!r} looks up already; run `pdserve down` first")
        # With etcd TLS, `up` acts as the operator and each worker as its own identity (or the
        # shared one): a topology missing one fails here (naming the setting), before anything starts.
        t.etcd_tls("operator")
        self._check_worker_identities()
        for warning in exposure_warnings(t, self.ray_address):
            self.progress(f"WARNING   {warning}")
        ray_auth = apply_ray_auth(t)  # before Ray starts; no token: fails here, naming the setting
        run_dir = t.run_path
        run_dir.mkdir(parents=True, exist_ok=True)
        state = ClusterState(cluster=t.cluster, topology=self.topology_file, namespace=t.ray.namespace, ray_address="",
                             ray_head_pid=None, etcd_endpoints=list(t.etcd.endpoints), etcd_pid=None,
                             queue_name=t.queue.name, model=self.model_path)
        try:
            self._start_etcd(state, run_dir)
            self._start_ray(state, run_dir)
            self.progress(f"ray       {ray_auth}")
            ray.init(address=state.ray_address, namespace=t.ray.namespace, log_to_driver=False)
            state.save(path)  # from here on, `down` can clean up whatever follows
            self._check_resources(joined=state.ray_head_pid is None)
            from .cluster.queue import get_or_create_queue

            queue = get_or_create_queue(t.queue.name, t.ray.namespace, t.queue.capacity, detached=True,
                                        wire_bind=t.queue.wire, on_head=True, wire_tls=t.queue.server_tls(t.resolve),
                                        stall_s=t.queue.stall_timeout_s)
            if t.queue.tls is not None:  # a certificate that does not load fails here, not in every worker
                ray.get(queue.wire_endpoint.remote(), timeout=60)
            self.progress(f"queue     {t.queue.name} (capacity {t.queue.capacity}, wire {t.queue.wire}"
                          f"{', TLS' if t.queue.tls else ''})")
            handles = self._start_workers(state)
            state.save(path)
            self._wait_ready(state, handles)
            self._start_gateways(state)
            self._start_kv_index(state)
        except BaseException:
            self.progress("start-up failed; stopping what was started")
            try:
                self.down(state)
            finally:
                path.unlink(missing_ok=True)
            raise
        state.save(path)
        return state

    def _start_etcd(self, state: ClusterState, run_dir: Path) -> None:
        if state.etcd_endpoints:
            self.progress(f"etcd      using {', '.join(state.etcd_endpoints)}")
            if self.topo.etcd.gate is not None:  # the gate you run beside it (etcd.gate.endpoints)
                self._start_gate(state, run_dir, "")
            return
        data_dir = Path(self.topo.etcd.data_dir) if self.topo.etcd.data_dir else run_dir / f"{self.topo.cluster}-etcd"
        # On this (the launcher's) host, at the address the workers can reach: network.bind.
        host = resolve_bind(self.topo.network.bind, ray_address=self.ray_address)
        etcd = EmbeddedEtcd(data_dir, host=host, tls=self.topo.embedded_etcd_tls()).start()
        # It must outlive this process: `down` stops it by pid.
        state.etcd_endpoints, state.etcd_pid = [etcd.endpoint], etcd.detach()
        self.progress(f"etcd      started at {state.etcd_endpoints[0]} (pid {state.etcd_pid}, data {data_dir})")
        if self.topo.etcd.tls is not None:
            # Before any worker starts: from here on only the topology's identities get in.
            access = self.etcd_access()
            root = self.topo.etcd_tls("root")
            if root is None:  # etcd_tls is None only without etcd.tls, which is set here
                raise RuntimeError("etcd.tls is not set: no root identity to bootstrap etcd's RBAC as")
            asyncio.run(bootstrap_rbac(etcd.endpoint, root, [access]))
            users = ["root", "operator"] + (["worker"] if access.shared_worker else [])
            own = f", and one per worker id: {len(access.workers)}" if access.workers else ""
            self.progress(f"etcd      TLS with client certificates; RBAC on (users {', '.join(users)}{own})")
        if self.topo.etcd.gate is not None:
            self._start_gate(state, run_dir, host)

    def _start_gate(self, state: ClusterState, run_dir: Path, host: str) -> None:
        """The etcd gate beside the embedded etcd (cluster/etcd_gate.py): workers, gateways and
        the KV index get its endpoint, the operator side keeps etcd's. It runs under a supervisor
        (`--supervise`, the process group `down` stops) that restarts it on the same port if it
        dies: `up` exits once the cluster is up, so it cannot. With etcd.endpoints the gate is
        yours (etcd.gate.endpoints): only its endpoints are recorded."""
        gate = self.topo.etcd.gate
        if gate is None:  # both callers check etcd.gate first
            raise RuntimeError("_start_gate without etcd.gate in the topology")
        if gate.endpoints:
            state.gate_endpoints = list(gate.endpoints)
            self.progress(f"etcd gate using {', '.join(state.gate_endpoints)} (etcd.gate.endpoints): workers, "
                          "gateways and the KV index reach etcd through it")
            return
        access = self.etcd_access()
        # Chosen here, not by the gate: every restart must listen where its clients reconnect.
        port = gate.port or free_loopback_port(host)
        log_file = open(run_dir / f"{self.topo.cluster}-etcd-gate.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cluster.etcd_gate", "--supervise",
             "--topology", os.path.abspath(self.topology_file),
             "--upstream", state.etcd_endpoints[0], "--host", host, "--port", str(port),
             "--workers", ",".join(f"{role}:{wid}" for role, wid in access.workers),
             *(["--shared-worker"] if access.shared_worker else [])],
            stdout=log_file, stderr=subprocess.STDOUT, env=child_env(self.topo), start_new_session=True)
        state.gate_pid, state.gate_endpoints = proc.pid, [f"{host}:{port}"]
        deadline = time.monotonic() + GATE_START_TIMEOUT_S
        while not port_open(port, host):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the etcd gate did not start (see {log_file.name})")
            time.sleep(0.1)
        self.progress(f"etcd gate started at {state.gate_endpoints[0]} (supervisor pid {proc.pid}: restarts it if "
                      "it dies): workers, gateways and the KV index reach etcd only through it, each scoped to "
                      "its own keys and leases")

    def etcd_access(self) -> ClusterAccess:
        """What etcd's RBAC bootstrap sets up for this topology: a user per worker slot
        (etcd.tls.workers), and the shared worker identity's grants while it is listed; with
        the etcd gate, the workers' users get no grants (the gate checks them instead)."""
        tls = self.topo.etcd.tls
        return ClusterAccess(self.topo.cluster, tuple(worker_slots(self.topo, self.max_replicas)),
                             shared_worker=tls is not None and tls.worker is not None,
                             gated=self.topo.etcd.gate is not None)

    def _check_worker_identities(self) -> None:
        """Every worker id this topology can run has an etcd identity (its own certificate, or
        the shared one): ValueError naming the settings otherwise."""
        t = self.topo
        if t.etcd.tls is None:
            return
        ids = [wid for _, wid in worker_slots(t, self.max_replicas)]
        ids += [f"{role}-{i}" for role in ("prefill", "decode") for i in range(getattr(t.roles, role).replicas)]
        for wid in dict.fromkeys(ids):
            t.worker_etcd_tls(wid)

    def _start_ray(self, state: ClusterState, run_dir: Path) -> None:
        if self.ray_address:
            state.ray_address = self.ray_address
            self.progress(f"ray       joining {self.ray_address}")
            return
        # Room for every actor `up` starts (workers at the planner's max, gateways, the KV
        # index): an actor that does not fit the head's CPUs would wait forever.
        cpus = head_cpus(ray_demand(self.topo, self.max_replicas))
        # The head and every process it spawns authenticate as the topology says (ray.auth).
        env = {**child_env(self.topo), "RAY_worker_niceness": str(self.topo.ray.worker_niceness)}
        log_file = open(run_dir / f"{self.topo.cluster}-ray.log", "ab")
        for attempt in (1, 2):
            port = free_loopback_port()
            # `--block` keeps this head's processes under one process we own, so
            # `down` stops exactly this cluster's Ray and nothing else on the host.
            proc = subprocess.Popen(
                [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                 f"--port={port}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
                 "--include-dashboard=false", "--disable-usage-stats"],
                stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            state.ray_address, state.ray_head_pid = f"127.0.0.1:{port}", proc.pid
            deadline = time.monotonic() + RAY_START_TIMEOUT_S
            while not port_open(port) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if port_open(port):
                break
            if attempt == 2:
                raise RuntimeError(f"Ray head did not start (see {log_file.name})")
            # A head whose GCS never came up (seen, rarely, on a loaded host; a second start
            # worked): `ray start` gives up on its own after Ray's port wait, or stays silent.
            # Stopped, and started once more on another port.
            why = (f"exited ({proc.returncode})" if proc.poll() is not None
                   else f"not listening after {RAY_START_TIMEOUT_S:g} s")
            self.progress(f"ray       head (pid {proc.pid}) {why}: stopped, starting it again (see {log_file.name})")
            terminate_group(proc.pid, "ray head", self.progress, leader_first=True)
            try:
                proc.wait(5.0)  # (reaped: stopped, it is no zombie of ours)
            except subprocess.TimeoutExpired:
                pass
        self.progress(f"ray       started head at {state.ray_address} ({cpus} CPUs, pid {proc.pid})")

    def _check_resources(self, joined: bool) -> None:
        """Fail before starting any actor when the Ray cluster cannot hold them all, naming what
        is short and who asks for it (cluster/resources.py), instead of timing out minutes later
        on an actor Ray can never place. A head started here is sized for them; a cluster that
        was joined gets `resources_wait_s` for nodes still joining (`ray up` starts the workers'
        nodes after the head), with the shortfall printed while it waits."""
        import ray

        # What starts now: the planner's later workers (max_replicas) are sized into a head
        # started here, but a joined cluster need not hold them yet (its autoscaler may add nodes).
        demands = ray_demand(self.topo)
        wait_s = self.resources_wait_s if joined else RESOURCES_SETTLE_S
        deadline, said = time.monotonic() + wait_s, None
        while True:
            short = shortfall(demands, ray.available_resources())
            if not short:
                return
            # A head started here has reported its resources once it lists CPUs: short is final.
            if time.monotonic() > deadline or (not joined and "CPU" in ray.cluster_resources()):
                break
            if joined and short != said:
                self.progress("ray       waiting for resources: " + "; ".join(short))
                said = short
            time.sleep(0.5)
        where = (f"the Ray cluster at {self.ray_address} (waited {wait_s:g} s for nodes to join)" if joined
                 else "the Ray head `pdserve up` started")
        hint = ("lower the roles' resources.num_cpus / gateway.num_cpus / kv_index.num_cpus, or add nodes"
                if joined else "a head `up` starts declares only CPUs (and the GPUs Ray detects): join a cluster "
                "whose nodes carry the custom resources (--ray-address), or remove them from the topology")
        raise RuntimeError(f"{where} cannot place everything this topology starts: " + "; ".join(short)
                           + f". {hint} (`pdserve topology check` lists what each part asks for)")

    def _start_workers(self, state: ClusterState) -> list:
        t = self.topo
        handles = []
        for role_name in ("prefill", "decode"):
            for i in range(getattr(t.roles, role_name).replicas):
                w = start_worker_actor(t, role_name, i, model=self.model_path,
                                       etcd_endpoints=state.worker_etcd_endpoints,
                                       flexible=self.flexible)
                handles.append((w.name, role_name, w.worker_id, w.actor, w.start_ref))
                state.actors.append({"name": w.name, "role": role_name, "worker_id": w.worker_id})
                self.progress(f"{role_name:<9} starting {w.worker_id} ({getattr(t.roles, role_name).entrypoint})")
        return handles

    def _wait_ready(self, state: ClusterState, handles) -> None:
        import ray

        deadline = time.monotonic() + READY_TIMEOUT_S
        for (name, role, worker_id, _actor, ref), rec in zip(handles, state.actors):
            info = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            rec.update({k: v for k, v in info.items() if k in ("grpc", "http", "pid")})
            self.progress(f"{role:<9} {worker_id} started" + (f": gRPC {info['grpc']}  HTTP http://{info['http']}"
                                                             if role == "decode" else ""))
        members = asyncio.run(_wait_registered(state, deadline, self.topo.etcd_tls("operator", "worker")))
        self.progress(f"registry  {len(members)} workers registered in etcd")
        tls = internal_client_tls(self.topo.security, self.topo.resolve)  # None: plaintext
        for rec in state.decode_endpoints:
            _wait_grpc_health(rec["grpc"], deadline, tls)
        self.progress("ready")

    def _start_gateways(self, state: ClusterState) -> None:
        """The topology's gateways (gateway/actor.py), once the decode workers serve."""
        import ray

        from pdserve.cluster.actors import restartable, worker_actor_options
        from pdserve.gateway.actor import GatewayActor, gateway_config

        t = self.topo
        started = []
        for i in range(t.gateway.replicas):
            cfg = gateway_config(t, i, self.model_path, self._follower_etcd_endpoints(state))
            name = f"{t.cluster}-{cfg['gateway_id']}"
            opts = worker_actor_options(name, t.ray.namespace, t.gateway.num_cpus, 0, t.gateway.custom)
            actor = ray.remote(restartable(GatewayActor)).options(**opts).remote(cfg)
            rec = {"name": name, "role": "gateway", "worker_id": cfg["gateway_id"]}
            state.actors.append(rec)
            started.append((rec, actor.start.remote()))
        for rec, ref in started:
            info = ray.get(ref, timeout=READY_TIMEOUT_S)
            rec.update(grpc=info["grpc"], http=info["http"])
            self.progress(f"gateway   {rec['worker_id']} started: gRPC {info['grpc']}  HTTP http://{info['http']}")

    def _follower_etcd_endpoints(self, state: ClusterState) -> list[str]:
        """Where the gateways and the KV index reach etcd: the gate's endpoint when they connect
        as an identity it serves (the reader: a gated cluster grants it nothing directly)."""
        from pdserve.cluster.etcd_auth import FOLLOWER_IDENTITIES

        tls = self.topo.etcd_tls(*FOLLOWER_IDENTITIES)
        return state.follower_etcd_endpoints(tls.identity if tls is not None else None)

    def _start_kv_index(self, state: ClusterState) -> None:
        """The cluster's KV index (cluster/kvindex/actor.py) when the topology enables it."""
        t = self.topo
        if not t.kv_index.enabled:
            return
        import ray

        from pdserve.cluster.actors import restartable, worker_actor_options
        from pdserve.cluster.kvindex.actor import KVIndexActor, kv_index_config

        name = f"{t.cluster}-kv-index"
        opts = worker_actor_options(name, t.ray.namespace, t.kv_index.num_cpus, 0, t.kv_index.custom)
        actor = ray.remote(restartable(KVIndexActor)).options(**opts).remote(
            kv_index_config(t, self._follower_etcd_endpoints(state)))
        rec = {"name": name, "role": "kv-index", "worker_id": "kv-index"}
        state.actors.append(rec)
        rec["url"] = ray.get(actor.start.remote(), timeout=READY_TIMEOUT_S)["url"]
        self.progress(f"kv index  {rec['url']}  (pdserve kv status --topology {self.topology_file})")

    # -- down ---------------------------------------------------------------------------
    def down(self, state: ClusterState, drain_timeout_s: float = 30.0) -> None:
        import ray

        if state.ray_address:
            try:
                apply_ray_auth(self.topo)
                if not ray.is_initialized():
                    ray.init(address=state.ray_address, namespace=state.namespace, log_to_driver=False)
                # The planner first: it would replace the workers stopped below.
                stop_planner(state.cluster, state.namespace, self.progress)
                names = [rec["name"] for rec in reversed(state.actors)]  # decode first: stop taking requests
                # Workers the planner started are not in the state file: every actor of this cluster.
                names += sorted(n for n in ray.util.list_named_actors()
                                if n.startswith(f"{state.cluster}-") and n not in names and n != state.queue_name)
                for name in names:
                    stop_actor(name, state.namespace, drain_timeout_s, self.progress)
                try:
                    ray.kill(ray.get_actor(state.queue_name, namespace=state.namespace))
                except ValueError:
                    pass
            except Exception as exc:  # noqa: BLE001  (Ray already gone: still stop the processes)
                self.progress(f"ray       could not reach {state.ray_address}: {exc}")
            finally:
                if ray.is_initialized():
                    ray.shutdown()
        if state.ray_head_pid:
            terminate_group(state.ray_head_pid, "ray head", self.progress, leader_first=True)
        if state.gate_pid:  # the supervisor's process group: it and the gate it restarts
            terminate_group(state.gate_pid, "etcd gate", self.progress)
        if state.etcd_pid:
            terminate_group(state.etcd_pid, "etcd", self.progress, own_group=False)


def stop_planner(cluster: str, namespace: str, progress) -> None:
    """Stop the cluster's planner actor, if one runs (graceful stop, then kill)."""
    import ray

    from pdserve.cluster.planner.actor import planner_actor_name

    try:
        actor = ray.get_actor(planner_actor_name(cluster), namespace=namespace)
    except ValueError:
        return
    try:
        ray.get(actor.stop.remote(), timeout=15)
    except Exception as exc:  # noqa: BLE001  (killed anyway)
        progress(f"planner   {exc.__class__.__name__} while stopping; killing")
    ray.kill(actor, no_restart=True)
    progress("planner   stopped")


async def _wait_registered(state: ClusterState, deadline: float, tls=None) -> dict:
    from pdserve.cluster.registry import Registry

    want = {a["worker_id"] for a in state.actors}
    async with Registry(state.etcd_endpoints, state.cluster, tls=tls) as reg:
        while True:
            members = await reg.members()
            if want <= set(members):
                return members
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers never registered: missing {sorted(want - set(members))}")
            await asyncio.sleep(0.2)


def _wait_grpc_health(target: str, deadline: float, tls=None) -> None:
    """Until the decode worker at `target` reports SERVING (over TLS when the topology has it:
    the health service needs no API key)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc_channel(target, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode worker at {target} never reported SERVING")
            time.sleep(0.2)
