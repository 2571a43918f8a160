"""What `pdserve top` computes from the workers' Prometheus text: one scrape parsed into samples
(`Scrape`, with `prometheus_client`'s parser), a ring of timed scrapes per worker (`Ring`), and
the windowed figures between two scrapes: counter rates, counts by label, and histogram
percentiles from bucket deltas (the interpolation of Prometheus's `histogram_quantile`,
`cluster/load.py`'s `quantile`). A counter that went down (the worker restarted) counts from
zero, as Prometheus's `rate()` does. Pure: no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.load import quantile

LabelSet = tuple[tuple[str, str], ...]  # sorted (name, value) pairs


def _labels(labels: dict[str, str], drop: str | None = None) -> LabelSet:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


@dataclass
class Scrape:
    """One /metrics text: each sample's value by (sample name, labels)."""

    samples: dict[tuple[str, LabelSet], float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Scrape":
        """Parse Prometheus text exposition (ValueError on text that is not)."""
        out: dict[tuple[str, LabelSet], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue  # creation timestamps: not figures
                out[(s.name, _labels(s.labels))] = float(s.value)
        return cls(out)

    def value(self, name: str, **match: str) -> float | None:
        """The sum of `name`'s samples whose labels include `match`; None when there is none."""
        found = [v for (n, labels), v in self.samples.items()
                 if n == name and all((k, want) in labels for k, want in match.items())]
        return sum(found) if found else None

    def by_label(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        """`name`'s values summed by the values of the labels `keys` (a sample missing one: "")."""
        out: dict[tuple[str, ...], float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                d = dict(labels)
                k = tuple(d.get(key, "") for key in keys)
                out[k] = out.get(k, 0.0) + v
        return out

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """A histogram's cumulative (upper bound, count) buckets, summed over its other labels,
        by rising bound ([] when the scrape has none)."""
        out: dict[float, float] = {}
        for (n, labels), v in self.samples.items():
            if n == f"{histogram}_bucket":
                le = float(dict(labels)["le"])
                out[le] = out.get(le, 0.0) + v
        return sorted(out.items())


def counter_delta(old: float | None, new: float | None) -> float | None:
    """How much a counter grew between two readings; a counter that went down restarted from 0."""
    if new is None:
        return None
    if old is None or new < old:
        return new
    return new - old


def bucket_delta(old: list[tuple[float, float]], new: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The cumulative buckets of the samples observed between two scrapes (the newer one alone
    when its total went down: the worker restarted)."""
    if not new:
        return []
    before = dict(old)
    if not old or new[-1][1] < old[-1][1]:
        return list(new)
    return [(le, max(0.0, count - before.get(le, 0.0))) for le, count in new]


@dataclass(frozen=True)
class Span:
    """Two scrapes of one worker, `seconds` apart: what every windowed figure is computed from."""

    seconds: float
    old: Scrape
    new: Scrape

    def rate(self, name: str, **match: str) -> float | None:
        """A counter's growth per second over the span (None: no such counter)."""
        d = counter_delta(self.old.value(name, **match), self.new.value(name, **match))
        return None if d is None else d / self.seconds

    def increase(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        """A counter's growth over the span by the values of the labels `keys` (growth > 0 only)."""
        old = self.old.by_label(name, *keys)
        out = {}
        for k, v in self.new.by_label(name, *keys).items():
            d = counter_delta(old.get(k), v) or 0.0
            if d > 0:
                out[k] = d
        return out

    def observations(self, histogram: str) -> list[tuple[float, float]]:
        return bucket_delta(self.old.buckets(histogram), self.new.buckets(histogram))

    def count(self, histogram: str) -> float:
        """Samples a histogram observed over the span."""
        d = self.observations(histogram)
        return d[-1][1] if d else 0.0

    def percentiles(self, histogram: str, qs=(0.5, 0.9, 0.99)) -> dict[float, float]:
        """{q: seconds} of the samples observed over the span ({} when it observed none)."""
        d = self.observations(histogram)
        out = {}
        for q in qs:
            v = quantile(d, q)
            if v is not None:
                out[q] = v
        return out


class Ring:
    """One worker's timed scrapes, kept for `keep_s` (plus the one just older, the baseline of a
    full window)."""

    def __init__(self, keep_s: float = 60.0):
        self.keep_s = keep_s
        self._scrapes: deque[tuple[float, Scrape]] = deque()

    def add(self, t: float, scrape: Scrape) -> None:
        self._scrapes.append((t, scrape))
        while len(self._scrapes) > 2 and t - self._scrapes[1][0] >= self.keep_s:
            self._scrapes.popleft()

    def __len__(self) -> int:
        return len(self._scrapes)

    @property
    def latest(self) -> Scrape | None:
        return self._scrapes[-1][1] if self._scrapes else None

    def span(self, window_s: float) -> Span | None:
        """The newest scrape and the oldest one at most `window_s` before it (the oldest kept when
        none is that recent but the newest); None with fewer than two scrapes."""
        if len(self._scrapes) < 2:
            return None
        t1, new = self._scrapes[-1]
        t0, old = self._scrapes[-2]
        for t, s in self._scrapes:
            if t1 - t <= window_s and t < t1:
                t0, old = t, s
                break
        return Span(t1 - t0, old, new) if t1 > t0 else None
