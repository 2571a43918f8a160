"""Worker actors: entry points as restartable, detached Ray actors.

`start_worker_actor` is the one way a worker actor is created: `pdserve up`
(launcher.py), the planner's Ray backend and `pdserve worker` all call it.

The control plane never imports the workers: a role is a `module:Class` string
(`load_entrypoint`) whose class takes a config dict (control/worker_config.py)
and has async `start() -> dict`, `drain()` and `stop()`. Ray restarts a worker
actor whose process dies (`WORKER_MAX_RESTARTS`); the restarted actor starts
itself again (`restartable`), so it loads its engine and re-registers in etcd
without anyone calling `start()`.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .worker_config import launch_config

if TYPE_CHECKING:
    from .topology import Topology

log = logging.getLogger(__name__)

# Restarts of one worker actor over its life. Bounded: a worker that crashes at every start
# (a bad model path, a port taken) must end up visibly dead, not loop forever.
WORKER_MAX_RESTARTS = 10
START_CALL_RETRIES = 5  # resends of a restarted actor's call to its own start() (see restartable)


def load_entrypoint(spec: str):
    module, _, name = spec.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def restartable(cls: type) -> type:
    """`cls` (an entry-point class) as an actor class that, when Ray restarts the actor after
    its process died, calls its own `start()` again (Ray re-runs only `__init__`)."""

    class Restartable(cls):
        _restart_start_claimed = False  # this process has run (or is running) its own start()

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            import ray

            ctx = ray.get_runtime_context()
            if ctx.was_current_actor_reconstructed:
                log.warning("%s restarted by Ray; starting it again", cls.__name__)
                # Its registration may still be alive (lease TTL): it is this worker's own.
                if hasattr(getattr(self, "cfg", None), "replace_stale_registration"):
                    self.cfg.replace_stale_registration = True
                # Sent before this constructor returns: the actor may still read as RESTARTING
                # when the call reaches it, which fails the call unless it may be resent. Ray
                # can then deliver it twice (seen: a call reported failed "the actor was
                # restarted" had run, and its resend ran too: two concurrent start()s, whose
                # engines' rank processes were then driven from two threads), so only the
                # first delivery starts the worker.
                ctx.current_actor._start_after_restart.options(max_task_retries=START_CALL_RETRIES).remote()

        async def _start_after_restart(self) -> None:
            if self._restart_start_claimed:  # set before any await: the actor's one event loop
                log.warning("%s: a second delivery of the start after a restart ignored", cls.__name__)
                return
            self._restart_start_claimed = True
            try:
                await self.start()
            except Exception:  # noqa: BLE001  (logged; the actor stays up for inspection)
                log.exception("%s: start after a restart failed", cls.__name__)

    Restartable.__name__ = Restartable.__qualname__ = cls.__name__
    Restartable.__module__ = cls.__module__
    return Restartable


def worker_actor_options(name: str, namespace: str, num_cpus: float, num_gpus: float = 0,
                         resources: dict[str, float] | None = None) -> dict:
    """Ray options of a worker actor: detached, restarted when its process dies, calls not
    retried (a call caught by the death fails; `start` after a restart is the actor's own).
    `resources`: Ray custom resources that place it (a node type's, or "node:<ip>")."""
    return dict(name=name, namespace=namespace, lifetime="detached", num_cpus=num_cpus, num_gpus=num_gpus,
                resources=dict(resources or {}), max_concurrency=1000, max_restarts=WORKER_MAX_RESTARTS,
                max_task_retries=0)


def stop_actor(name: str, namespace: str, timeout_s: float, progress) -> None:
    """Drain and stop the named worker actor, then kill it (a dead or stuck one is killed anyway)."""
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


@dataclass
class StartedWorker:
    """A worker actor just created: its Ray name, worker id, handle and its `start()` call."""

    name: str
    worker_id: str
    actor: Any
    start_ref: Any  # ObjectRef of start() -> the worker's endpoints dict


def actor_name(cluster: str, worker_id: str) -> str:
    """The Ray actor name of a worker (unique in the cluster's namespace)."""
    return f"{cluster}-{worker_id}"


def start_worker_actor(topo: "Topology", role: str, replica: int, *, model: str, etcd_endpoints: list[str],
                       worker_id: str | None = None, resources: dict[str, float] | None = None,
                       flexible: bool = False) -> StartedWorker:
    """Create replica `replica` of `role` as a detached, restartable Ray actor and call its
    `start()`: the one way workers are started (`pdserve up`, the planner, `pdserve worker`).
    `resources` adds Ray custom resources to the role's own (e.g. {"node:<ip>": 0.01} to
    place it on one node). `flexible`: a `FlexWorker` that the planner may move to the other
    role later without reloading its weights (the autoscale policy's allow_role_flip); it
    needs the default entry points of both roles."""
    import ray

    from .topology import DEFAULT_DECODE_ENTRYPOINT, DEFAULT_FLEX_ENTRYPOINT, DEFAULT_PREFILL_ENTRYPOINT

    spec = getattr(topo.roles, role)
    cfg = launch_config(topo, role, replica, model=model, etcd_endpoints=etcd_endpoints, worker_id=worker_id)
    wid = cfg["worker_id"]
    entrypoint = spec.entrypoint
    if flexible:
        if (topo.roles.prefill.entrypoint, topo.roles.decode.entrypoint) != (DEFAULT_PREFILL_ENTRYPOINT,
                                                                             DEFAULT_DECODE_ENTRYPOINT):
            raise ValueError("allow_role_flip needs the default entry points of both roles "
                             f"({DEFAULT_PREFILL_ENTRYPOINT}, {DEFAULT_DECODE_ENTRYPOINT}); set "
                             "allow_role_flip: false in the autoscale policy to use others")
        p_tp, d_tp = topo.roles.prefill.tensor_parallel_size, topo.roles.decode.tensor_parallel_size
        if p_tp != d_tp:
            raise ValueError(f"allow_role_flip needs the same tensor_parallel_size on both roles (a flipped worker "
                             f"keeps its ranks and KV pool); this topology has prefill {p_tp}, decode {d_tp}: set "
                             "allow_role_flip: false in the autoscale policy, or one TP size")
        other = "decode" if role == "prefill" else "prefill"
        # The other role's config; the planner names its worker id when it flips the worker.
        alt = launch_config(topo, other, replica, model=model, etcd_endpoints=etcd_endpoints)
        cfg, entrypoint = {"role": role, "configs": {role: cfg, other: alt}}, DEFAULT_FLEX_ENTRYPOINT
    cls = ray.remote(restartable(load_entrypoint(entrypoint)))
    name = actor_name(topo.cluster, wid)
    # A TP replica is one actor whose ranks are its child processes on the same node: its one bundle
    # (num_gpus >= tensor_parallel_size, checked by the topology) is Ray's STRICT_PACK of its ranks.
    opts = worker_actor_options(name, topo.ray.namespace, spec.resources.num_cpus, spec.resources.num_gpus,
                                {**spec.resources.custom, **(resources or {})})
    actor = cls.options(**opts).remote(cfg)
    return StartedWorker(name, wid, actor, actor.start.remote())
