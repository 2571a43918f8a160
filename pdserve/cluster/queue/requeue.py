"""`requeue_on_worker_loss`: tell the queue when a worker leaves the registry."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.cluster.registry import Registry

log = logging.getLogger(__name__)


async def _tell_gone(queue, worker_id: str) -> None:
    try:
        await queue.worker_gone(worker_id)
    except Exception as exc:  # noqa: BLE001  (another decode worker may tell it; the queue may be gone)
        log.warning("could not tell the queue that %s is gone: %r", worker_id, exc)


async def requeue_on_worker_loss(registry: "Registry", queue, *, grace_s: float = 2.0):
    """Tell `queue` (a QueueClient or the actor handle) when a worker leaves the registry;
    returns the MemberWatch.

    A worker that comes back within `grace_s` (a re-registration after an
    etcd restart re-lists everyone as gone, then back) is not reported.
    Several processes may run this: `worker_gone` is idempotent.
    """
    pending: dict[str, asyncio.TimerHandle] = {}
    loop = asyncio.get_running_loop()

    def report(worker_id: str) -> None:
        pending.pop(worker_id, None)
        if hasattr(queue.worker_gone, "remote"):  # a Ray actor handle
            queue.worker_gone.remote(worker_id)
        else:  # a QueueClient
            asyncio.ensure_future(_tell_gone(queue, worker_id))
        log.info("worker %s left the registry; queue told", worker_id)

    def on_remove(info) -> None:
        if info.worker_id not in pending:
            pending[info.worker_id] = loop.call_later(grace_s, report, info.worker_id)

    def on_add(info) -> None:
        handle = pending.pop(info.worker_id, None)
        if handle is not None:
            handle.cancel()

    return await registry.watch_members(on_add=on_add, on_remove=on_remove)
