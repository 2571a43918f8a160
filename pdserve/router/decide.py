"""The offload decision: prefill this request locally or on the prefill pool.

``decide(features, snapshot, policy)`` is a pure function of its arguments.
Precedence, first match wins (docs/router.md, "Decision precedence"):

1. fully cached prompt (``eff_len == 0``)      -> local  ``fully_cached``
2. ``prompt_logprobs`` asked                    -> local  ``prompt_logprobs``
3. a LoRA adapter named and no live prefill
   worker runs adapters (``lora_pool_size == 0``) -> local  ``lora_adapter``
4. request override ``local``                   -> local  ``override_local``
5. empty prefill pool (``empty_pool_local``)    -> local  ``empty_pool``
6. request override ``remote``                  -> remote ``override_remote``
7. ``mode: always_local`` / ``always_remote``   -> fixed  ``mode_always_*``
8. ``mode: conditional``: the policy (threshold / score / cost_model), with
   the high-priority queue bypass applied inside it; then a remote choice
   for a low-priority request while the pool is busy is kept local
   (``low_priority_pool_busy``) when qos.degrade says so. The cost model keeps a
   request under a LoRA adapter local (``lora_adapter_load``) when remote would
   have won but for loading the adapter on a prefill worker that holds none of it.

Every decision carries both predicted TTFTs (same cost estimates whatever
the policy), so logs and ``pdserve policy explain`` can show what the
choice is expected to cost. What it reads and returns (``RequestFeatures``,
``ClusterSnapshot``, ``Decision``) is in router/values.py.
"""

from __future__ import annotations

from pdserve.common import Priority
from pdserve.router.costs import CostEstimates
from pdserve.router.policy import RouterPolicy
from pdserve.router.rules import SCORE_DECIMALS, bypasses_queue, score_metric, score_rule, threshold_rule
from pdserve.router.values import ClusterSnapshot, Decision, RequestFeatures, Route

__all__ = ["SCORE_DECIMALS", "bypasses_queue", "decide", "pool_busy", "predict", "score_metric"]

# What each rule returns: (route, reason code, human detail, score).
_Routed = tuple[Route, str, str, float | None]


def pool_busy(snapshot: ClusterSnapshot, policy: RouterPolicy) -> bool:
    """The prefill pool is busy: queue depth >= busy_queue_depth_per_worker x pool size."""
    per_worker = policy.router.overrides.busy_queue_depth_per_worker
    return snapshot.prefill_queue_depth >= per_worker * snapshot.prefill_pool_size


def predict(
    features: RequestFeatures, snapshot: ClusterSnapshot, policy: RouterPolicy
) -> tuple[float, float, float, float, float]:
    """Predicted timings of both routes (the cost_model of docs/router.md).

    Returns ``(local_wait, ttft_local, remote_wait, ttft_remote, itl_penalty)``
    in ms. With B the local prefill budget (prompt tokens per step; no budget:
    one step), base = step_fixed_ms + step_decode_ms_per_seq x decoding requests
    (the part of each step that is not prompt tokens), compute(n) = n x t_local
    + attention pairs of n tokens after the cached ones / 1000 x
    prefill_attention_ms_per_kpair, and r = t_remote / t_local (how much slower a
    prefill worker computes the same prompt, measured):

    local  = min(in flight + behind, beside) + decode wait + residual_local, where
             behind = ceil((backlog + eff_len) / B) x base + backlog compute + compute(eff_len)
                      (first come, first served); once the backlog's drain rate D (wall ms
                      per prompt token, measured: ``local_drain_ms_per_token``) is known,
                      behind = (backlog + eff_len) x D while a backlog waits; backlog is the
                      prompt tokens the local prefills still have to compute; with a budget and a backlog,
             beside = in flight + base + B x t_local + compute(eff_len) - eff_len x t_local, only for
                      eff_len <= B / 2 (the scheduler gives a waiting prompt half of the
                      step beside a running prefill; a longer one, once running, waits for
                      the older prefill: behind);
             with T tokens past cached_len in this worker's second KV tier, eff_len - T
             tokens are computed after cached_len + T and T x tier_load_ms_per_token added,
             when that is less than computing all of eff_len; with ``peer_reads`` (this
             worker borrows prefixes, decode/borrow.py), the P = remote_cached_len -
             cached_len tokens a prefill worker holds are read instead, at the transfer's
             cost, when that is less again;
             in flight = what is left of the engine step under way (the request is scheduled
                      after it; ``step_in_flight_ms``), except behind a backlog timed by D,
                      which counts the steps as they came
    remote = in flight + r x (queue depth x step_fixed_ms + queue compute) / pool size + decode wait
             + r x (step_fixed_ms + compute(remote_eff)) + kv_bytes(eff_len) / bandwidth
             + setup + residual_remote, where remote_eff = prompt_len - max(cached_len,
             remote_cached_len): a prefill worker holding a longer prefix computes only past it;
             plus grammar_compile_ms for a structured-output request whose grammar was new at
             this worker's edge (the prefill worker compiles it too before its first token);
             plus lora_load_ms for a request under a LoRA adapter that no prefill worker holds
             (the one that takes it reads it from disk first)
    decode wait = decode_backlog_tokens x decode ms per token (both routes)
    itl_penalty = itl_penalty_weight x decoding requests x (local prefill ms)
                  + blocking_penalty_weight x arrival rate (per ms) x (local prefill ms)
                    x (its longest step ms) / 2
    (requests arriving during the local prefill each wait for the step under way, half
    of it on average: with a budget, one chunk's step; without, the whole prefill)

    The residuals are what measured TTFTs of each route exceeded the rest of the
    formula by, on average (``CostModel.observe_ttft``): 0 until requests finish.
    ``local_wait`` is the backlog's part of the local TTFT.
    """
    # t_remote enters as r (CostEstimates.remote_ratio) and through the queue
    c = snapshot.costs
    eff = features.prompt_len - features.cached_len
    if eff < 0:
        eff = 0
    t_local = c.prefill_local_ms_per_token
    decode_wait = snapshot.decode_backlog_tokens * c.decode_ms_per_token
    backlog = snapshot.local_prefill_queue_tokens
    base = c.step_fixed_ms + c.step_decode_ms_per_seq * snapshot.decode_active_requests
    budget = snapshot.local_prefill_budget_tokens or 0
    compute = c.prefill_compute_ms(eff, features.cached_len)
    # Locally, what the second tier holds is loaded back rather than computed when that is
    # cheaper (the engine decides the same way; the last prompt token is always computed).
    local_eff, local_compute = eff, compute
    tier = min(features.tier_cached_len, max(0, eff - 1))
    if tier:
        loaded = c.prefill_compute_ms(eff - tier, features.cached_len + tier) + tier * c.tier_load_ms_per_token
        if loaded < compute:
            local_eff, local_compute = eff - tier, loaded
    # And what a prefill worker holds past it is read from that worker (a prefix loan,
    # decode/borrow.py) when this worker borrows and the read is cheaper.
    peer = min(features.remote_cached_len - features.cached_len, eff - 1) if features.peer_reads else 0
    if peer > tier and peer >= 2 * 16:
        read = c.prefill_compute_ms(eff - peer, features.cached_len + peer) + c.transfer_ms(peer)
        if read < local_compute:
            local_eff, local_compute = eff - peer, read
    drain = c.local_drain_ms_per_token
    if backlog and drain > 0:
        # Behind a backlog, prompt tokens go at the rate this worker's backlog has measurably
        # drained at lately (its chunks, the streams beside them, the gaps between steps).
        computed = c.prefill_compute_ms(local_eff, features.cached_len + eff - local_eff)
        local_wait = backlog * drain + decode_wait
        local_prefill = local_eff * drain + (local_compute - computed)
    else:
        local_wait = (snapshot.step_in_flight_ms + _steps(backlog, budget) * base
                      + _backlog_ms(c, backlog, snapshot.local_prefill_queue_requests) + decode_wait)
        local_prefill = (_steps(backlog + local_eff, budget) - _steps(backlog, budget)) * base + local_compute
    half = max(1, budget // 2)
    if budget and backlog and 0 < local_eff <= half:
        # It fits the half step the scheduler leaves it beside the running prefill. A longer
        # prompt gets that half step once: as soon as it runs, the older prefill takes the
        # whole budget again (first come, first served), so it finishes behind the backlog.
        beside = snapshot.step_in_flight_ms + base + budget * t_local + local_compute - local_eff * t_local
        if beside < local_wait - decode_wait + local_prefill:
            shared = snapshot.step_in_flight_ms + base + budget * t_local  # after the step under way, one shared step
            local_wait = min(local_wait, shared + decode_wait)
            local_prefill = max(0.0, beside - (local_wait - decode_wait))
    bypass = bypasses_queue(features, policy)
    queue_tokens = 0 if bypass else snapshot.prefill_queue_tokens
    pool = snapshot.prefill_pool_size if snapshot.prefill_pool_size > 1 else 1
    queue_ms = 0.0
    if queue_tokens:
        depth = max(1, snapshot.prefill_queue_depth)
        queue_ms = c.remote_ratio * (depth * c.step_fixed_ms + _backlog_ms(c, queue_tokens, depth))
    # The remote route waits for the step under way too: its KV blocks are reserved on the
    # engine thread between steps before its task is queued (decode/remote.py `_reserve`).
    remote_wait = snapshot.step_in_flight_ms + queue_ms / pool + decode_wait
    ttft_remote = remote_wait + features.grammar_compile_ms
    if eff:  # nothing to prefill means nothing to compute or transfer, setup included
        ratio = c.remote_ratio
        held = max(features.cached_len, min(features.remote_cached_len, features.prompt_len - 1))
        remote_compute = compute if held == features.cached_len else \
            c.prefill_compute_ms(max(1, features.prompt_len - held), held)
        ttft_remote += ratio * (c.step_fixed_ms + remote_compute) + c.transfer_ms(eff) + c.ttft_residual_remote_ms
        if features.lora_adapter and not features.lora_held_remote:
            ttft_remote += c.lora_load_ms  # a prefill worker reads the adapter before it computes
        local_prefill += c.ttft_residual_local_ms
    ttft_remote = max(ttft_remote, remote_wait)
    local_prefill = max(local_prefill, 0.0)
    cm = policy.router.cost_model
    penalty = cm.itl_penalty_weight * snapshot.decode_active_requests * local_prefill
    if cm.blocking_penalty_weight and snapshot.arrival_rate_per_s > 0 and local_prefill > 0:
        step = local_prefill
        if budget and eff > budget:  # chunked: an arrival waits one chunk's step at most
            step = min(step, base + c.prefill_compute_ms(budget, features.cached_len + eff - budget))
        # Requests arriving during the local prefill wait on it, half of it on average.
        arrivals = snapshot.arrival_rate_per_s / 1000.0 * local_prefill
        penalty += cm.blocking_penalty_weight * arrivals * step / 2.0
    return local_wait, local_wait + local_prefill, remote_wait, ttft_remote, penalty


def _backlog_ms(c: CostEstimates, tokens: int, requests: int) -> float:
    """Prompt compute of ``tokens`` in ``requests`` prompts of equal length (0: one prompt)."""
    if tokens <= 0:
        return 0.0
    n = max(1, min(requests, tokens))
    return n * c.prefill_compute_ms(tokens // n)


def _steps(tokens: int, budget: int) -> int:
    """Steps that prefill ``tokens`` at most ``budget`` (0: no cap) at a time."""
    if tokens <= 0:
        return 0
    return -(-tokens // budget) if budget else 1


def decide(
    features: RequestFeatures,
    snapshot: ClusterSnapshot,
    policy: RouterPolicy,
    *,
    explain: bool = False,
) -> Decision:
    """Local or remote prefill for one request; see the module docstring for precedence."""
    trace: list[str] | None = [] if explain else None
    pred = predict(features, snapshot, policy)
    if trace is not None and features.tier_cached_len:
        trace.append(f"this worker's second KV tier holds {features.tier_cached_len} more prompt tokens past the "
                     f"{features.cached_len} in its pool (load {snapshot.costs.tier_load_ms_per_token:.4f} ms/token): "
                     "a local prefill loads them back when that is cheaper than computing them")
    if trace is not None and features.peer_reads and features.remote_cached_len - features.cached_len >= 32:
        trace.append(f"a local prefill would read the {features.remote_cached_len - features.cached_len} prompt "
                     "tokens a prefill worker holds past this worker's (a prefix loan) when that is cheaper "
                     "than computing them")
    if trace is not None and features.remote_cached_len > features.cached_len:
        trace.append(f"a prefill worker holds {features.remote_cached_len} prompt tokens cached (its KV "
                     f"events) against {features.cached_len} here: a remote prefill computes only past them")
    if trace is not None and features.grammar_compile_ms:
        trace.append(f"its grammar was new here (compiled in {features.grammar_compile_ms:.1f} ms): a remote "
                     "prefill compiles it again before its first token, so the remote prediction counts that")
    if trace is not None and snapshot.spec_k is not None:
        trace.append(_spec_line(snapshot))
    if trace is not None and features.lora_adapter:
        trace.append(_lora_line(features, snapshot))
    route, reason, detail, score = _route(features, snapshot, policy, pred, trace)
    if trace is not None:
        trace.append(f"=> {route} ({reason}): {detail}")
    return Decision(
        route, reason, detail, score, pred[1], pred[3],
        pred[2] if route == "remote" else pred[0],
        tuple(trace) if trace is not None else (),
    )


def _route(features, snapshot, policy, pred, trace) -> _Routed:
    r = policy.router
    eff = features.eff_len
    if trace is not None:
        trace.append(
            f"eff_len = max(0, prompt_len {features.prompt_len} - cached_len "
            f"{features.cached_len}) = {eff}"
        )
        trace.append(
            f"predicted TTFT: local {pred[1]:.1f} ms (wait {pred[0]:.1f}), "
            f"remote {pred[3]:.1f} ms (wait {pred[2]:.1f})"
        )
    if eff == 0:
        return "local", "fully_cached", "the whole prompt is in the prefix cache", None
    if features.prompt_logprobs:
        return ("local", "prompt_logprobs", "prompt_logprobs asked: every prompt position runs where its logits are "
                "read (no cached prefix, no remote prefill)", None)
    if features.lora_adapter and snapshot.lora_pool_size == 0:
        return ("local", "lora_adapter", "a LoRA adapter is named and no live prefill worker runs adapters "
                "(enable_lora): prefilled where it runs", None)
    if features.override == "local":
        return "local", "override_local", "the request asked for local prefill", None
    if snapshot.prefill_pool_size == 0 and r.overrides.empty_pool_local:
        return "local", "empty_pool", "no live prefill worker", None
    if features.override == "remote":
        return "remote", "override_remote", "the request asked for remote prefill", None
    if r.mode == "always_local":
        return "local", "mode_always_local", "router.mode is always_local", None
    if r.mode == "always_remote":
        return "remote", "mode_always_remote", "router.mode is always_remote", None
    if trace is not None:
        trace.append(f"mode conditional, policy {r.policy}, priority {features.priority.label}")
        if bypasses_queue(features, policy):
            trace.append("high priority bypasses the prefill queue: queue treated as empty")
    if r.policy == "threshold":
        decided = threshold_rule(features, snapshot, policy, trace)
    elif r.policy == "score":
        decided = score_rule(features, snapshot, policy, trace)
    else:
        decided = _cost_model(features, snapshot, policy, pred, trace)
    return _keep_low_priority_local_when_busy(decided, features, snapshot, policy, trace)


def _keep_low_priority_local_when_busy(decided, features, snapshot, policy, trace) -> _Routed:
    if (
        decided[0] != "remote"
        or features.priority is not Priority.LOW
        or not policy.qos.degrade.no_remote_prefill_for_low_priority_when_busy
    ):
        return decided
    limit = policy.router.overrides.busy_queue_depth_per_worker * snapshot.prefill_pool_size
    busy = pool_busy(snapshot, policy)
    depth = snapshot.prefill_queue_depth
    if trace is not None:
        trace.append(f"low priority: prefill queue depth {depth} >= busy limit {limit:g}: {busy}")
    if not busy:
        return decided
    detail = f"low priority kept local: prefill queue depth {depth} >= busy limit {limit:g}"
    return "local", "low_priority_pool_busy", detail, decided[3]


def _spec_line(snapshot: ClusterSnapshot) -> str:
    """The explain line on this worker's speculative decoding (common/spec_rule.py)."""
    batch = snapshot.decode_active_requests + 1
    k = (f"k = {snapshot.spec_k} proposals per step for a stream admitted now (batch {batch})" if snapshot.spec_k
         else f"no proposals for a stream admitted now (batch {batch} is past the load rule)")
    return (f"speculative decoding: {k}; a verifying step gives a stream {snapshot.spec_tokens_per_step:.2f} "
            f"tokens on average; decode step {snapshot.costs.decode_step_ms:.1f} ms is per token emitted")


def _lora_line(features: RequestFeatures, snapshot: ClusterSnapshot) -> str:
    """The explain line on a request's LoRA adapter (docs/lora.md, "Across prefill and decode")."""
    n = snapshot.lora_pool_size
    if not n:
        return "it runs under a LoRA adapter; no live prefill worker runs adapters (enable_lora)"
    held = ("one of them holds it: no load" if features.lora_held_remote else
            f"none of them holds it: a remote prefill loads it first, {snapshot.costs.lora_load_ms:.1f} ms "
            "(cost_model.lora_load_ms, then measured)")
    return f"it runs under a LoRA adapter; {n} live prefill worker(s) run adapters, {held}"


def _cost_model(features, snapshot, policy, pred, trace) -> _Routed:
    cm = policy.router.cost_model
    min_gain = cm.min_gain_ms
    _, ttft_local, _, cost_remote, penalty = pred
    if cm.tpot_pressure_fraction:
        step, tpot_slo = snapshot.costs.decode_step_ms, policy.qos.tpot_slo_ms
        ttft_slo = features.ttft_slo_ms if features.ttft_slo_ms is not None else policy.qos.ttft_slo_ms
        pressed = step >= cm.tpot_pressure_fraction * tpot_slo
        if trace is not None:
            trace.append(
                f"TPOT pressure: decode step {step:.1f} ms vs {cm.tpot_pressure_fraction:g} x tpot_slo_ms "
                f"{tpot_slo:g} = {cm.tpot_pressure_fraction * tpot_slo:.1f} ms: {pressed}"
                + (f"; remote TTFT {cost_remote:.1f} ms vs TTFT SLO {ttft_slo:g} ms" if pressed else "")
            )
        if pressed and cost_remote <= ttft_slo:
            return "remote", "cost_tpot_pressure", (
                f"decode step {step:.1f} ms is near tpot_slo_ms {tpot_slo:g}: prefill remotely "
                f"(predicted TTFT {cost_remote:.1f} ms meets the TTFT SLO {ttft_slo:g} ms)"
            ), cost_remote - ttft_local
    cost_local = ttft_local + penalty
    gain = cost_local - cost_remote
    if trace is not None:
        trace.append(
            f"cost local = TTFT {ttft_local:.1f} + ITL penalty {penalty:.1f} "
            f"= {cost_local:.1f} ms; cost remote = {cost_remote:.1f} ms"
        )
        trace.append(f"gain of remote = {gain:.1f} ms, needs > min_gain_ms {min_gain:g}")
    if gain > min_gain:
        return "remote", "cost_remote_cheaper", (
            f"remote saves {gain:.1f} ms > min_gain_ms {min_gain:g}"
        ), gain
    load = snapshot.costs.lora_load_ms if features.lora_adapter and not features.lora_held_remote else 0.0
    if load and gain + load > min_gain:
        return "local", "lora_adapter_load", (
            f"remote would save {gain + load:.1f} ms but no prefill worker holds the LoRA adapter: loading it "
            f"({load:.1f} ms) leaves {gain:.1f} ms, not > min_gain_ms {min_gain:g}"
        ), gain
    return "local", "cost_local_cheaper", (
        f"remote would save {gain:.1f} ms, not > min_gain_ms {min_gain:g}"
    ), gain
