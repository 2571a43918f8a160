"""Speculative decoding's measured-cost rule (``speculative_config.disable_by_cost``;
docs/speculative.md, "The load rule").

A step that verifies proposals costs more than a plain decode step: k more positions per
request in the target's forward and, with a draft model or an EAGLE head, k forwards of the
proposer before it. It pays when the tokens it emits per decoding request, over its time, beat
one token over a plain step's time. Neither side is known in advance (they depend on the
machine, the batch, the proposer and how often its proposals are accepted), so the rule
measures both:

- pure decode steps (no prompt chunk in them) are timed from before the proposals to the end
  of the step, per batch-size bucket (1, 2-3, 4-7, 8-15, ...), as moving averages: the time of
  the steps that verified proposals (``spec_ms``) and of those that did not (``plain_ms``),
  and the tokens a verifying step emitted per decoding request (``tokens_per_request``);
- a step speculates while its bucket has no ``spec_ms`` yet; then runs one plain step to get
  ``plain_ms``; from then on it speculates when ``tokens_per_request x plain_ms > spec_ms``;
- now and then a step goes the other way, so that the figure of the side not taken is measured
  again (acceptance drifts, contexts grow): `PROBE_EVERY` steps after the bucket's decision was
  made or last changed, then twice as far each time a probe leaves it as it was, up to
  `MAX_PROBE_EVERY`. A probe is not free (a draft model kept idle catches up on every token it
  missed before it proposes), hence the backoff.

The decision holds for a whole step: every decoding request may propose, or none does. The
batch-size rule (``disable_by_batch_size``) and each request's acceptance pause apply on top
of it (engine/spec_decode.py). A change of a bucket's decision is logged with its figures, and
`explain` gives them all (the decode worker's router snapshot reads `pays`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

EWMA = 0.25  # the weight of each new measurement
PROBE_EVERY = 32  # a bucket's steps from a new decision to the first probe of the side not taken
MAX_PROBE_EVERY = 512  # the longest gap between two probes (each probe that changes nothing doubles it)


def bucket_of(batch: int) -> int:
    """The batch-size bucket: 1 for 1, 2 for 2-3, 3 for 4-7, 4 for 8-15, ..."""
    return max(1, batch).bit_length()


def bucket_range(bucket: int) -> str:
    lo = 1 << (bucket - 1)
    return str(lo) if bucket == 1 else f"{lo}-{2 * lo - 1}"


@dataclass
class CostBucket:
    spec_ms: float | None = None
    plain_ms: float | None = None
    tokens_per_request: float | None = None
    steps: int = 0
    paying: bool | None = None  # the last decision from both figures (logged when it changes)
    interval: int = PROBE_EVERY  # steps from this probe to the next
    next_probe: int = 0  # the step count at which the side not taken runs once

    def pays(self) -> bool | None:
        """Whether speculating steps beat plain ones (None: a figure is missing)."""
        if self.spec_ms is None or self.plain_ms is None or self.tokens_per_request is None:
            return None
        return self.tokens_per_request * self.plain_ms > self.spec_ms


def _avg(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA * (new - old)


class SpecCostRule:
    """The per-bucket figures and the per-step decision (the module docstring)."""

    def __init__(self) -> None:
        self.buckets: dict[int, CostBucket] = {}
        self.off_steps = 0  # steps the rule kept from speculating

    def decide(self, batch: int) -> bool:
        """Whether a step with ``batch`` decoding requests speculates (counts the step)."""
        b = self.buckets.setdefault(bucket_of(batch), CostBucket())
        b.steps += 1
        if b.spec_ms is None:
            return True
        if b.plain_ms is None:
            self.off_steps += 1
            return False
        pays = b.pays()
        if pays != b.paying:
            b.paying = pays
            b.interval, b.next_probe = PROBE_EVERY, b.steps + PROBE_EVERY
            log.info("speculation %s at batch %s: %.2f tokens per request in %.2f ms against 1 in %.2f ms",
                     "on" if pays else "off", bucket_range(bucket_of(batch)), b.tokens_per_request or 0.0,
                     b.spec_ms, b.plain_ms)
        on = bool(pays)
        if b.steps >= b.next_probe:
            on = not on
            b.interval = min(2 * b.interval, MAX_PROBE_EVERY)
            b.next_probe = b.steps + b.interval
        if not on:
            self.off_steps += 1
        return on

    def pays(self, batch: int) -> bool:
        """The decision a step of ``batch`` would get now, without counting it (True while a
        figure is missing: the rule speculates first)."""
        b = self.buckets.get(bucket_of(batch))
        if b is None or b.spec_ms is None:
            return True
        return bool(b.pays()) if b.plain_ms is not None else False

    def observe(self, batch: int, speculated: bool, ms: float, tokens: int) -> None:
        """One pure decode step: ``batch`` decoding requests, whether it verified proposals,
        its time and the tokens it emitted."""
        if batch < 1 or ms <= 0.0:
            return
        b = self.buckets.setdefault(bucket_of(batch), CostBucket())
        if speculated:
            b.spec_ms = _avg(b.spec_ms, ms)
            b.tokens_per_request = _avg(b.tokens_per_request, tokens / batch)
        else:
            b.plain_ms = _avg(b.plain_ms, ms)

    def explain(self) -> list[dict]:
        """Each bucket's figures and decision, smallest batches first."""
        out = []
        for key in sorted(self.buckets):
            b = self.buckets[key]
            out.append({"batch": bucket_range(key), "spec_ms": b.spec_ms, "plain_ms": b.plain_ms,
                        "tokens_per_request": b.tokens_per_request, "speculates": self.pays(1 << (key - 1))})
        return out
