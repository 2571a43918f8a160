"""The engine's step, driven the same way by both roles.

`EngineDriver.step()` runs one `LLMEngine.step`, publishes the step under way while it runs
(``in_flight``: the router's "time left in this step", `CostEstimates.step_left_ms`), runs the
role's hooks once the step's plan is made and before its forward pass, and returns the step's
deltas with its `StepInfo` (None when it scheduled nothing). Both roles loop over it:

- a decode worker's engine thread (decode/async_engine.py `AsyncEngine`), between the commands
  and pollers of its event loop; its hooks: the remote path takes the blocks the plan reserved
  (engine/remote_kv.py), so their tasks go out while the step computes;
- a prefill worker's batch (prefill/batch.py `PrefillBatch`), until its prompts are computed;
  its hook: the pages of prompts that finish in the step stream out layer by layer.

Each feeds the router's cost model from the same `StepInfo`. The simulator (sim/engine.py)
runs the same `Scheduler` on a simulated clock instead: it plans with `Scheduler.schedule`
and prices the step from a cost profile rather than running it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine_types import RequestDelta
    from .llm_engine import LLMEngine
    from .request import Request

# (request, new tokens) of a step's plan -> a per-layer hook for the step, or None
PlanHook = Callable[[list[tuple["Request", int]]], Any]


@dataclass
class StepInfo:
    """One engine step as the cost model sees it."""

    ms: float
    num_seqs: int
    num_tokens: int
    num_decode_seqs: int
    prefill_pairs: int = 0  # the prompt tokens' attention work (LLMEngine.last_step_pairs)
    end_s: float = 0.0  # time.perf_counter() when the step ended
    # Speculative decoding (engine/spec_step.py): the proposals the step verified (rows of its
    # decoding requests, decode work) and those accepted (tokens emitted beyond one per stream).
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        """The step's prompt (and recompute) tokens: neither decoding tokens nor proposals."""
        return self.num_tokens - self.num_decode_seqs - self.draft_tokens

    @property
    def emitted_per_stream(self) -> float:
        """Tokens each decoding stream got from the step on average (1 without speculation):
        the step's time over it is the TPOT the streams saw."""
        if self.num_decode_seqs == 0:
            return 1.0
        return (self.num_decode_seqs + self.accepted_tokens) / self.num_decode_seqs


class EngineDriver:
    """Steps one engine (from the one thread that owns it; see the module docstring)."""

    def __init__(self, engine: LLMEngine, on_plan: Sequence[PlanHook] = ()):
        self.engine = engine
        self._on_plan = tuple(on_plan)
        # The step under way (the stepping thread writes, the router reads: one tuple swapped
        # whole): (its start, time.perf_counter(); decoding streams; prompt tokens; attention
        # pairs), None between steps.
        self.in_flight: tuple[float, int, int, int] | None = None
        self._t0 = 0.0

    def step(self) -> tuple[list[RequestDelta], StepInfo | None]:
        """One step: its deltas, and its figures (None: it scheduled nothing). A forward pass
        that raises is the engine's `StepError` (its requests named), raised here."""
        eng = self.engine
        t0 = self._t0 = time.perf_counter()
        accepted0 = eng.stats.num_spec_accepted_tokens
        try:
            deltas = eng.step(on_plan=self._planned)
        finally:
            self.in_flight = None
        seqs, tokens, decodes = eng.last_step
        if seqs == 0:
            return deltas, None
        end = time.perf_counter()
        return deltas, StepInfo(ms=(end - t0) * 1e3, num_seqs=seqs, num_tokens=tokens, num_decode_seqs=decodes,
                                prefill_pairs=eng.last_step_pairs, end_s=end, draft_tokens=eng.last_step_drafts,
                                accepted_tokens=eng.stats.num_spec_accepted_tokens - accepted0)

    def _planned(self, scheduled: list[tuple[Request, int]]) -> Any:
        """The plan is made (LLMEngine.step sets last_step first): publish the step's shape,
        run the hooks; the last per-layer hook one of them returns serves the step."""
        eng = self.engine
        _, tokens, decodes = eng.last_step
        self.in_flight = (self._t0, decodes, tokens - decodes - eng.last_step_drafts, eng.last_step_pairs)
        layer_hook = None
        for hook in self._on_plan:
            layer_hook = hook(scheduled) or layer_hook
        return layer_hook
