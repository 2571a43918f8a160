"""The other workers as a prefill worker's sender knows them: their NIXL records and who lends.

A decode worker's NIXL record is read from etcd the first time one of its tasks names it, or
ahead of need as it joins (`met`, the worker's member watches); so is a lending prefill
worker's (its record's capacity says it lends, kvtransfer/lend.py `lends`), and a borrower's
that asked this worker for a loan. Records are read on the event loop into ``pending`` and
registered with the sender by the batch thread, its only user (`sync`, under the worker's
engine lock): at a batch's start, or between its steps for a peer met mid-batch. A worker that
leaves (`gone`) is removed from the sender at the next batch's start.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable

from pdserve.cluster.records import WorkerInfo
from pdserve.cluster.registry import Registry
from pdserve.kvtransfer.lend import lends
from pdserve.kvtransfer.nixl.tp_sender import TPSender

log = logging.getLogger(__name__)

PEER_LOOKUP_TIMEOUT_S = 5.0


class Peers:
    """The NIXL peers of one prefill worker's sender (see the module docstring). The event loop
    reads records (`met`, `gone`, `fetch`, `record`, `meet_lenders`); the batch thread
    registers them (`sync`)."""

    def __init__(self, worker_id: str, registry: Registry, sender: TPSender):
        self.worker_id = worker_id
        self.registry = registry
        self.sender = sender
        self.known: set[str] = set()  # the workers whose NIXL records the sender loaded
        # NIXL records read ahead of need (workers met as they joined, borrowers met mid-batch),
        # for the batch thread to register: at a batch's start or between its steps.
        self.pending: dict[str, dict] = {}
        self._to_remove: set[str] = set()  # gone, for the batch thread to remove
        self.lenders: dict[str, bool] = {}  # worker id -> its record says it lends prefixes (as last read)

    # -- the event loop ------------------------------------------------------------------
    def gone(self, info: WorkerInfo) -> None:
        """A vanished worker's pages are gone: forget its NIXL agent."""
        self.pending.pop(info.worker_id, None)
        if info.role == "prefill":
            self.lenders.pop(info.worker_id, None)
        if info.worker_id in self.known:
            self.known.discard(info.worker_id)
            self._to_remove.add(info.worker_id)

    async def met(self, info: WorkerInfo) -> None:
        """A decode worker's record, or a lending prefill worker's: read its NIXL record now, for
        the batch thread to register before a task or a loan needs it."""
        name = info.worker_id
        if name == self.worker_id:
            return
        if info.role == "prefill":
            self.lenders[name] = lends(info.capacity)
            if not self.lenders[name]:
                return
        if name in self.known or name in self.pending:
            return
        problem = await self.fetch(name, self.pending)
        if problem is not None:
            log.debug("%s not met yet: %s", name, problem)

    async def record(self, role: str, worker_id: str) -> WorkerInfo | None:
        """A worker's etcd record (None: not registered), noting whether it lends; raises when
        etcd cannot answer within PEER_LOOKUP_TIMEOUT_S (or the record is malformed)."""
        info = await asyncio.wait_for(self.registry.member(role, worker_id), PEER_LOOKUP_TIMEOUT_S)
        self.lenders[worker_id] = info is not None and lends(info.capacity)
        return info

    async def meet_lenders(self, holders: Iterable[str], new_peers: dict[str, dict]) -> None:
        """The holders of prefixes worth borrowing (other prefill workers a task's hint names):
        whether each lends (its record, read once), and the NIXL records of those that do into
        ``new_peers``; one whose record cannot be read lends nothing this batch."""
        for holder in dict.fromkeys(h for h in holders if h != self.worker_id):
            if holder not in self.lenders:
                try:
                    await self.record("prefill", holder)
                except Exception:  # noqa: BLE001  (etcd slow: no loan from it this batch)
                    self.lenders[holder] = False
            if self.lenders[holder] and await self.fetch(holder, new_peers) is not None:
                self.lenders[holder] = False

    async def fetch(self, worker_id: str, new_peers: dict[str, dict]) -> str | None:
        """Fetch a worker's NIXL record from etcd (a decode worker, the first time it is a
        target or as it joins; a lending prefill worker or a borrower) into ``new_peers``; why it
        cannot be used, or None."""
        if worker_id in self.known or worker_id in new_peers:
            return None
        try:
            raw = await asyncio.wait_for(self.registry.get_nixl_metadata(worker_id), PEER_LOOKUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001  (etcd down or slow)
            return f"could not read its NIXL metadata from etcd: {exc!r}"
        if raw is None:
            return f"worker {worker_id} has no NIXL metadata in etcd (not registered, or its lease expired)"
        try:
            new_peers[worker_id] = json.loads(raw)
        except ValueError as exc:
            return f"worker {worker_id}'s NIXL record is not JSON: {exc}"
        return None

    # -- the batch thread ----------------------------------------------------------------
    def sync(self, new_peers: dict[str, dict], unusable: dict[str, str], mid_batch: bool = False) -> bool:
        """Apply peer changes (under the engine lock: the sender's only user): ``new_peers`` and
        those read ahead (``pending``). A record NIXL or the layout check refuses makes that
        peer unusable for this batch, not the batch fail. Whether any peer was added.
        ``mid_batch`` (between a batch's steps): only new peers are added; removals and
        re-registrations wait for the next batch's start, since the batch may be writing to them."""
        sender = self.sender
        while self._to_remove and not mid_batch:
            sender.remove_peer(self._to_remove.pop())
        while self.pending:  # (filled on the event loop; popitem is atomic)
            name, info = self.pending.popitem()
            new_peers.setdefault(name, info)
        added = False
        for name, info in new_peers.items():
            if name in self.known:
                continue  # met already (ahead of need, and then named by this batch too)
            if mid_batch and name in sender.peers:
                self.pending.setdefault(name, info)  # a re-registration: at the next batch's start
                continue
            try:
                if name in sender.peers:  # re-registered decode worker: new metadata
                    sender.remove_peer(name)
                sender.add_peer(info)
                self.known.add(name)
                added = True
            except Exception as exc:  # noqa: BLE001  (LayoutMismatchError, MalformedMessageError, TransferError)
                unusable[name] = f"its NIXL record was refused: {exc.__class__.__name__}: {exc}"
        return added
