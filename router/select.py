"""Worker selection within one pool (POLICY.md section 2).

``select_worker(candidates, pool_selection, rr_counter=...)`` is pure:
round-robin's position is explicit state the caller keeps (it gets the next
value back in the result). Ties are broken deterministically by
``worker_id`` so two decode workers looking at the same registry agree.

Strategies:

- ``round_robin``: candidates in the order given, ``rr_counter % n``.
- ``least_requests``: fewest active requests; ties -> lower KV usage.
- ``prefix_aware``: most prompt tokens already cached; ties -> least
  requests. No candidate holding any prefix -> least_requests.
- ``kv_aware``: lowest KV occupancy (most free blocks); ties -> longer prefix
  match, then fewer active requests.
- ``latency_cost``: lowest weighted sum of KV occupancy, active requests
  (fraction of capacity), exact prefix held (0/1), memory-bandwidth
  utilisation and recent prefix (0/1), weights from the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pdserve.router.policy import LatencyCostWeights, PoolSelection


@dataclass(frozen=True, slots=True)
class WorkerCandidate:
    """One worker that could take the request, as the registry reports it."""

    worker_id: str
    active_requests: int = 0
    # Capacity used to normalise active_requests to 0-1; None = the busiest
    # candidate's count.
    max_requests: int | None = None
    kv_usage: float = 0.0  # fraction 0-1 of KV blocks in use
    memory_bandwidth_util: float = 0.0  # fraction 0-1
    prefix_match_tokens: int = 0  # prompt tokens this worker's prefix cache holds
    exact_prefix_match: bool = False  # it holds the request's whole prefix
    recent_prefix: bool = False  # it served this prefix recently

    def __post_init__(self) -> None:
        for name in ("kv_usage", "memory_bandwidth_util"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} is a fraction 0-1 (got {value} for {self.worker_id})")


@dataclass(frozen=True, slots=True)
class Selection:
    """The chosen worker (None when there was no candidate) and why.

    ``scores`` lists each candidate's latency_cost (lower is better) when that
    strategy ran, else is empty. ``next_rr_counter`` is the round-robin state
    to pass to the next call (unchanged by other strategies).
    """

    worker_id: str | None
    reason: str
    scores: tuple[tuple[str, float], ...]
    next_rr_counter: int


def select_worker(
    candidates: Sequence[WorkerCandidate], selection: PoolSelection, *, rr_counter: int = 0
) -> Selection:
    """Pick one candidate according to ``selection.strategy``."""
    if not candidates:
        return Selection(None, "no_candidates", (), rr_counter)
    strategy = selection.strategy
    if strategy == "round_robin":
        chosen = candidates[rr_counter % len(candidates)]
        return Selection(chosen.worker_id, "round_robin", (), rr_counter + 1)
    if strategy == "least_requests":
        return Selection(_least_requests(candidates).worker_id, "least_requests", (), rr_counter)
    if strategy == "prefix_aware":
        best = max(c.prefix_match_tokens for c in candidates)
        if best == 0:
            return Selection(_least_requests(candidates).worker_id, "prefix_aware_no_match", (), rr_counter)
        holders = [c for c in candidates if c.prefix_match_tokens == best]
        return Selection(_least_requests(holders).worker_id, "prefix_aware", (), rr_counter)
    if strategy == "kv_aware":
        chosen = min(
            candidates,
            key=lambda c: (c.kv_usage, -c.prefix_match_tokens, c.active_requests, c.worker_id),
        )
        return Selection(chosen.worker_id, "kv_aware", (), rr_counter)
    if strategy == "latency_cost":
        scores = latency_costs(candidates, selection.weights)
        chosen_id = min(scores, key=lambda item: (item[1], item[0]))[0]
        return Selection(chosen_id, "latency_cost", scores, rr_counter)
    raise ValueError(f"unknown worker selection strategy {strategy!r}")


def latency_costs(
    candidates: Sequence[WorkerCandidate], weights: LatencyCostWeights
) -> tuple[tuple[str, float], ...]:
    """Each candidate's latency_cost score (lower is better)."""
    busiest = max(max(c.active_requests for c in candidates), 1)
    out = []
    for c in candidates:
        capacity = c.max_requests if c.max_requests else busiest
        active = min(c.active_requests / capacity, 1.0)
        cost = (
            weights.kv_occupancy * c.kv_usage
            + weights.active_requests * active
            + weights.exact_prefix_match * (1.0 if c.exact_prefix_match else 0.0)
            + weights.memory_bandwidth * c.memory_bandwidth_util
            + weights.recent_prefix * (1.0 if c.recent_prefix else 0.0)
        )
        out.append((c.worker_id, cost))
    return tuple(out)


def _least_requests(candidates: Sequence[WorkerCandidate]) -> WorkerCandidate:
    return min(candidates, key=lambda c: (c.active_requests, c.kv_usage, c.worker_id))
