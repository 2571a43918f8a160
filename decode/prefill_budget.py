"""A decode worker's local prefill budget: how many prompt tokens one engine step may take, so
that the step stays within the TPOT target of the streams it advances too.

A decode worker prefills short or cache-hit prompts itself (the router keeps them local). Run
in one step, a long local prefill stalls every running stream for its whole duration: a
1.6k-token prompt held a 6-token prompt's first token for 1.75 s in `make demo`. So the
engine's prompt tokens per step are capped (`LLMEngine.set_prefill_token_budget`) at

    budget = (tpot_slo_ms * TARGET_FRACTION - decode_step_ms) / prefill_ms_per_token

where ``decode_step_ms`` and ``prefill_ms_per_token`` are the router's own cost estimates
(router/costs.py, measured on this worker's steps: the figures it routes with) and
``tpot_slo_ms`` is the router policy's QoS target. The budget is clamped to
[``MIN_TOKENS``, the engine's ``max_num_batched_tokens``] so that a prefill always makes
progress, and it is re-applied only when it moves by more than ``HYSTERESIS``. The topology
can fix it instead (``roles.decode.local_prefill_budget_tokens``).

While nothing is decoding there is no stream to protect, only prompts that may arrive: a
step then takes up to ``max(budget, IDLE_TOKENS)`` prompt tokens (fewer, slower steps would
only delay the prefill), short enough that a prompt arriving meanwhile waits one step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

TARGET_FRACTION = 0.8  # of tpot_slo_ms: room for step-to-step noise
MIN_TOKENS = 16  # a prefill chunk never goes below this (progress; one block of the default size)
HYSTERESIS = 0.1  # re-apply only when the budget moves by more than this fraction
IDLE_TOKENS = 256  # prompt tokens per step while nothing decodes (~130 ms on the 2-core CI box)


@dataclass(frozen=True)
class BudgetDecision:
    tokens: int
    reason: str  # what it was derived from, for logs and `explain`


def derive_budget(tpot_slo_ms: float, decode_step_ms: float, prefill_ms_per_token: float,
                  max_tokens: int, fixed: int | None = None) -> BudgetDecision:
    """The prompt-token budget of one step (module docstring)."""
    if fixed is not None:
        return BudgetDecision(min(fixed, max_tokens), f"fixed by the topology ({fixed} tokens)")
    target = tpot_slo_ms * TARGET_FRACTION
    room = target - decode_step_ms
    if prefill_ms_per_token <= 0:
        return BudgetDecision(max_tokens, "no prefill cost measured yet")
    raw = int(room / prefill_ms_per_token) if room > 0 else 0
    tokens = max(MIN_TOKENS, min(raw, max_tokens))
    reason = (f"({TARGET_FRACTION:g} x tpot_slo_ms {tpot_slo_ms:g} - decode step {decode_step_ms:.1f} ms) "
              f"/ {prefill_ms_per_token:.3f} ms per prefill token = {raw}")
    if raw < MIN_TOKENS:
        reason += f", raised to the minimum chunk {MIN_TOKENS}"
    elif raw > max_tokens:
        reason += f", capped at max_num_batched_tokens {max_tokens}"
    return BudgetDecision(tokens, reason)


class PrefillBudget:
    """Keeps a decode worker's engine budget in line with its measured costs (event-loop side).

    ``apply(tokens)`` hands the new budget to the engine thread; ``update`` is called after
    every engine step with the current cost estimates and policy.
    """

    def __init__(self, apply, max_tokens: int, fixed: int | None = None):
        self._apply = apply
        self.max_tokens = max_tokens
        self.fixed = fixed
        self.current: BudgetDecision | None = None

    def update(self, tpot_slo_ms: float, decode_step_ms: float, prefill_ms_per_token: float) -> BudgetDecision:
        d = derive_budget(tpot_slo_ms, decode_step_ms, prefill_ms_per_token, self.max_tokens, self.fixed)
        cur = self.current
        if cur is None or abs(d.tokens - cur.tokens) > HYSTERESIS * cur.tokens:
            self.current = d
            self._apply(d.tokens)
            log.info("local prefill budget: %d tokens per step (%s)", d.tokens, d.reason)
        return self.current
