"""What a decode worker's admission decides on, built from plain values: the request's
`RequestFeatures` and the `ClusterSnapshot` of the worker as it stands.

Pure functions, no I/O and no worker state: decode/frontend.py (the worker) reads its pool,
its remote path, its second tier and its counters and passes the values here, and so does the
simulator's decode worker (sim/decode_sim.py) from its simulated pool, prefill workers and tier.
One home for this glue means the simulated router decides on inputs built exactly as a real
worker builds them (tests/sim/test_glue.py checks both callers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import cast

from pdserve.router.costs import CostEstimates
from pdserve.router.values import ClusterSnapshot, Override, RequestFeatures

__all__ = ["cluster_snapshot", "priced_tier", "request_features"]


def request_features(prompt_len: int, cached_len: int, *, priority, ttft_slo_ms: float | None, route: str,
                     max_tokens: int | None, resumed: bool, hint: Mapping[str, int], tier_cached_len: int,
                     peer_reads: bool, grammar_compile_ms: float = 0.0,
                     prompt_logprobs: bool = False, lora_adapter: bool = False,
                     lora_held_remote: bool = False) -> RequestFeatures:
    """One request as the router sees it.

    ``prompt_len``: the tokens to prefill (a resumed stream's prompt and resumed tokens);
    ``cached_len``: what this worker's prefix cache holds of them; ``hint``: prefill worker id
    -> tokens of the prompt's prefix it holds (the KV index; {} when none is followed or the
    stream is resumed); ``tier_cached_len``: what this worker's second tier holds right after
    ``cached_len``; ``peer_reads``: this worker borrows prefixes from prefill workers. A
    resumed stream is prefilled here whatever the request asked (its first token must follow
    the resumed ones, which a remote prefill would not know). ``grammar_compile_ms``: see
    `RequestFeatures.grammar_compile_ms`; ``prompt_logprobs``: the request asks for them (it is
    prefilled here, every position: ``cached_len`` is then 0); ``lora_adapter``: it runs under a
    LoRA adapter (prefilled remotely only by a prefill worker that runs adapters);
    ``lora_held_remote``: a prefill worker holds that adapter (else it loads it first)."""
    # route: a str (api/validate.py refused any other value); RequestFeatures checks it again
    return RequestFeatures(prompt_len=prompt_len, cached_len=cached_len, priority=priority, ttft_slo_ms=ttft_slo_ms,
                           override="local" if resumed else cast(Override, route), max_tokens=max_tokens,
                           remote_cached_len=max(hint.values(), default=0), tier_cached_len=tier_cached_len,
                           peer_reads=peer_reads, grammar_compile_ms=grammar_compile_ms,
                           prompt_logprobs=prompt_logprobs, lora_adapter=lora_adapter,
                           lora_held_remote=lora_held_remote)


def cluster_snapshot(costs: CostEstimates, *, queue_depth: int, queue_tokens: int, pool_size: int,
                     pending_remote_requests: int, pending_remote_tokens: int, num_decoding: int,
                     num_prefilling: int, local_backlog: int, kv_usage: float, kv_free_tokens: int | None,
                     arrival_rate_per_s: float, local_prefill_budget_tokens: int | None,
                     step_in_flight_ms: float, spec_k: int | None = None, spec_tokens_per_step: float = 1.0,
                     lora_pool_size: int = 0) -> ClusterSnapshot:
    """The cluster as one decode worker sees it.

    The prefill queue's figures are polled, so a burst would see an empty queue for every
    request: what this worker sent remote and has not had back yet (``pending_remote_*``) is
    a floor under them. ``pool_size``: live prefill workers (0 without a remote path),
    ``lora_pool_size`` those of them that run LoRA adapters;
    ``num_prefilling`` counts the admitted requests without a first token, local and remote,
    so the local ones are that less the pending remote ones. ``spec_k`` /
    ``spec_tokens_per_step``: the worker's speculative decoding (AsyncEngine.spec_outlook)."""
    return ClusterSnapshot(
        costs=costs,
        prefill_queue_depth=max(queue_depth, pending_remote_requests),
        prefill_queue_tokens=max(queue_tokens, pending_remote_tokens),
        prefill_pool_size=pool_size,
        decode_active_requests=num_decoding,
        decode_waiting_requests=num_prefilling,
        local_prefill_queue_tokens=local_backlog,
        local_prefill_queue_requests=num_prefilling - pending_remote_requests,
        decode_kv_usage=kv_usage,
        kv_free_tokens=kv_free_tokens,
        arrival_rate_per_s=arrival_rate_per_s,
        local_prefill_budget_tokens=local_prefill_budget_tokens,
        step_in_flight_ms=step_in_flight_ms,
        spec_k=spec_k,
        spec_tokens_per_step=spec_tokens_per_step,
        lora_pool_size=min(lora_pool_size, pool_size),
    )


def priced_tier(snapshot: ClusterSnapshot, features: RequestFeatures, tier_load_ms_per_token: float
                ) -> ClusterSnapshot:
    """``snapshot`` with the second tier's measured load cost (engine/kv_tier.py) when the tier
    holds some of this prompt; unchanged otherwise (the cost model's own figure stands)."""
    if not features.tier_cached_len:
        return snapshot
    return dataclasses.replace(snapshot, costs=dataclasses.replace(
        snapshot.costs, tier_load_ms_per_token=tier_load_ms_per_token))
