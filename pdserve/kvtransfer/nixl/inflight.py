"""`InFlightWrites`: the page writes an agent has posted, and what became of them.

Posts each write to NIXL, drives the posted ones (`progress`: asks NIXL for each
one's state, settles it DONE or FAILED and releases its NIXL handle; a release
that fails is retried at close) and collects the notifications received, until
the agent's next `poll()` takes them. It has no lock and holds no NIXL agent:
`KVTransferAgent` (kvtransfer/nixl/agent.py) calls it under its own lock and passes
its NIXL agent in.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from pdserve.kvtransfer.nixl.descriptors import WritePlan
from pdserve.kvtransfer.nixl.errors import TransferError
from pdserve.kvtransfer.nixl.peer import PeerInfo
from pdserve.kvtransfer.nixl.transfer import Notification, PollResult, TransferHandle, TransferState

log = logging.getLogger(__name__)


class InFlightWrites:
    """Numbers and tracks one agent's writes; keeps the finished ones and the notifications
    received since the last `take()`."""

    def __init__(self, errors: tuple[type[BaseException], ...]):
        self._errors = errors  # NIXL's exception classes
        self.handles: dict[int, TransferHandle] = {}  # posted, not finished yet
        self._ids = itertools.count(1)
        self._completed: list[TransferHandle] = []
        self._failed: list[TransferHandle] = []
        self._inbox: list[Notification] = []
        self._unreleased: list[Any] = []  # NIXL handles whose release failed; retried at close

    def post(
        self, nixl: Any, peer: PeerInfo, plan: WritePlan, notify: bytes | None, local: Any, local_mem_type: str,
        op: str = "WRITE", remote_addr: int | None = None,
    ) -> TransferHandle:
        """Post one WRITE of `plan` (`local`: our pool's descriptor rows) into `peer`'s pool, or
        with ``op="READ"`` one read of the plan's remote ranges into our local ones.

        ``remote_addr``: the base of another of the peer's pools (kvtransfer/nixl/pools.py) than
        its model's. NIXL errors fail the returned handle instead of raising."""
        remote = plan.remote_rows(peer.pool_addr if remote_addr is None else remote_addr, peer.device_id)
        handle = TransferHandle(
            id=next(self._ids),
            peer=peer.name,
            num_bytes=plan.num_bytes,
            num_descriptors=plan.num_descriptors,
            layers=plan.layers,
            notify=notify,
        )
        try:
            handle._xfer = nixl.initialize_xfer(
                op,
                nixl.get_xfer_descs(local, local_mem_type),
                nixl.get_xfer_descs(remote, peer.mem_type),
                peer.name,
                notify or b"",
            )
            self.handles[handle.id] = handle
            state = nixl.transfer(handle._xfer)
        except self._errors as exc:  # e.g. the peer disconnected: the caller learns it via the handle
            self.fail(handle, f"NIXL could not post the {op.lower()}: {exc!r}")
            return handle
        self.settle(handle, state)
        return handle

    def progress(self, nixl: Any) -> None:
        """Settle every write NIXL reports finished; collect the notifications received."""
        for handle in list(self.handles.values()):
            try:
                state = nixl.check_xfer_state(handle._xfer)
            except self._errors as exc:
                self.fail(handle, f"NIXL reported {exc!r}")
                continue
            self.settle(handle, state)
        try:
            received = nixl.get_new_notifs()
        except self._errors as exc:
            raise TransferError(f"NIXL could not fetch notifications: {exc!r}") from exc
        for sender, payloads in received.items():
            sender_name = sender.decode() if isinstance(sender, bytes) else str(sender)
            self._inbox.extend(Notification(sender_name, bytes(p)) for p in payloads)

    def take(self) -> PollResult:
        """The writes finished and the notifications received since the last call."""
        result = PollResult(self._completed, self._failed, self._inbox)
        self._completed, self._failed, self._inbox = [], [], []
        return result

    def settle(self, handle: TransferHandle, state: str) -> None:
        if state == "DONE":
            self._finish(handle, TransferState.DONE)
            self._completed.append(handle)
        elif state == "ERR":
            self.fail(handle, "NIXL reported the write as failed (peer gone or transport error)")

    def fail(self, handle: TransferHandle, reason: str) -> None:
        handle.error = reason
        self._finish(handle, TransferState.FAILED)
        self._failed.append(handle)

    def fail_all(self, reason: str, peer: str | None = None) -> None:
        """Fail every write in flight (only those to `peer`, if given)."""
        for handle in [h for h in self.handles.values() if peer is None or h.peer == peer]:
            self.fail(handle, reason)

    def _finish(self, handle: TransferHandle, state: TransferState) -> None:
        handle.state = state
        handle.finished_at = time.perf_counter()
        self.handles.pop(handle.id, None)
        xfer, handle._xfer = handle._xfer, None
        if xfer is not None:
            self._release(xfer)

    def _release(self, xfer: Any) -> None:
        try:
            xfer.release()
        except self._errors as exc:  # an unfinished write cannot always be cancelled at once
            log.debug("NIXL transfer release deferred: %r", exc)
            self._unreleased.append(xfer)

    def release_deferred(self) -> None:
        """Retry the releases that failed (at close)."""
        pending, self._unreleased = self._unreleased, []
        for xfer in pending:
            try:
                xfer.release()
            except self._errors as exc:
                log.warning("NIXL transfer handle could not be released at close: %r", exc)
