"""Values the agent hands out: transfer handles, notifications, poll results."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class TransferState(enum.Enum):
    """Life of one page write: POSTED, then exactly one of DONE or FAILED."""

    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False)
class TransferHandle:
    """One posted page write towards one peer, and what became of it.

    Owned by the agent that created it; `KVTransferAgent.poll()` and `wait()`
    move it from POSTED to DONE or FAILED (with `error` saying why).
    """

    id: int
    peer: str
    num_bytes: int
    num_descriptors: int
    layers: tuple[int, ...]
    notify: bytes | None
    state: TransferState = TransferState.POSTED
    error: str | None = None
    posted_at: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None
    _xfer: Any = field(default=None, repr=False)  # the NIXL transfer handle while POSTED

    @property
    def done(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def failed(self) -> bool:
        return self.state is TransferState.FAILED

    @property
    def finished(self) -> bool:
        return self.state is not TransferState.POSTED

    @property
    def elapsed_s(self) -> float:
        """Seconds from post to completion (or until now while still POSTED)."""
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.posted_at


@dataclass(frozen=True)
class Notification:
    """Bytes another agent sent us, with the sending agent's name."""

    sender: str
    payload: bytes


@dataclass
class PollResult:
    """What changed since the previous `poll()`."""

    completed: list[TransferHandle] = field(default_factory=list)
    failed: list[TransferHandle] = field(default_factory=list)
    notifications: list[Notification] = field(default_factory=list)
