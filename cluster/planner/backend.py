"""How the planner acts: backends that start and stop workers.

A backend has async `start(role, worker_id)` (begin starting one worker; the
planner sees it arrive in etcd) and `stop(worker_id)` (end its process, after
the planner drained it through etcd). Draining itself is backend-independent
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

from ..topology import Topology

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

    async def start(self, role: str, worker_id: str) -> None:
        from ..actors import start_worker_actor

        await asyncio.to_thread(start_worker_actor, self.topo, role, replica_index(worker_id), model=self.model,
                                etcd_endpoints=self.etcd_endpoints, worker_id=worker_id)

    async def stop(self, worker_id: str) -> None:
        import ray

        from ..actors import actor_name

        try:
            actor = ray.get_actor(actor_name(self.topo.cluster, worker_id), namespace=self.topo.ray.namespace)
        except ValueError:
            return  # never started, or already gone
        try:  # the worker drained already; stop() closes its servers before the kill
            await asyncio.wait_for(actor.stop.remote(), 20.0)
        except Exception as exc:  # noqa: BLE001  (dead or stuck: killed anyway)
            log.warning("stop of %s: %r; killing it", worker_id, exc)
        ray.kill(actor)


class RecordingBackend:
    """Acts on nothing: records what it was asked (dry runs, tests of the decision path)."""

    name = "recording"

    def __init__(self):
        self.calls: list[tuple[str, str, str]] = []

    async def start(self, role: str, worker_id: str) -> None:
        self.calls.append(("start", role, worker_id))

    async def stop(self, worker_id: str) -> None:
        self.calls.append(("stop", "", worker_id))
