"""How the planner acts: backends that start and stop workers.

A backend has async `start(role, worker_id, flexible)` (begin starting one
worker; the planner sees it arrive in etcd), `stop(worker_id, actor)` (end its
process, after the planner drained it through etcd) and `flip(worker_id, role,
new_worker_id, actor)` (a FlexWorker drains and comes back as the other role). Draining itself is backend-independent
(the worker's drain key), so every backend drains the same way.

`RayBackend` starts workers as detached Ray actors through
`actors.start_worker_actor`, the same call `pdserve up` and `pdserve worker`
use; on a `ray up` cluster, Ray's autoscaler turns an actor that fits no node
into a new node of the type its resources name. There is no Kubernetes
backend: nothing here can run a Kubernetes API server to test one against
(see docs/planner.md); on Kubernetes, scale the chart's Deployments instead.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.cluster.topology import Topology

log = logging.getLogger(__name__)


def replica_index(worker_id: str) -> int:
    """The port offset of a worker named `<role>-<n>`: n (0 for other names)."""
    tail = worker_id.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0


class RayBackend:
    """Workers as detached Ray actors named `<cluster>-<worker_id>` in the topology's namespace."""

    name = "ray"

    def __init__(self, topology: Topology, model: str, etcd_endpoints: list[str]):
        self.topo = topology
        self.model = model
        self.etcd_endpoints = list(etcd_endpoints)

    def actor_name(self, worker_id: str) -> str:
        from pdserve.cluster.actors import actor_name

        return actor_name(self.topo.cluster, worker_id)

    async def start(self, role: str, worker_id: str, flexible: bool = False) -> None:
        from pdserve.cluster.actors import start_worker_actor

        await asyncio.to_thread(start_worker_actor, self.topo, role, replica_index(worker_id), model=self.model,
                                etcd_endpoints=self.etcd_endpoints, worker_id=worker_id, flexible=flexible)

    def _actor(self, worker_id: str, actor: str | None):
        import ray

        try:
            return ray.get_actor(actor or self.actor_name(worker_id), namespace=self.topo.ray.namespace)
        except ValueError:
            return None  # never started, or already gone

    async def stop(self, worker_id: str, actor: str | None = None) -> None:
        import ray

        from pdserve.cluster.actors import remove_ranks_group

        handle = self._actor(worker_id, actor)
        if handle is None:
            return
        try:  # the worker drained already; stop() closes its servers before the kill
            await asyncio.wait_for(handle.stop.remote(), 20.0)
        except Exception as exc:  # noqa: BLE001  (dead or stuck: killed anyway)
            log.warning("stop of %s: %r; killing it", worker_id, exc)
        ray.kill(handle)
        remove_ranks_group(actor or self.actor_name(worker_id))

    async def flip(self, worker_id: str, role: str, new_worker_id: str, actor: str | None = None) -> None:
        """Ask a FlexWorker to drain and come back as `role` under `new_worker_id`; returns at
        once (the planner follows the flip through etcd). Failures are logged."""
        handle = self._actor(worker_id, actor)
        if handle is None:
            raise RuntimeError(f"no process for {worker_id} (actor {actor or self.actor_name(worker_id)})")
        ref = handle.flip.remote(role, new_worker_id)

        async def follow():
            try:
                info = await ref
                log.warning("%s now serves as %s %s", worker_id, role, info.get("worker_id"))
            except Exception as exc:  # noqa: BLE001
                log.error("flip of %s to %s failed: %r", worker_id, role, exc)

        self._follow = asyncio.ensure_future(follow())
