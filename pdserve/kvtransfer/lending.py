"""Both ends of a prefix loan (kvtransfer/lend.py) over one worker's agent and engine.

`Lender` answers other workers' `LendRequest`s from this engine's prefix cache; `Borrower`
borrows a prefix from another worker and reads it into this engine's pool. Both run on
the one thread that owns the engine and the agent (a decode worker's engine thread, a
prefill worker's batch thread): the owner hands them the notifications and finished
transfers of each `agent.poll()` and calls `expire()` now and then. A worker is usually
both: it lends what it caches and borrows what it lacks.

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
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pdserve.kvtransfer.lend import (
    BUSY,
    DEFAULT_LEASE_MS,
    GONE,
    MAX_LEND_BLOCKS,
    MAX_VERIFIED_BLOCKS,
    TOO_MANY,
    LendConfirm,
    LendGrant,
    LendRelease,
    LendRequest,
    LendTable,
    MalformedLendError,
    OldLendVersionError,
    decode_lend,
    is_lend_message,
    new_epoch,
    reader_deadline,
)

log = logging.getLogger(__name__)

DEFAULT_QUARANTINE_S = 10.0


class Lender:
    """Grants and ends loans of this engine's cached chains (owner thread only)."""

    def __init__(self, connector: Any, agent: Any, max_blocks: int = 4096, clock=time.monotonic):
        self.connector, self.agent, self.clock = connector, agent, clock
        self.table = LendTable(max_blocks=max_blocks)
        # This life's epoch, in every grant and confirm: a holder restarted under the same name
        # draws another, so it never confirms a loan its previous life granted.
        self.epoch = new_epoch()
        self.counters: Counter = Counter()
        # Requests from borrowers this agent cannot answer yet (no NIXL metadata of theirs
        # loaded): the owner fetches it (`waiting_for_peers`), adds the peer, then `retry()`.
        self.waiting: list[tuple[str, LendRequest, float]] = []
        # Requests whose chain is being loaded back from the second tier: (borrower, request,
        # the TierLoad, since); answered by `expire()` once loaded.
        self.loading: list[tuple[str, LendRequest, Any, float]] = []
        self._unanswered: list = []  # loads still running for requests refused meanwhile

    def waiting_for_peers(self) -> set[str]:
        return {sender for sender, _, _ in self.waiting}

    def retry(self) -> None:
        """Answer the waiting requests whose borrower is known now; drop those older than
        their lease (the borrower gave up long ago)."""
        waiting, self.waiting = self.waiting, []
        now = self.clock()
        for sender, msg, since in waiting:
            if now - since > msg.lease_ms / 2e3:
                self.counters["dropped_unknown_borrower"] += 1
            else:
                self.handle(sender, msg)

    def handle(self, sender: str, msg) -> None:
        """A `LendRequest` or `LendRelease` from ``sender`` (grants and confirms are a borrower's
        business)."""
        if isinstance(msg, LendRequest) and sender not in self.agent.peers:
            self.waiting.append((sender, msg, self.clock()))
            self.counters["awaiting_peer"] += 1
            return
        if isinstance(msg, LendRelease):
            self._released(sender, msg)
            return
        if not isinstance(msg, LendRequest):
            return
        reason = ""
        ids = None
        if msg.blocks > (MAX_VERIFIED_BLOCKS if msg.verify else MAX_LEND_BLOCKS):
            reason = TOO_MANY
        elif not self.table.has_room(msg.blocks + self._loading_blocks()):
            reason = BUSY
        else:
            ids = self.connector.lend_chain(msg.tail_hash, msg.blocks)
            if ids is None:
                # Part of the chain may have left the pool for the second tier: load it back,
                # then grant (`_answer_loaded`), well inside the borrower's deadline.
                load = self.connector.load_chain(msg.tail_hash, msg.blocks, f"lend-load-{sender}-{msg.lend_id}")
                if load is not None:
                    self.loading.append((sender, msg, load, self.clock()))
                    self.counters["loading_from_tier"] += 1
                    return
                reason = GONE
        self._answer(sender, msg, ids, reason)

    def _released(self, sender: str, msg: LendRelease) -> None:
        """The borrower is done. A release that carries an epoch follows a completed read: answer
        whether the loan was live until now (then its blocks were pinned for the whole read),
        and from which life; then unpin."""
        loan = self.table.release(sender, msg.lend_id)
        if msg.epoch:
            ok = loan is not None and msg.epoch == self.epoch
            self.counters["confirmed" if ok else "stale"] += 1
            try:
                self.agent.send_notification(sender, LendConfirm(msg.lend_id, ok, self.epoch).encode())
            except Exception as exc:  # noqa: BLE001  (the borrower is gone: it used nothing unconfirmed)
                log.info("could not confirm loan %s to %s: %r", msg.lend_id, sender, exc)
            if not ok:
                log.warning("prefix loan %s of %s: %s; answered stale", msg.lend_id, sender,
                            "released after it ended" if loan is None else "the release names another holder life")
        if loan is not None:
            self.connector.unlend(list(loan.block_ids))
            self.counters["released"] += 1

    def _answer(self, sender: str, msg: LendRequest, ids: list[int] | None, reason: str) -> None:
        sums: tuple[int, ...] = ()
        if ids and msg.verify:
            # The blocks' bytes as granted (a later sum would vouch for whatever wrote them since).
            try:
                sums = tuple(self.connector.block_checksums(ids))
            except Exception as exc:  # noqa: BLE001  (the borrower, which asked for sums, refuses the grant)
                log.warning("checksums of lent blocks failed: %r", exc)
        if ids is not None:
            self.table.add(sender, msg, tuple(ids), self.clock())
        grant = LendGrant(msg.lend_id, tuple(ids or ()), reason, self.epoch, sums)
        self.counters["granted" if ids else f"refused_{reason}"] += 1
        try:
            self.agent.send_notification(sender, grant.encode())
        except Exception as exc:  # noqa: BLE001  (the borrower is gone: its lease ends the loan)
            log.warning("could not answer lend request %s from %s: %r", msg.lend_id, sender, exc)

    def _loading_blocks(self) -> int:
        return sum(msg.blocks for _, msg, _, _ in self.loading)

    def _answer_loaded(self) -> None:
        """Grant the loans whose chain came back from the tier; refuse those whose load failed,
        or that the borrower's deadline passed while loading (it no longer waits)."""
        if not (self.loading or self._unanswered):
            return
        # Which loads had finished before they are registered (one finishing in between waits
        # for the next call, rather than be lent unregistered).
        done = {id(load) for load in self._unanswered + [w[2] for w in self.loading] if load.finished}
        self.connector.finish_tier_loads()  # (an idle engine takes no step that would)
        self._unanswered = [load for load in self._unanswered if id(load) not in done]
        now = self.clock()
        waiting, self.loading = self.loading, []
        for sender, msg, load, since in waiting:
            if id(load) not in done:
                if now - since <= msg.lease_ms / 4e3:  # (half the borrower's wait: it must still read)
                    self.loading.append((sender, msg, load, since))
                else:  # the load goes on (its blocks join the cache when it ends), the borrower computes
                    self._unanswered.append(load)
                    self._answer(sender, msg, None, GONE)
                continue
            ids = self.connector.lend_chain(msg.tail_hash, msg.blocks) if load.error is None else None
            if ids is not None:
                self.counters["granted_from_tier"] += 1
            self._answer(sender, msg, ids, "" if ids is not None else GONE)

    def expire(self) -> int:
        """Answer the loans loaded back from the tier; unpin the loans whose lease ended without
        a release."""
        self._answer_loaded()
        loans = self.table.take_expired(self.clock())
        for loan in loans:
            self.connector.unlend(list(loan.block_ids))
        if loans:
            self.counters["expired"] += len(loans)
            log.warning("%d prefix loan(s) ended by their lease, not by a release (borrowers %s)", len(loans),
                        sorted({loan.borrower for loan in loans}))
        return len(loans)

    def borrower_gone(self, name: str) -> None:
        for loan in self.table.take_borrower(name):
            self.connector.unlend(list(loan.block_ids))
        gone = [w for w in self.loading if w[0] == name]
        if gone:  # their loads go on (their blocks join the cache), unanswered
            self.loading = [w for w in self.loading if w[0] != name]
            self._unanswered += [load for _, _, load, _ in gone]


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
    borrow: Any  # KVConnector Borrow
    sent_at: float
    deadline: float
    tag: Any
    verify: bool = False  # checksums asked for
    handle: Any = None
    epoch: int = 0  # the granting holder life's
    sums: tuple[int, ...] = ()  # the lent blocks' checksums as granted (verify)
    arrived: bool = False  # the read completed here (every rank's)
    confirmed: bool = False  # the holder confirmed the loan (ok, from the granting life)


@dataclass
class Borrower:
    """Borrows prefixes for this engine (owner thread only; see the module docstring).
    ``verify``: ask holders for the lent blocks' checksums and check what was read against
    them (network.kv_transport.verify; loans between single-rank workers only)."""

    connector: Any
    agent: Any
    lease_ms: int = DEFAULT_LEASE_MS
    quarantine_s: float = DEFAULT_QUARANTINE_S
    clock: Any = time.monotonic
    verify: bool = False
    tickets: dict[str, _Ticket] = field(default_factory=dict)
    results: list[BorrowResult] = field(default_factory=list)
    quarantined: dict[str, float] = field(default_factory=dict)  # key -> when its blocks are freed
    counters: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}-{id(self):x}"

    def _verifiable(self, holder: str) -> bool:
        """Whether a loan from ``holder`` can be checked: the checksums are of rank 0's pool on
        both sides, which holds every byte of a block only when neither side is split over
        tensor-parallel ranks."""
        peer_tp = getattr(self.agent, "peer_tp", None)
        return getattr(self.agent, "tp", 1) == 1 and (peer_tp is None or peer_tp(holder) == 1)

    def start(self, token_ids: list[int], holder: str, blocks: int, salt: bytes | None = None,
              tag: Any = None) -> str | None:
        """Ask ``holder`` for the first ``blocks`` blocks of ``token_ids``; the borrow's id, or
        None when there is nothing to borrow (this pool holds as much), no room, or the holder
        cannot be reached (the caller computes as usual)."""
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
        req = LendRequest(lend_id, borrow.hashes[-1], len(borrow.hashes), self.lease_ms, verify)
        try:
            self.agent.send_notification(holder, req.encode())
        except Exception as exc:  # noqa: BLE001  (an unknown or unreachable holder)
            self.connector.end_borrow(borrow, ok=False)
            self.counters["unreachable"] += 1
            log.info("prefix borrow from %s not started: %r", holder, exc)
            return None
        self.tickets[lend_id] = _Ticket(lend_id, holder, borrow, now, reader_deadline(now, self.lease_ms), tag, verify)
        self.counters["asked"] += 1
        return lend_id

    def handle(self, sender: str, msg) -> None:
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

    def transfers(self, completed, failed) -> None:
        """Reads that finished (from `agent.poll()`): ``completed`` and ``failed`` handles. A read
        over several ranks (`TPRead`, either side tensor-parallel) is asked how it stands."""
        by_handle = {}
        for t in list(self.tickets.values()):
            if t.handle is None or t.arrived:
                continue
            if not hasattr(t.handle, "refresh"):
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
        self._finish(t, "failed", t.handle.error or "the read failed")

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
                if hasattr(t.handle, "refresh"):
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
            log.info("prefix borrow %s from %s: %s (%s); computing it instead", t.lend_id, t.holder, outcome, detail)
        self.results.append(BorrowResult(t.lend_id, t.holder, outcome, cached, read, detail, t.tag,
                                         self.clock() - t.sent_at))


class Lending:
    """A worker's `Lender` and `Borrower` over one agent: `on_poll` takes what an
    `agent.poll()` returned, handles the lend messages and the borrower's reads, and gives
    back the rest (the worker's own notices). Owner thread only."""

    def __init__(self, connector: Any, agent: Any, lease_ms: int = DEFAULT_LEASE_MS,
                 quarantine_s: float = DEFAULT_QUARANTINE_S, max_lent_blocks: int = 4096, verify: bool = False):
        self.lender = Lender(connector, agent, max_lent_blocks)
        self.borrower = Borrower(connector, agent, lease_ms=lease_ms, quarantine_s=quarantine_s, verify=verify)
        self.agent = agent
        self.malformed = 0

    def on_poll(self, res):
        """Handle the lend messages and reads in ``res``; the other notifications, in order."""
        rest = []
        for note in res.notifications:
            try:
                msg = route_notification(note.payload)
            except OldLendVersionError as exc:
                # A borrower of the previous version, which would not wait for a confirm: refused
                # in its own version, so it computes now rather than at its deadline.
                self.lender.counters["refused_version"] += 1
                try:
                    self.agent.send_notification(note.sender, exc.answer)
                except Exception:  # noqa: BLE001  (unknown to this agent: it times out instead)
                    pass
                continue
            except MalformedLendError as exc:
                self.malformed += 1
                log.warning("malformed lend message from %s ignored: %s", note.sender, exc)
                continue
            if msg is None:
                rest.append(note)
                continue
            self.lender.handle(note.sender, msg)
            self.borrower.handle(note.sender, msg)
        if self.borrower.tickets:
            self.borrower.transfers(res.completed, res.failed)
        self.lender.expire()
        self.borrower.expire()
        return rest

    def stats(self) -> dict:
        return {"lent_blocks": self.lender.table.lent_blocks, "lender": dict(self.lender.counters),
                "borrower": dict(self.borrower.counters), "borrows_in_flight": len(self.borrower.tickets),
                "quarantined": len(self.borrower.quarantined), "malformed": self.malformed}


class LendingAgent:
    """An agent (or a worker's sender) whose `poll()` first hands the lend traffic to a
    `Lending` and returns the rest; everything else is the agent's."""

    def __init__(self, inner: Any, lending: Lending):
        self.inner, self.lending = inner, lending

    def poll(self):
        from pdserve.kvtransfer.nixl.transfer import PollResult

        res = self.inner.poll()
        return PollResult(res.completed, res.failed, self.lending.on_poll(res))

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def route_notification(payload: bytes):
    """The lend message in a notification, or None if it is none (MalformedLendError if it
    claims to be one and is not)."""
    if not is_lend_message(payload):
        return None
    return decode_lend(payload)


__all__ = ["Lender", "Borrower", "BorrowResult", "Lending", "LendingAgent", "route_notification",
           "MalformedLendError", "OldLendVersionError"]
