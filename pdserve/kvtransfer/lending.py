"""Both ends of a prefix loan (kvtransfer/lend.py) over one worker's agent and engine.

`Lender` (kvtransfer/lender.py) answers other workers' `LendRequest`s from this engine's
prefix cache; `Borrower` (kvtransfer/borrower.py) borrows a prefix from another worker and
reads it into this engine's pool. `Lending` holds both over one transport. They run on the
one thread that owns the engine and the agent (a decode worker's engine thread, a prefill
worker's batch thread): the owner hands `Lending.on_poll` what each poll of the transport
returned (a prefill worker's `PrefixLoans.poll`, prefill/loans.py), and gets back the
notifications that are no lend messages. A worker is usually both: it lends what it caches
and borrows what it lacks.

A read that completed is used only once the holder confirmed that the loan was still live
when its release arrived; kvtransfer/borrower.py lists the ways a borrow ends.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, TypeVar

from pdserve.kvtransfer.borrower import DEFAULT_QUARANTINE_S, Borrower, BorrowerTransport, BorrowingPool
from pdserve.kvtransfer.lend import (
    DEFAULT_LEASE_MS,
    LendMessage,
    MalformedLendError,
    OldLendVersionError,
    decode_lend,
    is_lend_message,
)
from pdserve.kvtransfer.lender import Lender, LenderTransport, LendingPool
from pdserve.kvtransfer.transport import Arrival, Polled

log = logging.getLogger(__name__)


class LoanTransport(LenderTransport, BorrowerTransport, Protocol):
    """The transport both ends use (a `TPSender`, or one `KVTransferAgent`)."""


class LoanPool(LendingPool, BorrowingPool, Protocol):
    """The engine both ends use (engine/kv_connector.py `KVConnector`)."""


N = TypeVar("N", bound=Arrival)  # the transport's notification type, handed back as it came


class Lending:
    """A worker's `Lender` and `Borrower` over one agent: `on_poll` takes what an
    `agent.poll()` returned, handles the lend messages and the borrower's reads, and gives
    back the rest (the worker's own notices). Owner thread only."""

    def __init__(self, connector: LoanPool, agent: LoanTransport, lease_ms: int = DEFAULT_LEASE_MS,
                 quarantine_s: float = DEFAULT_QUARANTINE_S, max_lent_blocks: int = 4096, verify: bool = False):
        self.lender = Lender(connector, agent, max_lent_blocks)
        self.borrower = Borrower(connector, agent, lease_ms=lease_ms, quarantine_s=quarantine_s, verify=verify)
        self.agent = agent
        self.malformed = 0

    def traced_as(self, component: str) -> None:
        """Trace the loans of traced requests with ``component``'s tracer (common/tracing.py):
        the borrows' ``kv.borrow`` spans and the loans' ``kv.lend`` spans."""
        self.lender.trace_as = self.borrower.trace_as = component

    def on_poll(self, res: Polled[N]) -> list[N]:
        """Handle the lend messages and reads in ``res``; the other notifications, in order."""
        rest: list[N] = []
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

    def stats(self) -> dict[str, Any]:
        return {"lent_blocks": self.lender.table.lent_blocks, "lender": dict(self.lender.counters),
                "borrower": dict(self.borrower.counters), "borrows_in_flight": len(self.borrower.tickets),
                "quarantined": len(self.borrower.quarantined), "malformed": self.malformed}


def route_notification(payload: bytes) -> LendMessage | None:
    """The lend message in a notification, or None if it is none (MalformedLendError if it
    claims to be one and is not)."""
    if not is_lend_message(payload):
        return None
    return decode_lend(payload)


__all__ = ["Lending", "LoanPool", "LoanTransport", "route_notification"]
