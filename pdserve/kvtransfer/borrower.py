"""The borrower's end of a prefix loan (kvtransfer/lend.py): `Borrower` asks another worker
for a prefix of a prompt, reads the lent blocks into this engine's pool, and hands them to the
engine's prefix cache once the holder confirmed the loan. Owner thread only
(kvtransfer/lending.py says who drives it).

A read that completed is used only once the holder confirmed that the loan was still live
when its release arrived (`LendConfirm` ok, from the holder life that granted it): the
holder's blocks were then pinned for the whole read (kvtransfer/lend.py says why). Neither
side's clock decides it.

A borrow ends in exactly one of these ways (`BorrowResult.outcome`):

- ``read``: the pages arrived and the holder confirmed the loan; they are this engine's
  cached prefix now (`KVConnector.end_borrow`), so the request that wanted them is
  scheduled with them as hits;
- ``stale``: the pages arrived but the holder answered that the loan had already ended
  (its lease ran out: the blocks may have been reused while they were read), or a holder
  life other than the granting one answered: they are dropped (the read is over, so the
  targets are freed at once); compute it;
- ``checksum_mismatch`` (``verify``): confirmed, but what arrived differs from the
  checksums the holder sent with the grant: dropped; compute it;
- ``refused``: the holder no longer caches the chain (or is busy): compute it;
- ``failed``: the read failed (the holder died, the link broke): compute it;
- ``timed_out``: no grant, no finished read, or no confirm by the deadline (half the
  lease). With a read still in flight, its target blocks may still be written, so they
  stay taken under a quarantine key for ``quarantine_s`` (`abandon_borrow`) before they
  are freed; a completed read's are freed at once. Compute it.

The deadline and the quarantine bound the wait and keep a read that may still land out of
blocks someone else owns; they no longer decide whether a read is trusted.

A borrow for a traced request (`Borrower.start`'s ``traceparent``) is a ``kv.borrow`` span
(kind client) of the tracer ``trace_as`` names, from the ask to its end, with its outcome; its
context rides in the request, so the holder's ``kv.lend`` is its child (kvtransfer/lender.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pdserve.common import jsonlog, tracing
from pdserve.kvtransfer.lend import (
    DEFAULT_LEASE_MS,
    MAX_LEND_BLOCKS,
    MAX_VERIFIED_BLOCKS,
    LendConfirm,
    LendGrant,
    LendMessage,
    LendRelease,
    LendRequest,
    reader_deadline,
)

log = logging.getLogger(__name__)

DEFAULT_QUARANTINE_S = 10.0
MIN_BORROW_BLOCKS = 2  # a shorter prefix held elsewhere is computed: one block is not worth a round trip


class Borrowed(Protocol):
    """Blocks taken for a lent prefix (engine/kv_connector.py `Borrow`): ``block_ids`` receive
    the lent blocks ``first..`` of the prompt's chain ``hashes``."""

    @property
    def hashes(self) -> Sequence[bytes]: ...

    @property
    def first(self) -> int: ...

    @property
    def block_ids(self) -> list[int]: ...


class BorrowingPool(Protocol):
    """What a borrower needs of this engine (engine/kv_connector.py `KVConnector`). A borrow
    goes back to the connector that began it: ``borrow`` is its own `Borrow`."""

    @property
    def block_size(self) -> int: ...

    def begin_borrow(self, token_ids: list[int], num_blocks: int, salt: bytes | None = None) -> Borrowed | None: ...

    def end_borrow(self, borrow: Any, ok: bool) -> int: ...

    def abandon_borrow(self, borrow: Any, quarantine_as: str) -> None: ...

    def block_checksums(self, block_ids: list[int]) -> list[int]: ...

    def free(self, key: str) -> None: ...


class ReadHandle(Protocol):
    """A read of lent blocks, as the transport reports it (a `TransferHandle`)."""

    @property
    def id(self) -> int: ...

    @property
    def finished(self) -> bool: ...

    @property
    def failed(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


@runtime_checkable
class RankedRead(ReadHandle, Protocol):
    """A read over several ranks (kvtransfer/nixl/tp_handles.py `TPRead`): not in the polls'
    handles; `refresh` asks the ranks how it stands (and sends the release once all arrived)."""

    @property
    def done(self) -> bool: ...

    def refresh(self) -> RankedRead: ...


class BorrowerTransport(Protocol):
    """What a borrower needs of the transport (a `TPSender` or a `KVTransferAgent`)."""

    def send_notification(self, peer: str, payload: bytes) -> None: ...

    def read_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                    notify: bytes | None = None) -> ReadHandle: ...


@runtime_checkable
class SplitTransport(Protocol):
    """A transport over tensor-parallel ranks (`TPSender`): this worker's TP size, a peer's."""

    tp: int

    def peer_tp(self, name: str) -> int: ...


@dataclass
class BorrowResult:
    lend_id: str
    holder: str
    outcome: str  # read | stale | checksum_mismatch | refused | failed | timed_out
    cached_tokens: int  # the prompt tokens this engine caches now (0 unless read)
    read_tokens: int = 0
    detail: str = ""
    tag: Any = None  # the owner's (e.g. the request waiting for it)
    elapsed_s: float = 0.0


@dataclass
class _Ticket:
    lend_id: str
    holder: str
    borrow: Borrowed
    sent_at: float
    deadline: float
    tag: Any  # the owner's
    verify: bool = False  # checksums asked for
    handle: ReadHandle | None = None  # the read, once granted
    epoch: int = 0  # the granting holder life's
    sums: tuple[int, ...] = ()  # the lent blocks' checksums as granted (verify)
    arrived: bool = False  # the read completed here (every rank's)
    confirmed: bool = False  # the holder confirmed the loan (ok, from the granting life)
    span: tracing.AnySpan = tracing.NO_SPAN  # its kv.borrow span (a traced request's)


@dataclass
class Borrower:
    """Borrows prefixes for this engine (owner thread only; see the module docstring).
    ``verify``: ask holders for the lent blocks' checksums and check what was read against
    them (network.kv_transport.verify; loans between single-rank workers only)."""

    connector: BorrowingPool
    agent: BorrowerTransport
    lease_ms: int = DEFAULT_LEASE_MS
    quarantine_s: float = DEFAULT_QUARANTINE_S
    clock: Callable[[], float] = time.monotonic
    verify: bool = False
    trace_as: str | None = None  # the component whose tracer makes the kv.borrow spans (None: none)
    tickets: dict[str, _Ticket] = field(default_factory=dict)
    results: list[BorrowResult] = field(default_factory=list)
    quarantined: dict[str, float] = field(default_factory=dict)  # key -> when its blocks are freed
    counters: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}-{id(self):x}"

    def _verifiable(self, holder: str) -> bool:
        """Whether a loan from ``holder`` can be checked: the checksums are of rank 0's pool on
        both sides, which holds every byte of a block only when neither side is split over
        tensor-parallel ranks."""
        if isinstance(self.agent, SplitTransport):
            return self.agent.tp == 1 and self.agent.peer_tp(holder) == 1
        return True  # one agent on each side (as far as this one knows)

    def start(self, token_ids: list[int], holder: str, blocks: int, salt: bytes | None = None,
              tag: Any = None, traceparent: str | None = None) -> str | None:
        """Ask ``holder`` for the first ``blocks`` blocks of ``token_ids``; the borrow's id, or
        None when there is nothing to borrow (this pool holds as much), no room, or the holder
        cannot be reached (the caller computes as usual). ``traceparent``: the span of the
        request it borrows for (W3C), the parent of its ``kv.borrow`` span."""
        verify = self.verify
        if verify and not self._verifiable(holder):
            verify = False
            if not self.counters["verify_skipped"]:
                log.warning("kv_transport.verify: loans from or to tensor-parallel workers are not checked")
            self.counters["verify_skipped"] += 1
        # A verified grant carries a sum per block: fewer blocks fit its notification.
        borrow = self.connector.begin_borrow(token_ids, min(blocks, MAX_VERIFIED_BLOCKS if verify else MAX_LEND_BLOCKS),
                                             salt)
        if borrow is None:
            return None
        lend_id = f"{self._prefix}-{next(self._ids)}"
        now = self.clock()
        span = tracing.tracer(self.trace_as).start("kv.borrow", traceparent, kind="client", attrs={
            "pdserve.holder": holder, "pdserve.lend_id": lend_id, "pdserve.blocks": len(borrow.hashes),
            "pdserve.verify": verify}) if traceparent and self.trace_as else tracing.NO_SPAN
        req = LendRequest(lend_id, borrow.hashes[-1], len(borrow.hashes), self.lease_ms, verify,
                          span.traceparent() or traceparent or "")
        try:
            self.agent.send_notification(holder, req.encode())
        except Exception as exc:  # noqa: BLE001  (an unknown or unreachable holder)
            self.connector.end_borrow(borrow, ok=False)
            self.counters["unreachable"] += 1
            log.info("prefix borrow from %s not started: %r", holder, exc, **_about(tag))
            span.set({"pdserve.outcome": "unreachable"})
            span.end()
            return None
        self.tickets[lend_id] = _Ticket(lend_id, holder, borrow, now, reader_deadline(now, self.lease_ms), tag, verify,
                                        span=span)
        self.counters["asked"] += 1
        return lend_id

    def handle(self, sender: str, msg: LendMessage) -> None:
        """A `LendGrant` or `LendConfirm` for one of this borrower's tickets (others are ignored)."""
        if isinstance(msg, LendConfirm):
            self._confirm(sender, msg)
            return
        if not isinstance(msg, LendGrant):
            return
        t = self.tickets.get(msg.lend_id)
        if t is None or t.holder != sender or t.handle is not None:
            self.counters["stray_grants"] += 1
            return
        if not msg.granted:
            self._finish(t, "refused", msg.reason)
            return
        if len(msg.block_ids) != len(t.borrow.hashes):
            self._release(t)
            self._finish(t, "refused", f"granted {len(msg.block_ids)} blocks, asked {len(t.borrow.hashes)}")
            return
        if t.verify and len(msg.sums) != len(msg.block_ids):
            self._release(t)
            self._finish(t, "refused", "no checksums in the grant")
            return
        t.epoch, t.sums = msg.epoch, msg.sums
        theirs = list(msg.block_ids[t.borrow.first:])
        try:
            # The release (the read's notification, sent once it completed) carries the grant's
            # epoch: the holder answers it with a confirm, which alone lets the pages be used.
            t.handle = self.agent.read_blocks(t.holder, t.borrow.block_ids, theirs,
                                              notify=LendRelease(t.lend_id, t.epoch).encode())
        except Exception as exc:  # noqa: BLE001  (a layout mismatch, the holder removed)
            self._release(t)
            self._finish(t, "failed", f"{exc.__class__.__name__}: {exc}")
            return
        if t.handle.failed:  # NIXL refused it at once (at TP, a rank's part of it may still move)
            self._failed(t)

    def _confirm(self, sender: str, msg: LendConfirm) -> None:
        t = self.tickets.get(msg.lend_id)
        if t is None or t.holder != sender or t.handle is None:
            self.counters["stray_confirms"] += 1  # (a ticket that ended already: its deadline passed)
            return
        if not msg.ok or msg.epoch != t.epoch:
            # The loan had ended when the release arrived (its blocks may have been reused under
            # the read), or another life of the holder answers: nothing read is used.
            detail = "the holder's loan had ended before the read's release reached it" if not msg.ok else \
                "answered by another holder life than the one that granted"
            self._finish(t, "stale", detail)
            return
        t.confirmed = True
        self.counters["confirmed"] += 1
        if t.arrived:
            self._use(t)
        # (else the read's completion is reported by a later poll: the holder saw its release first)

    def transfers(self, completed: Iterable[ReadHandle], failed: Iterable[ReadHandle]) -> None:
        """Reads that finished (from `agent.poll()`): ``completed`` and ``failed`` handles. A read
        over several ranks (`TPRead`, either side tensor-parallel) is asked how it stands."""
        by_handle: dict[int, _Ticket] = {}
        for t in list(self.tickets.values()):
            if t.handle is None or t.arrived:
                continue
            if not isinstance(t.handle, RankedRead):
                by_handle[t.handle.id] = t
            elif t.handle.refresh().failed:
                self._failed(t)
            elif t.handle.done:  # (its refresh sent the release, now that every rank's read arrived)
                self._arrived(t)
        for h in completed:
            hit = by_handle.get(h.id)
            if hit is not None:
                self._arrived(hit)
        for h in failed:
            hit = by_handle.get(h.id)
            if hit is not None:
                self._failed(hit)

    def _arrived(self, t: _Ticket) -> None:
        """The read completed (the release is on its way): used once the holder confirms."""
        t.arrived = True
        if t.confirmed:
            self._use(t)

    def _use(self, t: _Ticket) -> None:
        if t.sums:
            got = self.connector.block_checksums(t.borrow.block_ids)
            want = list(t.sums[t.borrow.first:])
            if got != want:
                bad = [i for i, (a, b) in enumerate(zip(got, want), start=t.borrow.first) if a != b]
                log.error("prefix loan %s from %s: blocks %s differ from the holder's checksums", t.lend_id,
                          t.holder, bad)
                self._finish(t, "checksum_mismatch", f"blocks {bad} differ from the holder's checksums")
                return
        self._finish(t, "read")

    def _failed(self, t: _Ticket) -> None:
        self._release(t)
        self._finish(t, "failed", (t.handle.error if t.handle is not None else None) or "the read failed")

    def expire(self) -> None:
        """End the tickets past their deadline; free quarantines whose time is up."""
        now = self.clock()
        for t in [t for t in self.tickets.values() if now > t.deadline]:
            if t.handle is None:
                self._release(t)  # a late grant is refused below; the holder unpins now, not at its lease end
                self._finish(t, "timed_out", "no answer from the holder")
            elif t.arrived:  # (its release went with the read; the holder's answer is lost or late)
                self._finish(t, "timed_out", "no confirm from the holder")
            else:
                if isinstance(t.handle, RankedRead):
                    t.handle.refresh()  # (whether another rank's read may still land: quarantine)
                self._finish(t, "timed_out", "the read did not finish in time")
        for key, until in list(self.quarantined.items()):
            if now >= until:
                self.connector.free(key)
                del self.quarantined[key]

    def take_results(self) -> list[BorrowResult]:
        out, self.results = self.results, []
        return out

    def _release(self, t: _Ticket) -> None:
        """Give the loan up (no epoch: the holder unpins and confirms nothing)."""
        try:
            self.agent.send_notification(t.holder, LendRelease(t.lend_id).encode())
        except Exception:  # noqa: BLE001  (the holder is gone: nothing to release)
            pass

    def _finish(self, t: _Ticket, outcome: str, detail: str = "") -> None:
        self.tickets.pop(t.lend_id, None)
        cached, read = 0, 0
        if outcome == "read":
            cached = self.connector.end_borrow(t.borrow, ok=True)
            read = len(t.borrow.block_ids) * self.connector.block_size
        elif t.handle is not None and not t.arrived and not t.handle.finished:
            # The read may still land in these blocks (timed out, or at TP one rank's read
            # failed while another's goes on).
            key = f"lend-quarantine-{t.lend_id}"
            self.connector.abandon_borrow(t.borrow, key)
            self.quarantined[key] = self.clock() + self.quarantine_s
        else:  # nothing read, or a read that is over: nothing lands in the targets any more
            self.connector.end_borrow(t.borrow, ok=False)
        self.counters[outcome] += 1
        if outcome != "read":
            log.info("prefix borrow %s from %s: %s (%s); computing it instead", t.lend_id, t.holder, outcome, detail,
                     **_about(t.tag))
        t.span.set({"pdserve.outcome": outcome, "pdserve.read_tokens": read, "pdserve.cached_tokens": cached,
                    "pdserve.detail": detail or None})
        t.span.end()
        self.results.append(BorrowResult(t.lend_id, t.holder, outcome, cached, read, detail, t.tag,
                                         self.clock() - t.sent_at))


def _about(tag: Any) -> dict[str, Any]:
    """A log line's ``extra`` naming the request a borrow is for (its owner's tag: the request id)."""
    return {"extra": jsonlog.about(tag)} if isinstance(tag, str) else {}
