"""Which decode worker takes a request: a predicted TTFT per worker, the lowest wins, ties
go to the one with fewer streams of this gateway among two drawn at random (power of two
choices). Pure: no I/O; `Backends` (gateway/backends.py) feeds it what it saw.

The prediction, per worker ``w``, for a prompt of ``n`` tokens of which ``w`` caches ``c``::

    ttft_w = rate_w x (queued_w + n - c) + step_ms_w + kv_penalty_w

``rate_w`` is ms per prefill token as this gateway measured it on ``w`` (its TTFTs divided by
the tokens ahead of and in each request; a slowed worker shows a higher rate); ``queued_w``
the prompt tokens this gateway sent to ``w`` that have no first token yet, or more when the
worker's record reports more waiting requests; ``step_ms_w`` one decode step of ``w`` (its
record) that a new request waits for; ``kv_penalty_w`` grows as its KV pool fills past 90 %
(preemptions ahead). Every term is printed by `explain`.

A request under a LoRA adapter (its ``model`` names one) is picked among the workers whose
record lists that adapter (``load["lora_adapters"]``, `serves`); the others are excluded, and
the reason names the adapter. Its migrations and races stay among them, as every later pick
of the request excludes the same workers.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field

DEFAULT_RATE_MS = 0.5  # ms per prefill token before a worker has been measured
# A rate not measured again for this long counts half as much (the rest: the fleet's best
# rate). A worker measured slow once is then tried again once its slowness is old news:
# without it, a worker that met a passing neighbour would never be picked, so never measured.
RATE_HALF_LIFE_S = 5.0
KV_SOFT_LIMIT = 0.9
KV_PENALTY_MS = 2000.0  # at a full pool


@dataclass
class WorkerState:
    """One decode worker as this gateway sees it."""

    worker_id: str
    grpc: str
    load: dict = field(default_factory=dict)  # its etcd record's load (cluster/load.py)
    rate_ms: float = DEFAULT_RATE_MS
    measured: int = 0  # first tokens this gateway timed on it
    streams: int = 0  # this gateway's streams on it now
    queued_tokens: int = 0  # prompt tokens this gateway sent it, no first token yet
    mean_prompt: float = 256.0  # prompt tokens per request this gateway sent it (EMA)
    avoid_until: float = 0.0  # monotonic time before which it is not picked (it just failed)
    draining: bool = False
    measured_at: float = float("-inf")  # monotonic time of the last first token timed
    # The mean decode step since its previous load record (``set_load``); None: records set
    # directly, the cumulative mean is used.
    recent_step_ms: float | None = None

    def set_load(self, load: dict) -> None:
        """A new load record. The step a request would wait behind is the mean of the decode
        steps since the previous record, 0 when there were none (nothing decoding). The
        cumulative mean would keep a worker that was slow once, and has been idle since, slow
        for good: no gateway would pick it, so its figure would never change (a fresh gateway
        included). On a first record, the cumulative mean counts only while it reports streams
        running."""
        prev, self.load = self.load, load
        steps, ms = int(load.get("decode_steps") or 0), float(load.get("decode_ms") or 0.0)
        d_steps = steps - int(prev.get("decode_steps") or 0) if "decode_steps" in prev else None
        if d_steps is not None and d_steps >= 0:
            self.recent_step_ms = (ms - float(prev.get("decode_ms") or 0.0)) / d_steps if d_steps else 0.0
        else:  # a first record, or counters that went back (the worker restarted)
            self.recent_step_ms = ms / steps if steps and load.get("running") else 0.0

    def observe_ttft(self, ttft_ms: float, units: int, alpha: float = 0.2, now: float | None = None) -> None:
        """A first token after ``units`` prefill tokens (queued ahead plus its own)."""
        sample = max(ttft_ms - self.step_ms(), 0.0) / max(units, 16)
        self.rate_ms = sample if self.measured == 0 else (1 - alpha) * self.rate_ms + alpha * sample
        self.measured += 1
        self.measured_at = time.monotonic() if now is None else now

    def rate_at(self, now: float, fleet_ms: float) -> float:
        """Its rate, decayed towards ``fleet_ms`` (the best rate of the live workers) with the age
        of its last measurement (RATE_HALF_LIFE_S)."""
        age = max(0.0, now - self.measured_at) if self.measured else 0.0
        return fleet_ms + (self.rate_ms - fleet_ms) * 0.5 ** (age / RATE_HALF_LIFE_S)

    def step_ms(self) -> float:
        if self.recent_step_ms is not None:
            return self.recent_step_ms
        steps = self.load.get("decode_steps") or 0
        return float(self.load.get("decode_ms", 0.0)) / steps if steps else 0.0

    def queued(self) -> int:
        waiting = int(self.load.get("waiting") or 0)
        return max(self.queued_tokens, int(waiting * self.mean_prompt))

    def adapters(self) -> list[str]:
        """The LoRA adapters its record says it serves (``load["lora_adapters"]``; [] without)."""
        names = self.load.get("lora_adapters")
        return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []

    def serves(self, adapter: str) -> bool:
        return adapter in self.adapters()


@dataclass
class Score:
    worker_id: str
    ttft_ms: float
    rate_ms: float
    queued_tokens: int
    own_tokens: int
    cached_tokens: int
    step_ms: float
    kv_penalty_ms: float
    streams: int

    def as_dict(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def score(w: WorkerState, prompt_len: int, cached: int, now: float | None = None,
          fleet_ms: float | None = None) -> Score:
    own = max(prompt_len - cached, 0)
    queued = w.queued()
    kv = float(w.load.get("kv_usage") or 0.0)
    penalty = KV_PENALTY_MS * max(0.0, kv - KV_SOFT_LIMIT) / (1 - KV_SOFT_LIMIT)
    step = w.step_ms()
    rate = w.rate_ms if now is None or fleet_ms is None else w.rate_at(now, fleet_ms)
    return Score(w.worker_id, rate * (queued + own) + step + penalty, rate, queued, own, cached,
                 step, penalty, w.streams)


@dataclass
class Pick:
    """A choice and its reasons (what `pdserve gateway explain` prints)."""

    chosen: str | None
    reason: str
    scores: list[Score]
    excluded: dict[str, str]

    def as_dict(self) -> dict:
        return {"chosen": self.chosen, "reason": self.reason, "scores": [s.as_dict() for s in self.scores],
                "excluded": self.excluded}


ROUTINGS = ("ttft", "random")


def choose(workers: list[WorkerState], prompt_len: int, cached: dict[str, int], now: float,
           rng: random.Random, exclude: Set[str] = frozenset(), tie: float = 0.1, tie_ms: float = 5.0,
           routing: str = "ttft", adapter: str | None = None) -> Pick:
    """The worker for a prompt of ``prompt_len`` tokens; ``cached``: tokens of it each worker's
    prefix cache holds (the KV index's view; {} without one). Workers within ``tie`` (a
    fraction) or ``tie_ms`` of the best are tied: two of them are drawn and the one with fewer
    of this gateway's streams wins. ``routing="random"``: any live worker, uniformly (what a
    Kubernetes Service does; the baseline of bench/gateway.py). ``adapter``: the request runs
    under this LoRA adapter: only workers that serve it (`WorkerState.serves`) are scored."""
    pick = _choose(workers, prompt_len, cached, now, rng, exclude, tie, tie_ms, routing, adapter)
    if adapter is not None:
        serving = sum(w.serves(adapter) for w in workers)
        pick.reason = (f"serves the LoRA adapter {adapter!r} ({serving} of {len(workers)} worker(s) do): "
                       f"{pick.reason}")
    return pick


def _choose(workers: list[WorkerState], prompt_len: int, cached: dict[str, int], now: float,
            rng: random.Random, exclude: Set[str], tie: float, tie_ms: float, routing: str,
            adapter: str | None) -> Pick:
    excluded, live = {}, []
    for w in workers:
        if adapter is not None and not w.serves(adapter):
            excluded[w.worker_id] = f"does not serve the LoRA adapter {adapter!r}"
        elif w.worker_id in exclude:
            excluded[w.worker_id] = "this request already failed on it"
        elif w.draining:
            excluded[w.worker_id] = "draining"
        elif w.avoid_until > now:
            excluded[w.worker_id] = f"failed {w.avoid_until - now:.1f} s ago or less: avoided for now"
        else:
            live.append(w)
    fleet = min((w.rate_ms for w in live), default=DEFAULT_RATE_MS)
    scores = sorted((score(w, prompt_len, cached.get(w.worker_id, 0), now, fleet) for w in live),
                    key=lambda s: s.ttft_ms)
    if not scores:
        return Pick(None, "no decode worker can take it", [], excluded)
    if routing == "random":
        win = rng.choice(scores)
        return Pick(win.worker_id, f"random routing: one of {len(scores)} live worker(s)", scores, excluded)
    best = scores[0].ttft_ms
    tied = [s for s in scores if s.ttft_ms <= max(best * (1 + tie), best + tie_ms)]
    if len(tied) == 1:
        return Pick(tied[0].worker_id, f"lowest predicted TTFT ({best:.1f} ms)", scores, excluded)
    a, b = rng.sample(tied, 2)
    win = min((a, b), key=lambda s: (s.streams, s.ttft_ms))
    return Pick(win.worker_id, f"{len(tied)} tied within {tie:.0%} of {best:.1f} ms: of {a.worker_id} and "
                f"{b.worker_id} drawn, the one with fewer streams", scores, excluded)


def race_partner(pick: Pick, ttft_slo_ms: float | None, risk: float) -> tuple[str | None, str]:
    """The worker to race a request on beside ``pick.chosen`` (None, and why not): only a request
    with a TTFT target that its best prediction puts at risk (>= ``risk`` x the target), and only
    when the runner-up has nothing of this gateway queued (racing is refused under load)."""
    if ttft_slo_ms is None:
        return None, "no ttft_slo_ms"
    if len(pick.scores) < 2:
        return None, "one worker"
    assert pick.chosen is not None  # choose() names a worker whenever it scored any
    by = {sc.worker_id: sc for sc in pick.scores}
    if by[pick.chosen].ttft_ms < risk * ttft_slo_ms:
        return None, "no predicted tail"
    partner = next(sc for sc in pick.scores if sc.worker_id != pick.chosen)
    if partner.queued_tokens > 0:
        return None, "refused_load"
    return partner.worker_id, "race"


class RaceBudget:
    """Races may be at most ``fraction`` of the requests started in the last ``window_s``."""

    def __init__(self, fraction: float, window_s: float = 60.0):
        self.fraction = fraction
        self.window_s = window_s
        self.started: deque[float] = deque()
        self.raced: deque[float] = deque()

    def start(self, now: float) -> None:
        self.started.append(now)

    def take(self, now: float) -> bool:
        """One race, if the budget has room (then counted)."""
        for q in (self.started, self.raced):
            while q and q[0] < now - self.window_s:
                q.popleft()
        if len(self.raced) + 1 > self.fraction * len(self.started):
            return False
        self.raced.append(now)
        return True
