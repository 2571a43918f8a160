"""The holder's end of a prefix loan (kvtransfer/lend.py): `Lender` answers other workers'
`LendRequest`s from this engine's prefix cache, pins what it grants until the borrower's
release (or the lease's end), and answers a release that follows a completed read with a
`LendConfirm`: whether the loan was still live, from which holder life (the borrower uses the
pages only then; kvtransfer/borrower.py). A chain partly in the second tier is loaded back
first. Owner thread only (kvtransfer/lending.py says who drives it).

A request that carries its borrower's ``traceparent`` (a traced request's borrow) is a
``kv.lend`` span (kind server) of the tracer ``trace_as`` names, a child of the borrower's
``kv.borrow``: from its arrival to the loan's end, with a ``granted`` event, how it ended
(``pdserve.outcome``: confirmed, stale, released, expired, borrower_gone, refused_<reason>,
dropped_unknown_borrower) and the blocks it lent.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any, Protocol

from pdserve.common import tracing
from pdserve.kvtransfer.lend import (
    BUSY,
    GONE,
    MAX_LEND_BLOCKS,
    MAX_VERIFIED_BLOCKS,
    TOO_MANY,
    LendConfirm,
    LendGrant,
    LendMessage,
    LendRelease,
    LendRequest,
    LendTable,
    new_epoch,
)

log = logging.getLogger(__name__)


class TierLoad(Protocol):
    """A chain being loaded back from the second tier (engine/kv_tier_types.py `TierLoad`)."""

    @property
    def finished(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


class LendingPool(Protocol):
    """What a lender needs of this engine (engine/kv_connector.py `KVConnector`)."""

    def lend_chain(self, tail_hash: bytes, num_blocks: int) -> list[int] | None: ...

    def load_chain(self, tail_hash: bytes, num_blocks: int, key: str) -> TierLoad | None: ...

    def finish_tier_loads(self) -> None: ...

    def unlend(self, block_ids: list[int]) -> None: ...

    def block_checksums(self, block_ids: list[int]) -> list[int]: ...


class LenderTransport(Protocol):
    """What a lender needs of the transport (a `TPSender` or a `KVTransferAgent`)."""

    @property
    def peers(self) -> Collection[str]: ...

    def send_notification(self, peer: str, payload: bytes) -> None: ...


class Lender:
    """Grants and ends loans of this engine's cached chains (owner thread only)."""

    def __init__(self, connector: LendingPool, agent: LenderTransport, max_blocks: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        self.connector, self.agent, self.clock = connector, agent, clock
        self.table = LendTable(max_blocks=max_blocks)
        # This life's epoch, in every grant and confirm: a holder restarted under the same name
        # draws another, so it never confirms a loan its previous life granted.
        self.epoch = new_epoch()
        self.counters: Counter[str] = Counter()
        # Requests from borrowers this agent cannot answer yet (no NIXL metadata of theirs
        # loaded): the owner fetches it (`waiting_for_peers`), adds the peer, then `retry()`.
        self.waiting: list[tuple[str, LendRequest, float]] = []
        # Requests whose chain is being loaded back from the second tier: (borrower, request,
        # the TierLoad, since); answered by `expire()` once loaded.
        self.loading: list[tuple[str, LendRequest, TierLoad, float]] = []
        self._unanswered: list[TierLoad] = []  # loads still running for requests refused meanwhile
        self.trace_as: str | None = None  # the component whose tracer makes the kv.lend spans (None: none)
        self._spans: dict[tuple[str, str], tracing.Span] = {}  # (borrower, lend id) -> its kv.lend span

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
                self._span_end(sender, msg.lend_id, "dropped_unknown_borrower")
            else:
                self.handle(sender, msg)

    def handle(self, sender: str, msg: LendMessage) -> None:
        """A `LendRequest` or `LendRelease` from ``sender`` (grants and confirms are a borrower's
        business)."""
        if isinstance(msg, LendRequest) and msg.traceparent and self.trace_as:
            self._span_begin(sender, msg)
        if isinstance(msg, LendRequest) and sender not in self.agent.peers:
            self.waiting.append((sender, msg, self.clock()))
            self.counters["awaiting_peer"] += 1
            self._span_event(sender, msg.lend_id, "awaiting_peer")
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
                    self._span_event(sender, msg.lend_id, "loading_from_tier")
                    return
                reason = GONE
        self._answer(sender, msg, ids, reason)

    def _released(self, sender: str, msg: LendRelease) -> None:
        """The borrower is done. A release that carries an epoch follows a completed read: answer
        whether the loan was live until now (then its blocks were pinned for the whole read),
        and from which life; then unpin."""
        loan = self.table.release(sender, msg.lend_id)
        if loan is not None or msg.epoch:
            outcome = ("confirmed" if loan is not None and msg.epoch == self.epoch else "stale") if msg.epoch \
                else "released"  # (no epoch: the borrower gave the loan up)
            self._span_end(sender, msg.lend_id, outcome)
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
        if ids:
            self._span_event(sender, msg.lend_id, "granted", {"pdserve.lent_blocks": len(ids)})
        else:
            self._span_end(sender, msg.lend_id, f"refused_{reason}")
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
            self._span_end(loan.borrower, loan.lend_id, "expired")
        if loans:
            self.counters["expired"] += len(loans)
            log.warning("%d prefix loan(s) ended by their lease, not by a release (borrowers %s)", len(loans),
                        sorted({loan.borrower for loan in loans}))
        return len(loans)

    def borrower_gone(self, name: str) -> None:
        for loan in self.table.take_borrower(name):
            self.connector.unlend(list(loan.block_ids))
            self._span_end(name, loan.lend_id, "borrower_gone")
        gone = [w for w in self.loading if w[0] == name]
        if gone:  # their loads go on (their blocks join the cache), unanswered
            self.loading = [w for w in self.loading if w[0] != name]
            self._unanswered += [load for _, _, load, _ in gone]
        for _, msg, _, _ in gone:
            self._span_end(name, msg.lend_id, "borrower_gone")

    # -- the loans' spans (a traced request's) ------------------------------------------------
    def _span_begin(self, sender: str, msg: LendRequest) -> None:
        key = (sender, msg.lend_id)
        if key in self._spans:  # (a request answered once its borrower is met: one span)
            return
        span = tracing.tracer(self.trace_as or "").start("kv.lend", msg.traceparent, kind="server", attrs={
            "pdserve.borrower": sender, "pdserve.lend_id": msg.lend_id, "pdserve.blocks": msg.blocks,
            "pdserve.verify": msg.verify})
        if isinstance(span, tracing.Span) and span:  # (not sampled, or no tracer here: nothing kept)
            self._spans[key] = span

    def _span_event(self, sender: str, lend_id: str, name: str, attrs: dict[str, Any] | None = None) -> None:
        span = self._spans.get((sender, lend_id))
        if span is not None:
            span.event(name, attrs=attrs)
            if attrs:
                span.set(attrs)

    def _span_end(self, sender: str, lend_id: str, outcome: str) -> None:
        span = self._spans.pop((sender, lend_id), None)
        if span is not None:
            span.set({"pdserve.outcome": outcome})
            span.end()
