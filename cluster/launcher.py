"""Start, inspect and stop an XpYd deployment described by a topology file.

`Launcher.up()` brings up, in order: etcd (embedded when the topology names
no endpoint), Ray (joins `--ray-address`, else starts a head for this
cluster), the prefill queue actor, the prefill and decode workers (detached
Ray actors built from the topology's entry-point strings), then waits until
every worker is registered in etcd and every decode worker answers gRPC
health. It writes what it started to a state file so that `status` and
`down` work from any later process. The control plane never imports the
workers: roles are `module:Class` strings whose class takes a config dict
and has async `start() -> dict`, `drain()` and `stop()`.

Ray restarts a worker actor whose process dies (`WORKER_MAX_RESTARTS`); the
restarted actor starts itself again (`restartable`), so it loads its engine
and re-registers in etcd without anyone calling `start()`. The workers are
told to exit when their engine or pull loop dies, for the same reason.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .etcd_server import EmbeddedEtcd, free_loopback_port
from .topology import Topology

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
RAY_START_TIMEOUT_S = 60.0
# Restarts of one worker actor over its life. Bounded: a worker that crashes at every start
# (a bad model path, a port taken) must end up visibly dead, not loop forever.
WORKER_MAX_RESTARTS = 10


def restartable(cls: type) -> type:
    """`cls` (an entry-point class) as an actor class that, when Ray restarts the actor after
    its process died, calls its own `start()` again (Ray re-runs only `__init__`)."""

    class Restartable(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            import ray

            ctx = ray.get_runtime_context()
            if ctx.was_current_actor_reconstructed:
                log.warning("%s restarted by Ray; starting it again", cls.__name__)
                # Its registration may still be alive (lease TTL): it is this worker's own.
                self.cfg.replace_stale_registration = True
                ctx.current_actor._start_after_restart.remote()

        async def _start_after_restart(self) -> None:
            try:
                await self.start()
            except Exception:  # noqa: BLE001  (logged; the actor stays up for inspection)
                log.exception("%s: start after a restart failed", cls.__name__)

    Restartable.__name__ = Restartable.__qualname__ = cls.__name__
    Restartable.__module__ = cls.__module__
    return Restartable


def worker_actor_options(name: str, namespace: str, num_cpus: float, num_gpus: float = 0) -> dict:
    """Ray options of a worker actor: detached, restarted when its process dies, calls not
    retried (a call caught by the death fails; `start` after a restart is the actor's own)."""
    return dict(name=name, namespace=namespace, lifetime="detached", num_cpus=num_cpus, num_gpus=num_gpus,
                max_concurrency=1000, max_restarts=WORKER_MAX_RESTARTS, max_task_retries=0)


@dataclass
class ClusterState:
    """What `up` started: written as JSON to `<run_dir>/<cluster>.state.json`."""

    cluster: str
    topology: str
    namespace: str
    ray_address: str
    ray_head_pid: int | None  # set when `up` started the Ray head (down stops it)
    etcd_endpoints: list[str]
    etcd_pid: int | None  # set when `up` started etcd (down stops it)
    queue_name: str
    model: str
    actors: list[dict] = field(default_factory=list)  # {name, role, worker_id, grpc, http}
    started_at: float = field(default_factory=time.time)

    @property
    def decode_endpoints(self) -> list[dict]:
        return [a for a in self.actors if a["role"] == "decode"]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> "ClusterState":
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no running cluster recorded there (run `pdserve up` first)")
        return cls(**json.loads(path.read_text()))


def state_path(topology: Topology) -> Path:
    return topology.run_path / f"{topology.cluster}.state.json"


def load_entrypoint(spec: str):
    module, _, name = spec.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class Launcher:
    """Brings a topology up and down; `progress` receives one line per stage."""

    def __init__(self, topology: Topology, topology_file: str, model_path: str, *,
                 ray_address: str | None = None, progress: Callable[[str], None] = print):
        self.topo = topology
        self.topology_file = topology_file
        self.model_path = model_path
        self.ray_address = ray_address or topology.ray.address
        self.progress = progress

    # -- up -----------------------------------------------------------------------------
    def up(self) -> ClusterState:
        import ray

        t = self.topo
        path = state_path(t)
        if path.exists():
            raise RuntimeError(f"{path} exists: cluster {t.cluster!r} looks up already; run `pdserve down` first")
        run_dir = t.run_path
        run_dir.mkdir(parents=True, exist_ok=True)
        state = ClusterState(cluster=t.cluster, topology=self.topology_file, namespace=t.ray.namespace, ray_address="",
                             ray_head_pid=None, etcd_endpoints=list(t.etcd.endpoints), etcd_pid=None,
                             queue_name=t.queue.name, model=self.model_path)
        try:
            self._start_etcd(state, run_dir)
            self._start_ray(state, run_dir)
            ray.init(address=state.ray_address, namespace=t.ray.namespace, log_to_driver=False)
            state.save(path)  # from here on, `down` can clean up whatever follows
            from .queue import get_or_create_queue

            get_or_create_queue(t.queue.name, t.ray.namespace, t.queue.capacity, detached=True, wire_bind=t.queue.wire)
            self.progress(f"queue     {t.queue.name} (capacity {t.queue.capacity}, wire {t.queue.wire})")
            handles = self._start_workers(state)
            state.save(path)
            self._wait_ready(state, handles)
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
            return
        data_dir = Path(self.topo.etcd.data_dir) if self.topo.etcd.data_dir else run_dir / f"{self.topo.cluster}-etcd"
        etcd = EmbeddedEtcd(data_dir).start()
        # It must outlive this process: `down` stops it by pid.
        state.etcd_endpoints, state.etcd_pid = [etcd.endpoint], etcd.detach()
        self.progress(f"etcd      started at {state.etcd_endpoints[0]} (pid {state.etcd_pid}, data {data_dir})")

    def _start_ray(self, state: ClusterState, run_dir: Path) -> None:
        if self.ray_address:
            state.ray_address = self.ray_address
            self.progress(f"ray       joining {self.ray_address}")
            return
        port = free_loopback_port()
        need = sum(r.replicas * r.resources.num_cpus for r in (self.topo.roles.prefill, self.topo.roles.decode))
        cpus = max(2, int(need + 0.999))
        env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
               "RAY_worker_niceness": str(self.topo.ray.worker_niceness)}
        log_file = open(run_dir / f"{self.topo.cluster}-ray.log", "ab")
        # `--block` keeps this head's processes under one process we own, so
        # `down` stops exactly this cluster's Ray and nothing else on the host.
        proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
             f"--port={port}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
             "--include-dashboard=false", "--disable-usage-stats"],
            stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        state.ray_address, state.ray_head_pid = f"127.0.0.1:{port}", proc.pid
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while not _port_open(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray head did not start (see {log_file.name})")
            time.sleep(0.2)
        self.progress(f"ray       started head at {state.ray_address} ({cpus} CPUs, pid {proc.pid})")

    def _start_workers(self, state: ClusterState) -> list:
        import ray

        t = self.topo
        handles = []
        for role_name in ("prefill", "decode"):
            role = getattr(t.roles, role_name)
            cls = ray.remote(restartable(load_entrypoint(role.entrypoint)))
            for i in range(role.replicas):
                worker_id = f"{role_name}-{i}"
                name = f"{t.cluster}-{worker_id}"
                opts = worker_actor_options(name, t.ray.namespace, role.resources.num_cpus, role.resources.num_gpus)
                actor = cls.options(**opts).remote(self._worker_config(role_name, role, i, worker_id, state))
                handles.append((name, role_name, worker_id, actor, actor.start.remote()))
                state.actors.append({"name": name, "role": role_name, "worker_id": worker_id})
                self.progress(f"{role_name:<9} starting {worker_id} ({role.entrypoint})")
        return handles

    def _worker_config(self, role_name: str, role, i: int, worker_id: str, state: ClusterState) -> dict:
        t = self.topo
        common = dict(model=self.model_path, engine_args=dict(role.engine), worker_id=worker_id,
                      cluster=t.cluster, etcd_endpoints=state.etcd_endpoints, lease_ttl_s=t.etcd.lease_ttl_s,
                      queue_name=t.queue.name, queue_namespace=t.ray.namespace, freeze_gc=True)
        port = lambda key: role.ports.get(key, 0) + i if role.ports.get(key, 0) else 0  # noqa: E731
        if role_name == "prefill":
            return dict(common, batch_max_tokens=t.queue.batch_max_tokens, poll_timeout_ms=t.queue.poll_timeout_ms,
                        exit_on_loop_death=True, metrics_port=port("metrics") or None)
        return dict(common, grpc_port=port("grpc"), http_port=port("http"), router_policy=str(t.router_policy_path) if t.router_policy_path else None,
                    served_model_name=t.model.name, remote_prefill=t.roles.prefill.replicas > 0,
                    exit_on_engine_death=True)

    def _wait_ready(self, state: ClusterState, handles) -> None:
        import ray

        deadline = time.monotonic() + READY_TIMEOUT_S
        for (name, role, worker_id, _actor, ref), rec in zip(handles, state.actors):
            info = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            rec.update({k: v for k, v in info.items() if k in ("grpc", "http", "pid")})
            self.progress(f"{role:<9} {worker_id} started" + (f": gRPC {info['grpc']}  HTTP http://{info['http']}"
                                                             if role == "decode" else ""))
        members = asyncio.run(_wait_registered(state, deadline))
        self.progress(f"registry  {len(members)} workers registered in etcd")
        for rec in state.decode_endpoints:
            _wait_grpc_health(rec["grpc"], deadline)
        self.progress("ready")

    # -- down ---------------------------------------------------------------------------
    def down(self, state: ClusterState, drain_timeout_s: float = 30.0) -> None:
        import ray

        if state.ray_address:
            try:
                if not ray.is_initialized():
                    ray.init(address=state.ray_address, namespace=state.namespace, log_to_driver=False)
                for rec in reversed(state.actors):  # decode first: stop taking requests
                    _stop_actor(rec["name"], state.namespace, drain_timeout_s, self.progress)
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
            _terminate_group(state.ray_head_pid, "ray head", self.progress)
        if state.etcd_pid:
            _terminate_group(state.etcd_pid, "etcd", self.progress, own_group=False)


def _stop_actor(name: str, namespace: str, timeout_s: float, progress) -> None:
    import ray

    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    try:
        ray.get(actor.drain.remote(), timeout=timeout_s)
        ray.get(actor.stop.remote(), timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001  (a dead or stuck worker is killed anyway)
        progress(f"worker    {name}: {exc.__class__.__name__} while draining; killing")
    ray.kill(actor)
    progress(f"worker    {name} stopped")


async def _wait_registered(state: ClusterState, deadline: float) -> dict:
    from .registry import Registry

    want = {a["worker_id"] for a in state.actors}
    async with Registry(state.etcd_endpoints, state.cluster) as reg:
        while True:
            members = await reg.members()
            if want <= set(members):
                return members
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers never registered: missing {sorted(want - set(members))}")
            await asyncio.sleep(0.2)


def _wait_grpc_health(target: str, deadline: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
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


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _terminate_group(pid: int, what: str, progress, own_group: bool = True, timeout_s: float = 20.0) -> None:
    """SIGTERM (the process group when it leads one), then SIGKILL after a timeout."""
    kill = os.killpg if own_group else os.kill
    try:
        kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if _is_zombie(pid):
                break
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    progress(f"{what:<9} stopped (pid {pid})")


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False
