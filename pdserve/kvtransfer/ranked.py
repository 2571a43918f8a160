"""Notices between tensor-parallel ranks: who sent one, and when a request's KV is whole.

When either side of a handoff runs more than one rank, every (prefill rank, decode rank)
pair of the write plan (head_plan.py) ends its writes with its own copy of the notice,
wrapped to say which pair it is:

    b"PDKR" | version (1 byte) | src rank | src TP | dst rank | dst TP (1 byte each) | inner notice

The decode worker feeds every notification it receives (on any of its ranks) to
`RankedArrivals`, which passes plain notices through and holds wrapped `PrefillDone`s until
`HandoffCompletion` says every decode rank has heard from all of its sources; only then is
the inner `PrefillDone` handed on, once. A `PrefillFailed` is never wrapped (prefill rank 0
sends it to decode rank 0 after every rank's writes settled); it drops what was gathered
for that attempt. Partial arrivals of an attempt that never completes (a rank died) are
dropped after ``max_age_s`` or when more than ``max_pending`` attempts are open: the decode
side's own deadline has failed such an attempt over to local prefill long before.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.kvtransfer.head_plan import HandoffCompletion, write_plan
from pdserve.kvtransfer.notices import MalformedNoticeError, PrefillDone, PrefillFailed, decode_notification
from pdserve.kvtransfer.transport import MAX_NOTIFICATION_BYTES

RANKED_MAGIC = b"PDKR"
RANKED_VERSION = 1
RANKED_HEADER_BYTES = len(RANKED_MAGIC) + 5
MAX_RANKS = 255


@dataclass(frozen=True)
class RankNotice:
    src_rank: int
    src_tp: int
    dst_rank: int
    dst_tp: int
    inner: bytes

    def encode(self) -> bytes:
        for name in ("src_tp", "dst_tp"):
            if not 1 <= getattr(self, name) <= MAX_RANKS:
                raise ValueError(f"{name}={getattr(self, name)} must be in 1..{MAX_RANKS}")
        if not 0 <= self.src_rank < self.src_tp or not 0 <= self.dst_rank < self.dst_tp:
            raise ValueError(f"ranks ({self.src_rank}, {self.dst_rank}) outside TP sizes ({self.src_tp}, {self.dst_tp})")
        out = RANKED_MAGIC + bytes([RANKED_VERSION, self.src_rank, self.src_tp, self.dst_rank, self.dst_tp]) + self.inner
        if len(out) > MAX_NOTIFICATION_BYTES:
            raise ValueError(f"a ranked notice is {len(out)} bytes, over the {MAX_NOTIFICATION_BYTES}-byte cap")
        return out


def is_ranked(payload: bytes) -> bool:
    return bytes(payload[:len(RANKED_MAGIC)]) == RANKED_MAGIC


def decode_ranked(payload: bytes) -> RankNotice:
    payload = bytes(payload)
    if not is_ranked(payload) or len(payload) <= RANKED_HEADER_BYTES:
        raise MalformedNoticeError("not a ranked notice")
    version, src, src_tp, dst, dst_tp = payload[len(RANKED_MAGIC):RANKED_HEADER_BYTES]
    if version != RANKED_VERSION:
        raise MalformedNoticeError(f"ranked notice version {version}; this worker reads {RANKED_VERSION}")
    if not (0 <= src < src_tp and 0 <= dst < dst_tp):
        raise MalformedNoticeError(f"ranked notice ranks ({src}, {dst}) outside its TP sizes ({src_tp}, {dst_tp})")
    return RankNotice(src, src_tp, dst, dst_tp, payload[RANKED_HEADER_BYTES:])


def wrap(inner: bytes, src_rank: int, src_tp: int, dst_rank: int, dst_tp: int) -> bytes:
    return RankNotice(src_rank, src_tp, dst_rank, dst_tp, inner).encode()


@dataclass
class _Open:
    completion: HandoffCompletion
    inner: bytes
    since: float


class RankedArrivals:
    """The decode worker's gate between its ranks' notifications and the handoff table."""

    def __init__(self, num_kv_heads: int, decode_tp: int = 1, max_pending: int = 10_000, max_age_s: float = 600.0):
        self.num_kv_heads, self.decode_tp = num_kv_heads, decode_tp
        self.max_pending, self.max_age_s = max_pending, max_age_s
        self._open: OrderedDict[tuple[str, int], _Open] = OrderedDict()
        self.completed = 0
        self.duplicates = 0
        self.unexpected = 0  # wrong decode TP, a plan that cannot hold, an inner notice that differs
        self.dropped = 0  # partial attempts given up (aged out, or failed)

    def feed(self, payload: bytes, now: float | None = None) -> bytes | None:
        """The payload to hand on (a plain notice, or a PrefillDone now whole on every decode
        rank), else None. `MalformedNoticeError` for bytes that are no notice at all."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        if not is_ranked(payload):
            notice = decode_notification(payload)
            if isinstance(notice, PrefillFailed):
                self._drop((notice.request_id, notice.epoch))
            return bytes(payload)
        ranked = decode_ranked(payload)
        inner = decode_notification(ranked.inner)
        if not isinstance(inner, PrefillDone):
            self._drop((inner.request_id, inner.epoch))
            return ranked.inner
        if ranked.dst_tp != self.decode_tp:
            self.unexpected += 1
            return None
        key = (inner.request_id, inner.epoch)
        entry = self._open.get(key)
        if entry is None:
            try:
                plan = write_plan(self.num_kv_heads, ranked.src_tp, ranked.dst_tp)
            except ValueError:
                self.unexpected += 1
                return None
            entry = self._open[key] = _Open(HandoffCompletion(plan), ranked.inner, now)
            while len(self._open) > self.max_pending:
                self._open.popitem(last=False)
                self.dropped += 1
        elif entry.completion.plan.prefill_tp != ranked.src_tp:
            self.unexpected += 1
            return None
        before = entry.completion.duplicates
        done = entry.completion.arrive(ranked.dst_rank, ranked.src_rank)
        self.duplicates += entry.completion.duplicates - before
        if not done:
            return None
        del self._open[key]
        self.completed += 1
        return entry.inner

    def waiting(self) -> dict[tuple[str, int], dict[int, list[int]]]:
        """Open attempts -> decode rank -> the source ranks not heard from yet (for explain)."""
        return {key: e.completion.missing() for key, e in self._open.items()}

    def _drop(self, key) -> None:
        if self._open.pop(key, None) is not None:
            self.dropped += 1

    def _expire(self, now: float) -> None:
        while self._open:
            key, entry = next(iter(self._open.items()))
            if now - entry.since <= self.max_age_s:
                return
            del self._open[key]
            self.dropped += 1
