"""A decode worker's local prefill budget: what its engine plans each step's prompt tokens with.

Fed by the decode worker (decode/worker.py) and by the simulator's (sim/decode_sim.py).

A decode worker prefills short or cache-hit prompts itself (the router keeps them local). Run
in one step, a long local prefill stalls every running stream for its whole duration; cut into
too small chunks, it pays the step's fixed cost over and over. The engine therefore plans each
step's prompt tokens from both SLOs (engine/step_budget.py): the running streams' TPOT slack
and the waiting prompts' TTFT, over the step cost curve

    step ms = step_fixed_ms + step_decode_ms_per_seq x decoding streams + prefill_ms_per_token x prompt tokens
              + prefill_attention_ms_per_kpair x attention pairs / 1000

that the router's cost model fits on this worker's own steps (router/costs.py; calibrated at
boot, refined by every step). ``StepPlanFeed`` hands the engine that curve and the policy's
``qos.tpot_slo_ms`` / ``qos.ttft_slo_ms`` whenever one of them moves by more than
``HYSTERESIS`` (a cross-thread call per step would cost more than it buys). The topology can
fix the budget instead (``roles.decode.local_prefill_budget_tokens``): the engine then caps
every step's prompt tokens at that number and plans nothing.

The estimates are read through ``StepCurve`` (router/costs.py ``CostEstimates`` is one), so
the engine names nothing of the router.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from pdserve.engine.step_budget import StepCost, StepTargets

log = logging.getLogger(__name__)

HYSTERESIS = 0.1  # re-apply only when a coefficient or target moves by more than this fraction
LOG_EVERY_S = 60.0  # a re-applied plan is logged at INFO at most this often (DEBUG otherwise)


class StepCurve(Protocol):
    """The step cost curve's coefficients as the router's cost model estimates them (ms)."""

    @property
    def step_fixed_ms(self) -> float: ...
    @property
    def step_decode_ms_per_seq(self) -> float: ...
    @property
    def prefill_local_ms_per_token(self) -> float: ...
    @property
    def prefill_attention_ms_per_kpair(self) -> float: ...


def step_cost(est: StepCurve) -> StepCost:
    """The engine's step cost curve from the router's estimates."""
    return StepCost(est.step_fixed_ms, est.step_decode_ms_per_seq, est.prefill_local_ms_per_token,
                    est.prefill_attention_ms_per_kpair)


class StepPlanFeed:
    """Keeps a decode worker's engine plan in line with its measured costs (event-loop side).

    ``apply(cost, targets)`` hands a new curve and targets to the engine thread; ``fixed`` (a
    token count) is applied once through ``apply_fixed`` instead. ``update`` is called after
    every engine step with the current estimates and policy.
    """

    def __init__(self, apply: Callable[[StepCost, StepTargets], object], apply_fixed: Callable[[int], object],
                 fixed: int | None = None):
        self._apply = apply
        self.fixed = fixed
        self.cost: StepCost | None = None
        self.targets: StepTargets | None = None
        self._logged_at = float("-inf")
        if fixed is not None:
            apply_fixed(fixed)
            log.info("local prefill budget: fixed by the topology at %d tokens per step", fixed)

    def update(self, est: StepCurve, tpot_slo_ms: float, ttft_slo_ms: float) -> bool:
        """Re-apply when something moved enough; True if it did."""
        if self.fixed is not None:
            return False
        cost, targets = step_cost(est), StepTargets(tpot_slo_ms, ttft_slo_ms)
        if self.cost is not None and targets == self.targets and not _moved(self.cost, cost):
            return False
        self.cost, self.targets = cost, targets
        self._apply(cost, targets)
        now = time.monotonic()  # the curve moves with every step at first: INFO once a minute
        level = logging.INFO if now - self._logged_at >= LOG_EVERY_S else logging.DEBUG
        self._logged_at = now if level == logging.INFO else self._logged_at
        log.log(level, "step plan: %.1f ms + %.2f ms per stream + %.3f ms per prompt token; TPOT %g ms, TTFT %g ms",
                cost.fixed_ms, cost.decode_ms, cost.prefill_ms, tpot_slo_ms, ttft_slo_ms)
        return True


def _moved(old: StepCost, new: StepCost) -> bool:
    # The fixed and per-stream parts move by absolute ms too (they may be near 0).
    return (abs(new.prefill_ms - old.prefill_ms) > HYSTERESIS * old.prefill_ms
            or abs(new.fixed_ms - old.fixed_ms) > max(HYSTERESIS * old.fixed_ms, 0.5)
            or abs(new.decode_ms - old.decode_ms) > max(HYSTERESIS * old.decode_ms, 0.05)
            or abs(new.attention_ms_per_kpair - old.attention_ms_per_kpair)
            > max(HYSTERESIS * old.attention_ms_per_kpair, 1e-3))
