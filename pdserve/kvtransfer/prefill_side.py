"""The prefill side of one remote prefill, as an explicit state machine.

A prefill worker admits each task of a batch as one `PrefillJob`; every
state change goes through `PrefillJob._event`, which looks the (state,
event) pair up in `TRANSITIONS`. An event with no entry there changes
nothing (a second failure keeps the first cause; a cancel that arrives
after the pages were posted is too late to matter).

    ADMITTED --stream--> STREAMING              layer-by-layer writes open (pages leave per layer)
    ADMITTED | STREAMING --computed--> COMPUTED  the first token is known; the KV is final
    COMPUTED --posted--> POSTED                  the last write is posted, the PrefillDone rides behind
    POSTED --written--> DONE                     every write landed: the decode worker has the pages
    any but DONE, FAILED --fail--> FAILED        the attempt will not be written

A FAILED job is reported to its decode worker with a `PrefillFailed`
(kvtransfer/notices.py) only once no write it posted can still land: the
worker waits for its posted writes first; one that timed out may still be
in flight (`write_may_land`), and the notice then says `writes_settled=False`
so that the decode worker quarantines the blocks instead of reusing them
(kvtransfer/decode_side.py). Either way the engine's copy of the job's KV is
released when its batch ends.

Pure: no engine, no transport; one job is driven by the worker thread only.
"""

from __future__ import annotations

import enum
import time
from typing import Any


class JobState(str, enum.Enum):
    ADMITTED = "admitted"  # in the engine, being computed; nothing posted
    STREAMING = "streaming"  # being computed; layers are posted as they finish
    COMPUTED = "computed"  # the first token is known: the pages are final
    POSTED = "posted"  # the final write (or the stream's finish) is posted with the PrefillDone
    DONE = "done"  # every write landed
    FAILED = "failed"  # will not be written (a PrefillFailed follows once its writes settle)

    @property
    def computing(self) -> bool:
        """The engine still has work for it."""
        return self in (JobState.ADMITTED, JobState.STREAMING)

    @property
    def final(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED)


S = JobState
# (state, event) -> new state: every transition there is, in one place.
TRANSITIONS: dict[tuple[JobState, str], JobState] = {
    (S.ADMITTED, "stream"): S.STREAMING,
    (S.ADMITTED, "computed"): S.COMPUTED,
    (S.STREAMING, "computed"): S.COMPUTED,
    (S.COMPUTED, "posted"): S.POSTED,
    (S.POSTED, "written"): S.DONE,
    **{(s, "fail"): S.FAILED for s in (S.ADMITTED, S.STREAMING, S.COMPUTED, S.POSTED)},
}
del S


class PrefillJob:
    """One admitted task: its engine request id, its writes, and how it ends."""

    def __init__(self, task: Any, rid: str):
        self.task = task  # the PrefillTask
        self.rid = rid  # its engine request id
        self.state = JobState.ADMITTED
        self.stream = None  # the LayerWrites while streaming
        self.handles: list = []  # the posted writes' handles
        self.first: tuple[int, float | None, tuple] | None = None  # token, logprob, top alternatives
        self.failure: tuple[str, str] | None = None  # (kind, detail) once FAILED
        self.write_may_land = False  # a posted write timed out: the transport may still move it
        self.history: list[str] = []  # "state --event--> state", for logs and tests
        self.times: dict[str, float] = {"admitted": time.time()}  # event -> when (unix s): its spans (prefill/tracing.py)

    @property
    def key(self) -> tuple[str, int]:
        return (self.task.request_id, self.task.epoch)

    # -- events ----------------------------------------------------------------------------
    def streaming(self, stream) -> bool:
        """Layer writes to the target opened."""
        if self._event("stream"):
            self.stream = stream
            return True
        return False

    def computed(self, token: int, logprob: float | None, top: tuple = ()) -> bool:
        """The forward pass produced the first token: the pages are final."""
        if self._event("computed"):
            self.first = (token, logprob, top)
            return True
        return False

    def posted(self, handles: list) -> bool:
        """The final write(s) left with the PrefillDone behind them."""
        if self._event("posted"):
            self.handles = list(handles)
            return True
        return False

    def written(self) -> bool:
        """Every posted write landed."""
        return self._event("written")

    def fail(self, kind: str, detail: str, *, write_may_land: bool = False) -> bool:
        """The attempt will not be written (`kind`: kvtransfer/outcomes.py). An open layer stream
        posts nothing more; what it posted is waited for before the notice goes out. The first
        cause is kept; `write_may_land` accumulates (a timed-out write may still be moving)."""
        self.write_may_land = self.write_may_land or write_may_land
        if not self._event("fail"):
            return False
        self.failure = (kind, detail)
        if self.stream is not None and not self.stream.finished:
            self.stream.abort()
        return True

    # -- the one place states change --------------------------------------------------------
    def _event(self, event: str) -> bool:
        new = TRANSITIONS.get((self.state, event))
        if new is None:
            return False
        self.history.append(f"{self.state.value} --{event}--> {new.value}")
        self.times[event] = time.time()
        self.state = new
        return True
