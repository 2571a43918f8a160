"""The values of the offload decision: what ``decide`` reads and what it returns.

``RequestFeatures`` (one request, as the router sees it) and ``ClusterSnapshot``
(the cluster as this decode worker sees it, its ``CostEstimates`` included) go
in; ``Decision`` (the route, why, and what each route is predicted to cost)
comes out. Plain immutable values, checked when built; the decision itself is
router/decide.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from pdserve.common import Priority
from pdserve.router.costs import CostEstimates

Override = Literal["auto", "local", "remote"]
Route = Literal["local", "remote"]

_OVERRIDES = ("auto", "local", "remote")


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the router knows about one request."""

    prompt_len: int
    cached_len: int = 0  # prompt tokens already held by this decode worker's prefix cache
    priority: Priority = Priority.NORMAL  # a name ("high") is accepted and parsed
    ttft_slo_ms: float | None = None  # the request's own TTFT target; None = the policy's
    override: Override = "auto"
    max_tokens: int | None = None  # None = no explicit limit
    # Prompt tokens the prefill worker with the longest cached prefix holds (its KV events,
    # cluster/kvindex/): a remote prefill computes only past them (it still sends every token past
    # cached_len). 0: none known.
    remote_cached_len: int = 0
    # Prompt tokens past cached_len that this worker's second KV tier holds (engine/kv_tier.py):
    # a local prefill loads them back (at CostEstimates.tier_load_ms_per_token) instead of
    # computing them. 0: no tier, or no hit there.
    tier_cached_len: int = 0
    # This worker borrows prefixes from prefill workers (a NIXL read of what remote_cached_len
    # holds past cached_len, decode/borrow.py): the local prediction counts that read.
    peer_reads: bool = False
    # A grammar (structured output, engine/structured.py) the prefill worker compiles before its
    # first token: what it took this worker's edge to compile it, when that was not cached here
    # (the prefill worker's cache is not known; a grammar new here is taken as new there). The
    # local route pays nothing: the edge has compiled it by the time the router decides.
    grammar_compile_ms: float = 0.0
    # It asks for prompt_logprobs (engine/prompt_logprobs.py): prefilled here, every position.
    prompt_logprobs: bool = False
    # It runs under a LoRA adapter (docs/lora.md): prefilled remotely only by a prefill worker
    # that runs adapters (ClusterSnapshot.lora_pool_size), which loads it first unless one of them
    # holds it already (``lora_held_remote``, their records' load["lora_adapters"]).
    lora_adapter: bool = False
    lora_held_remote: bool = False

    def __post_init__(self) -> None:
        if self.prompt_len < 0 or self.cached_len < 0 or self.remote_cached_len < 0 or self.tier_cached_len < 0:
            raise ValueError(
                f"prompt_len, cached_len, remote_cached_len and tier_cached_len must be >= 0 (got {self.prompt_len}, "
                f"{self.cached_len}, {self.remote_cached_len}, {self.tier_cached_len})"
            )
        object.__setattr__(self, "priority", Priority.parse(self.priority))  # ValueError names the choices
        if self.override not in _OVERRIDES:
            raise ValueError(f"override must be one of {_OVERRIDES} (got {self.override!r})")

    @property
    def eff_len(self) -> int:
        """Positions that still need prefill: ``max(0, prompt_len - cached_len)``."""
        return max(0, self.prompt_len - self.cached_len)


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """The cluster as this decode worker sees it at decision time."""

    costs: CostEstimates
    prefill_queue_depth: int = 0  # tasks waiting in the remote prefill queue
    prefill_queue_tokens: int = 0  # their uncached tokens
    prefill_pool_size: int = 0  # live prefill workers (leases held)
    decode_active_requests: int = 0  # running on this decode worker
    decode_waiting_requests: int = 0  # admitted here, not yet running (reported by explain)
    local_prefill_queue_tokens: int = 0  # prompt tokens local prefills here still have to compute
    local_prefill_queue_requests: int = 0  # the requests they belong to (0: count them as one)
    decode_backlog_tokens: int = 0  # decode tokens ahead of a new request's slot (0 = room now)
    decode_kv_usage: float = 0.0  # fraction 0-1 of this worker's KV blocks in use
    kv_free_tokens: int | None = None  # token slots in this worker's free KV blocks (None: unknown)
    arrival_rate_per_s: float = 0.0  # requests/s this decode worker receives (recent average)
    # Prompt tokens one step of this worker may take (engine/step_plan.py); None: no cap.
    local_prefill_budget_tokens: int | None = None
    # What is left of this worker's engine step under way, predicted (CostEstimates.step_left_ms);
    # a request admitted now is scheduled after it. 0: the engine is idle.
    step_in_flight_ms: float = 0.0
    # Live prefill workers that run LoRA adapters (their engines have enable_lora): a request
    # under an adapter may be prefilled remotely only when there is one (docs/lora.md).
    lora_pool_size: int = 0
    # Speculative decoding on this worker (common/spec_rule.py): the proposals a stream admitted
    # now would get per step (None: the worker does not speculate; 0: the batch is past the load
    # rule), and the mean tokens a verifying step gave a stream so far. ``costs.decode_step_ms``
    # already counts them.
    spec_k: int | None = None
    spec_tokens_per_step: float = 1.0


class Decision(NamedTuple):
    """Where to prefill, why, and what each route is predicted to cost.

    ``reason`` is a stable code for metrics labels; ``detail`` is one line for
    humans. ``score`` is the weighted sum (score policy), the predicted gain
    of going remote in ms (cost_model), else None. ``trace`` holds the
    step-by-step reasoning when ``decide(..., explain=True)``.

    A NamedTuple rather than a frozen dataclass: just as immutable, and about
    five times cheaper to build on the per-request path.
    """

    route: Route
    reason: str
    detail: str
    score: float | None
    predicted_ttft_local_ms: float
    predicted_ttft_remote_ms: float
    predicted_queue_wait_ms: float  # of the chosen route
    trace: tuple[str, ...] = ()

    @property
    def predicted_ttft_ms(self) -> float:
        """Predicted TTFT of the chosen route."""
        return self.predicted_ttft_remote_ms if self.route == "remote" else self.predicted_ttft_local_ms
