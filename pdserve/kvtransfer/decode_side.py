"""The decode side of one remote prefill, as an explicit state machine.

Each remote attempt of a request (request id + epoch) is one `Handoff`, owned
by the worker's `Handoffs` table; every state change goes through
`Handoffs._move`, which looks the (state, event) pair up in `TRANSITIONS`.
An event with no entry there changes nothing and is reported stale (a late
`PrefillDone` after a fallback, a notice for an epoch this worker never
started, a second deadline). The table only decides: the caller applies the
returned `Effect` to the engine through its KV connector, in the engine
thread, so a notification and a fallback for the same request never
interleave.

    RESERVED --queued--> QUEUED
    RESERVED | QUEUED --done--> READY              run from the first token the prefill sent
    RESERVED | QUEUED --fail/give_up (settled)--> FALLEN_BACK
                                                   prefill locally, blocks released at once
    RESERVED | QUEUED --fail/give_up (unsettled)--> QUARANTINED
                                                   prefill locally; the old blocks wait
    RESERVED | QUEUED --abort (no writer)--> ABORTED      request dropped, blocks released
    RESERVED | QUEUED --abort (writer alive)--> QUARANTINED  request dropped, blocks wait
    RESERVED | QUEUED --supersede--> QUARANTINED   a new attempt (epoch + 1) takes over with
                                                   fresh blocks; the old ones wait
    QUARANTINED --done | fail (settled) | expire--> RELEASED  blocks freed

Epochs: a request's first attempt is epoch 1, and each attempt after it (a re-put after the
queue restarted) the next. An attempt that is superseded keeps its own blocks in quarantine
while whoever may hold its task can still write them, so two attempts never write the same
blocks; a notice for an old epoch then only ends that quarantine (it never runs the request).

"Settled" means no write of the attempt can still land: the task was still
queued when cancelled, nobody ever took it, or the prefill worker said so in
its `PrefillFailed`. A worker that left etcd is not settled: a partitioned
worker's writes can still arrive when its link returns. Otherwise the blocks
stay quarantined until that attempt's own notification arrives (its writes
are over) or `quarantine_s` passes, so a late write never lands in blocks
another request owns.

A `PrefillDone` is checked before it counts (`check_done`): it must name a
live attempt of this worker (request id + epoch) and the number of tokens the
task it signed asked for. Anything else (an attempt never started or already
over, a forged or confused notice) is refused, and the caller counts it; it
changes nothing here. Pages computed under another LoRA adapter than the task's (or under
the base for an adapter's task, or the reverse) are refused by `check_adapter`
(`AdapterMismatchError`): the request prefills locally, as for a first token outside the
vocabulary.

Pure: no Ray, etcd, NIXL or engine; thread-safe (the event loop marks puts
and reads the awaited set, the engine thread does the rest).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


class HandoffState(str, enum.Enum):
    RESERVED = "reserved"  # blocks reserved for the uncached positions; task not yet on the queue
    QUEUED = "queued"  # the task is on the prefill queue (or a prefill worker holds it)
    READY = "ready"  # the pages are written: the request runs from its first token
    FALLEN_BACK = "fallen_back"  # prefilling locally; the reservation was released
    QUARANTINED = "quarantined"  # no longer awaited; its blocks wait until no write can land
    ABORTED = "aborted"  # the client left; the reservation was released
    RELEASED = "released"  # a quarantine ended: its blocks were freed

    @property
    def awaiting(self) -> bool:
        return self in (HandoffState.RESERVED, HandoffState.QUEUED)


class Effect(str, enum.Enum):
    """What the caller must do to the engine (through its KV connector) after a transition."""

    NONE = "none"  # stale event: nothing
    NOTHING = "nothing"  # a transition with no engine change (queued)
    RUN = "run"  # connector.remote_ready(request, first token)
    FALL_BACK = "fall_back"  # connector.fall_back(request): prefill locally, blocks released
    FALL_BACK_QUARANTINE = "fall_back_quarantine"  # connector.fall_back(request, quarantine_key)
    ABORT = "abort"  # connector.abort(request)
    ABORT_QUARANTINE = "abort_quarantine"  # connector.abort(request, quarantine_key)
    FREE = "free"  # connector.free(quarantine_key)
    REPLACE = "replace"  # connector.replace(request, quarantine_key): fresh blocks for the next attempt


# Why a PrefillDone was refused (`Handoffs.check_done`; the metric's `reason` label).
UNKNOWN_ATTEMPT = "unknown_attempt"  # no live attempt (request, epoch) here: never started, or over
WRONG_SIZE = "wrong_size"  # it claims a token count other than the signed task's
WRONG_ADAPTER = "wrong_adapter"  # its pages were computed under another LoRA adapter than the task's


class AdapterMismatchError(ValueError):
    """A `PrefillDone`'s pages were computed under another LoRA adapter (or the base model) than
    the task this worker signed asked for: the KV is not this request's. ``field`` names what
    differs (``lora_name`` or ``lora_int_id``)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = WRONG_ADAPTER


def check_adapter(task: Any, lora_name: str, lora_int_id: int) -> None:
    """Raise `AdapterMismatchError` unless pages computed under adapter (``lora_name``,
    ``lora_int_id``; "": the base) are what ``task`` (the `PrefillTask` this worker signed)
    asked for. A task without adapter fields (None, or a test's stand-in) asks for the base."""
    want_name = getattr(task, "lora_name", "") or ""
    want_id = getattr(task, "lora_int_id", 0) or 0
    if lora_name != want_name:
        raise AdapterMismatchError("lora_name", f"pages computed under {lora_name or 'the base model'!r}, the "
                                   f"task asked for {want_name or 'the base model'!r}")
    if want_name and lora_int_id != want_id:
        raise AdapterMismatchError("lora_int_id", f"adapter {want_name!r} computed as id {lora_int_id}, the task "
                                   f"named id {want_id}")

S, E = HandoffState, Effect
# (state, event) -> (new state, effect): every transition there is, in one place.
TRANSITIONS: dict[tuple[HandoffState, str], tuple[HandoffState, Effect]] = {
    (S.RESERVED, "queued"): (S.QUEUED, E.NOTHING),
    **{(s, "done"): (S.READY, E.RUN) for s in (S.RESERVED, S.QUEUED)},
    **{(s, "fail_settled"): (S.FALLEN_BACK, E.FALL_BACK) for s in (S.RESERVED, S.QUEUED)},
    **{(s, "fail_unsettled"): (S.QUARANTINED, E.FALL_BACK_QUARANTINE) for s in (S.RESERVED, S.QUEUED)},
    **{(s, "abort_settled"): (S.ABORTED, E.ABORT) for s in (S.RESERVED, S.QUEUED)},
    **{(s, "abort_unsettled"): (S.QUARANTINED, E.ABORT_QUARANTINE) for s in (S.RESERVED, S.QUEUED)},
    **{(s, "supersede"): (S.QUARANTINED, E.REPLACE) for s in (S.RESERVED, S.QUEUED)},
    (S.QUARANTINED, "done"): (S.RELEASED, E.FREE),
    (S.QUARANTINED, "fail_settled"): (S.RELEASED, E.FREE),
    (S.QUARANTINED, "expire"): (S.RELEASED, E.FREE),
}
del S, E


@dataclass
class Handoff:
    """One remote attempt of one request."""

    request_id: str
    epoch: int
    num_blocks: int  # reserved target blocks the prefill worker writes
    started: float  # monotonic: the reservation
    state: HandoffState = HandoffState.RESERVED
    reason: str = ""  # why it left the awaited states (fallback / abort cause)
    quarantine_until: float | None = None
    task: Any = None  # the PrefillTask put on the queue
    history: list[str] = field(default_factory=list)  # "state --event--> state", for explain/debug

    @property
    def quarantine_key(self) -> str:
        """The key the reserved blocks are held under while quarantined (never a request id)."""
        return f"{self.request_id}#quarantine{self.epoch}"


@dataclass(frozen=True)
class Step:
    """The outcome of one event: the effect to apply, and the handoff it applies to."""

    effect: Effect
    handoff: Handoff | None = None

    @property
    def stale(self) -> bool:
        return self.effect is Effect.NONE


class Handoffs:
    """Every live attempt of one decode worker (awaited or quarantined)."""

    def __init__(self, quarantine_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.quarantine_s = quarantine_s
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[tuple[str, int], Handoff] = {}
        self._awaited: dict[str, Handoff] = {}  # request id -> its RESERVED/QUEUED attempt
        self.counts: dict[str, int] = {}  # "state" entered -> times, and "stale"

    # -- events --------------------------------------------------------------------------
    def reserve(self, request_id: str, epoch: int, num_blocks: int) -> Handoff:
        """A new attempt: blocks are reserved (RESERVED). A request has one awaited attempt."""
        with self._lock:
            if request_id in self._awaited:
                raise ValueError(f"request {request_id!r} already awaits remote KV "
                                 f"(epoch {self._awaited[request_id].epoch})")
            if (request_id, epoch) in self._live:
                raise ValueError(f"attempt {epoch} of {request_id!r} is still held (quarantined)")
            h = Handoff(request_id, epoch, num_blocks, self._clock())
            self._live[(request_id, epoch)] = self._awaited[request_id] = h
            self._count(HandoffState.RESERVED.value)
            return h

    def queued(self, request_id: str, epoch: int, task: Any = None) -> Step:
        """The task is on the queue."""
        step = self._event(request_id, epoch, "queued")
        if not step.stale and task is not None:
            assert step.handoff is not None  # a step that is not stale moved a live handoff (_event)
            step.handoff.task = task
        return step

    def check_done(self, request_id: str, epoch: int, num_tokens_written: int) -> str | None:
        """Why a `PrefillDone` for (request_id, epoch) saying it wrote `num_tokens_written` tokens
        must be refused (UNKNOWN_ATTEMPT, WRONG_SIZE), or None. An attempt still live may be
        awaited or quarantined (a late done frees its blocks); a READY, fallen back or aborted
        one is over: a second done for it is refused, not applied."""
        with self._lock:
            h = self._live.get((request_id, epoch))
        if h is None:
            return UNKNOWN_ATTEMPT
        expected = getattr(h.task, "num_prefill_tokens", None)  # the task this worker signed and put
        if expected is not None and num_tokens_written != expected:
            return WRONG_SIZE
        return None

    def done(self, request_id: str, epoch: int) -> Step:
        """The attempt's `PrefillDone` arrived: its writes are over."""
        return self._event(request_id, epoch, "done")

    def failed(self, request_id: str, epoch: int, writes_settled: bool, why: str = "") -> Step:
        """The prefill side gave up on the attempt (`PrefillFailed`, or the queue's failed list)."""
        return self._event(request_id, epoch, "fail_settled" if writes_settled else "fail_unsettled", why)

    def give_up(self, request_id: str, epoch: int, release_now: bool, why: str) -> Step:
        """This worker gave up (deadline, refused put, queue lost, pool empty)."""
        return self._event(request_id, epoch, "fail_settled" if release_now else "fail_unsettled", why)

    def abort(self, request_id: str, writer_may_exist: bool, why: str = "aborted") -> Step:
        """The request is dropped. Without an awaited attempt: Step(NONE) (the caller aborts a
        local request itself)."""
        with self._lock:
            h = self._awaited.get(request_id)
        if h is None:
            return Step(Effect.NONE)
        return self._event(request_id, h.epoch, "abort_unsettled" if writer_may_exist else "abort_settled", why)

    def supersede(self, request_id: str, epoch: int, why: str) -> Step:
        """A new attempt replaces this one (the queue restarted: its task is put again under the
        next epoch, into fresh blocks); this one's blocks wait in quarantine for its late writes."""
        return self._event(request_id, epoch, "supersede", why)

    def expire(self) -> list[Step]:
        """Quarantines whose time is up (their blocks are freed)."""
        now = self._clock()
        with self._lock:
            due = [h for h in self._live.values()
                   if h.state is HandoffState.QUARANTINED and h.quarantine_until is not None
                   and now > h.quarantine_until]
        return [s for h in due if not (s := self._event(h.request_id, h.epoch, "expire")).stale]

    # -- reads -----------------------------------------------------------------------------
    def awaiting(self) -> list[Handoff]:
        """The attempts still waiting for their pages (RESERVED or QUEUED)."""
        with self._lock:
            return list(self._awaited.values())

    @property
    def num_awaiting(self) -> int:
        return len(self._awaited)

    def awaited(self, request_id: str) -> Handoff | None:
        with self._lock:
            return self._awaited.get(request_id)

    def quarantined(self) -> list[Handoff]:
        with self._lock:
            return [h for h in self._live.values() if h.state is HandoffState.QUARANTINED]

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    # -- the one place states change ------------------------------------------------------------
    def _event(self, request_id: str, epoch: int, event: str, why: str = "") -> Step:
        with self._lock:
            h = self._live.get((request_id, epoch))
            move = TRANSITIONS.get((h.state, event)) if h is not None else None
            if h is None or move is None:  # (no handoff: no move)
                self._count("stale")
                return Step(Effect.NONE, h)
            self._move(h, event, *move, why)
            return Step(move[1], h)

    def _move(self, h: Handoff, event: str, new: HandoffState, effect: Effect, why: str) -> None:
        h.history.append(f"{h.state.value} --{event}--> {new.value}")
        h.state = new
        self._count(new.value)
        if not new.awaiting and self._awaited.get(h.request_id) is h:
            del self._awaited[h.request_id]
            if why:
                h.reason = why
        if new is HandoffState.QUARANTINED:
            h.quarantine_until = self._clock() + self.quarantine_s
        elif new in (HandoffState.READY, HandoffState.FALLEN_BACK, HandoffState.ABORTED, HandoffState.RELEASED):
            del self._live[(h.request_id, h.epoch)]  # nothing left to hold

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
