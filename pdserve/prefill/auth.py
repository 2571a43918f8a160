"""Which tasks of a batch a prefill worker may run: those their target decode worker signed.

Before anything is computed or written, every task must carry a valid signature of the decode
worker it targets (the key in that worker's etcd record; cluster/queue/signing.py): a task that
names blocks its decode worker did not reserve and sign is dropped and counted
(`pdserve_prefill_tasks_rejected`).
"""

from __future__ import annotations

import logging

from pdserve.cluster.queue import BAD_SIGNATURE, NO_KEY, verify_task
from pdserve.kvtransfer.task import PrefillTask

from .values import PrefillStats
from .peers import Peers

log = logging.getLogger(__name__)


class TaskGate:
    """Checks each task's signature against its target's published task key, read from the
    target's etcd record (through `Peers.record`, which also notes whether it lends) and kept
    until that worker leaves (`forget`) or a signature fails against it (read again, once a
    batch: the worker may have restarted with a new key)."""

    def __init__(self, peers: Peers, stats: PrefillStats):
        self.peers = peers
        self.stats = stats
        self._keys: dict[str, str] = {}  # decode worker id -> its published task key, as last read

    async def admit(self, tasks: list[PrefillTask]) -> list[PrefillTask]:
        """The tasks their target decode worker signed. The others are dropped here, before any
        compute, NIXL peer or write, and counted; nobody is told (a PrefillFailed, or a `fail`
        through the queue, for a forged task would let its forger end the attempt it names of
        some other request). The queue forgets them when the batch completes."""
        accepted: list[PrefillTask] = []
        refreshed: set[str] = set()
        for t in tasks:
            target = t.target_worker_id
            reason = verify_task(t, await self.key(target))
            if reason in (BAD_SIGNATURE, NO_KEY) and target not in refreshed:
                refreshed.add(target)  # its key may be new (it restarted): read the record again, once a batch
                reason = verify_task(t, await self.key(target, refresh=True))
            if reason is None:
                accepted.append(t)
                continue
            self.stats.tasks_rejected += 1
            self.stats.rejected_by_reason[reason] += 1
            log.warning("task %s (epoch %s) for %s, blocks %s, refused before any work: %s", t.request_id, t.epoch,
                        target, t.target_block_ids[:8], reason)
        return accepted

    async def key(self, worker_id: str, refresh: bool = False) -> str | None:
        """The task key decode worker `worker_id` publishes in its etcd record (None: none)."""
        if not refresh and worker_id in self._keys:
            return self._keys[worker_id]
        try:
            info = await self.peers.record("decode", worker_id)
        except Exception as exc:  # noqa: BLE001  (etcd down or slow, a malformed record: no key to trust)
            log.warning("could not read the task key of decode worker %s: %r", worker_id, exc)
            return None
        key = info.task_key if info is not None and info.task_key else None
        if key is None:
            self._keys.pop(worker_id, None)
        else:
            self._keys[worker_id] = key
        return key

    def forget(self, worker_id: str) -> None:
        """A worker left: its key is read again should it come back."""
        self._keys.pop(worker_id, None)
