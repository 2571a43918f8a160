"""The planner as a detached Ray actor beside the queue (`pdserve up` starts it when the
topology names an `autoscale_policy`), and the pieces `pdserve planner run` shares with it.

The actor is restarted by Ray when its process dies; the new incarnation waits for the old
leader lease to expire, reads the planner state back from etcd and carries on (a drain in
progress is finished, not started again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from dataclasses import dataclass, field

from pdserve.cluster.actors import restartable
from pdserve.cluster.keys import ROLES
from pdserve.cluster.topology import Topology, load_topology
from pdserve.cluster.worker_config import worker_slot_counts

from pdserve.cluster.planner.backend import RayBackend
from pdserve.cluster.planner.core import Planner
from pdserve.cluster.planner.policy import autoscale_max_replicas, parse_autoscale

log = logging.getLogger(__name__)

PLANNER_MAX_RESTARTS = 10


def cpu_units(topo: Topology) -> dict[str, int | None]:
    """Budget units per replica: a GPU role's tensor_parallel_size when it is over 1 (a replica
    holds that many GPUs), else None (the policy's gpus_per_replica counts); the role's whole
    CPUs on a CPU role (gpu_budget then counts CPUs)."""
    out: dict[str, int | None] = {}
    for role in ROLES:
        spec = getattr(topo.roles, role)
        if spec.resources.num_gpus > 0:
            out[role] = spec.tensor_parallel_size if spec.tensor_parallel_size > 1 else None
        else:
            out[role] = max(1, math.ceil(spec.resources.num_cpus))
    return out


def planner_actor_name(cluster: str) -> str:
    """The Ray actor name of a cluster's planner."""
    return f"{cluster}-planner"


def queue_stats_fn(queue_name: str, namespace: str):
    """An async callable returning the prefill queue's stats as a dict (Ray must be up)."""
    import ray

    async def stats() -> dict:
        from pdserve.cluster.queue.client import ray_call

        actor = ray.get_actor(queue_name, namespace=namespace)
        st = await ray_call(actor, "stats", timeout_s=10.0)  # msgpack bytes over Ray, no pickled stats
        return {k: v for k, v in dataclasses.asdict(st).items() if k != "metrics"}

    return stats


def read_policy(path: str, parse):
    with open(path) as f:
        return parse(f.read(), path)


@dataclass
class PlannerConfig:
    """What the planner actor needs (plain data: it crosses Ray as the actor's argument)."""

    topology: str  # topology file path (the actor is placed on the node that has it)
    model: str
    etcd_endpoints: list[str]
    policy: str | None = None  # policy file; None: the topology's autoscale_policy
    dry_run: bool = False
    known_workers: list[str] = field(default_factory=list)
    worker_etcd_endpoints: list[str] = field(default_factory=list)  # the etcd gate's (empty: etcd_endpoints)
    replace_stale_registration: bool = False  # set by `restartable` after a restart (unused)


def build_planner(cfg: PlannerConfig, *, metrics_port: int | None = None) -> Planner:
    topo = load_topology(cfg.topology)
    parse = parse_autoscale
    path = cfg.policy or (str(topo.autoscale_policy_path) if topo.autoscale_policy_path else None)
    if path is None:
        raise ValueError("no autoscale policy: set autoscale_policy in the topology or pass --policy")
    from pdserve.cluster.netaddr import resolve_bind

    return Planner(cluster=topo.cluster, etcd_endpoints=cfg.etcd_endpoints, policy=read_policy(path, parse),
                   backend=RayBackend(topo, cfg.model, cfg.worker_etcd_endpoints or cfg.etcd_endpoints),
                   queue_stats=queue_stats_fn(topo.queue.name, topo.ray.namespace), units=cpu_units(topo),
                   parse_policy=parse, policy_path=path, dry_run=cfg.dry_run,
                   metrics_host=resolve_bind(topo.network.bind), metrics_port=metrics_port,
                   known_workers=cfg.known_workers, etcd_tls=topo.etcd_tls("operator"),
                   worker_slots=_worker_slots(topo))


def _worker_slots(topo: Topology) -> dict[str, int]:
    """Per role, the worker ids with an etcd identity of their own: as many as `pdserve up`
    created users for (from the topology and its autoscale policy); {} without etcd.tls.workers."""
    if topo.etcd_worker_certs() is None:
        return {}
    return worker_slot_counts(topo, autoscale_max_replicas(topo))


class PlannerActor:
    """Runs one `Planner` until stopped."""

    def __init__(self, cfg: PlannerConfig | dict):
        self.cfg = cfg if isinstance(cfg, PlannerConfig) else PlannerConfig(**cfg)
        self.planner: Planner | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> dict:
        self.planner = build_planner(self.cfg)
        await self.planner.start()
        self._task = asyncio.create_task(self.planner.run(self._stop))
        return {"planner": self.planner.id, "metrics": self.planner.metrics_address}

    def events(self) -> list[str]:
        return list(self.planner.log) if self.planner else []

    def pid(self) -> int:
        import os

        return os.getpid()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self.planner is not None:
            await self.planner.close()


def start_planner_actor(cfg: PlannerConfig, namespace: str, cluster: str, node_ip: str | None = None,
                        fresh: bool = True):
    """Create the detached, restartable planner actor (on `node_ip`, where the files are) and
    call its start(); returns (actor, start ObjectRef). `fresh`: first forget what a planner
    of an earlier cluster under this name left in etcd (a new `pdserve up`)."""
    import ray

    if fresh:
        from pdserve.cluster.registry import Registry

        from pdserve.cluster.planner.state import reset_planner

        tls = load_topology(cfg.topology).etcd_tls("operator")

        async def reset():
            async with Registry(cfg.etcd_endpoints, cluster, tls=tls) as reg:
                await reset_planner(reg)

        asyncio.run(reset())

    cls = ray.remote(restartable(PlannerActor))
    resources = {f"node:{node_ip}": 0.001} if node_ip else {}
    actor = cls.options(name=planner_actor_name(cluster), namespace=namespace, lifetime="detached", num_cpus=0,
                        resources=resources, max_restarts=PLANNER_MAX_RESTARTS, max_task_retries=0,
                        max_concurrency=100).remote(dataclasses.asdict(cfg))
    return actor, actor.start.remote()
