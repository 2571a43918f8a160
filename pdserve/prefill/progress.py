"""How long a prefill batch's steps may take: the allowance its compute-progress heartbeat carries.

A prefill worker's heartbeat (prefill/heartbeat.py) runs on its event loop, which
goes on beating while the compute thread is hung inside an engine step. So the beat also
carries the compute thread's progress (common/compute_thread.py `ComputeProgress`: marks so
far, the age of the latest, and how long the unit under way may take), and the queue fails
back the tasks of a worker whose progress has stood still past

    bound = max(queue.stall_timeout_s, within_s)

(cluster/queue/liveness.py). ``within_s`` is the worker's own account of the unit under way:

* an engine step: ``PROGRESS_FACTOR`` x the predicted time of the batch's slowest step
  (`StepTimes.allowance`), so a step may run several times slower than this worker's record
  before it counts as hung (noise, a host stall, a step of a longer context than any timed);
* a wait with its own timeout (a page write, a loan): that timeout + ``WAIT_SLACK_S``, after
  which the thread would have given up on it by itself.

The prediction is an upper bound learned from this worker's own recent steps, not a fit: a
step's time is taken to grow with its prompt tokens and its attention pairs (engine/step_budget.py:
fixed + per token + per pair, none negative), so a timed step of ``s`` seconds that did
``t`` tokens and ``p`` pairs bounds a step of ``T`` tokens and ``P`` pairs by ``s x max(1, T/t,
P/p)``; the tightest such bound over the recent steps is the prediction. Until the worker has
timed a step it allows ``UNTIMED_STEP_S`` (``UNTIMED_STEP_S_GPU`` on a GPU): a first step may be a cold one (first-call
allocations, kernels built on first use).
"""

from __future__ import annotations

from collections import deque

from pdserve.engine.step_budget import attention_pairs

PROGRESS_FACTOR = 4.0  # a step may take this many times its prediction before it counts as hung
UNTIMED_STEP_S = 10.0  # the allowance of a step before this worker has timed any (it may be cold)
# On a GPU the first step of a kernel variant may build it: FlashInfer JITs each variant on first
# use (80-120 s measured on an H200 with nvcc 13), which must not read as a hung thread.
UNTIMED_STEP_S_GPU = 300.0
WAIT_SLACK_S = 1.0  # beyond its own timeout, before a bounded wait counts as hung
STEPS_KEPT = 64  # the recent steps a prediction is drawn from (a machine's speed drifts)


class StepTimes:
    """This worker's recent engine steps (seconds, prompt tokens, attention pairs) and the
    upper bound they give on a step's time (see the module docstring). Used by the batch
    thread only."""

    def __init__(self, kept: int = STEPS_KEPT, untimed_s: float = UNTIMED_STEP_S):
        self._steps: deque[tuple[float, int, int]] = deque(maxlen=kept)
        self.untimed_s = untimed_s

    def __len__(self) -> int:
        return len(self._steps)

    def observe(self, seconds: float, tokens: int, pairs: int) -> None:
        """A step that computed `tokens` prompt tokens with `pairs` attention pairs took
        `seconds`. A step with no prompt token says nothing of prefill and is not kept."""
        if tokens > 0 and pairs > 0 and seconds >= 0:
            self._steps.append((float(seconds), int(tokens), int(pairs)))

    def predict(self, tokens: int, pairs: int) -> float | None:
        """An upper bound on the seconds of a step of `tokens` prompt tokens and `pairs`
        attention pairs, from the recent steps; None before any was timed."""
        if not self._steps:
            return None
        return min(s * max(1.0, tokens / t, pairs / p) for s, t, p in self._steps)

    def allowance(self, tasks, max_step_tokens: int) -> float:
        """How long a step of a batch of `tasks` may take before it counts as hung:
        `PROGRESS_FACTOR` x the prediction of its slowest step (`slowest_step`), or
        `untimed_s` before any step was timed."""
        predicted = self.predict(*slowest_step(tasks, max_step_tokens))
        return self.untimed_s if predicted is None else PROGRESS_FACTOR * predicted


def slowest_step(tasks, max_step_tokens: int) -> tuple[int, int]:
    """(prompt tokens, attention pairs) that no step of a batch of `tasks` exceeds, when a step
    computes at most `max_step_tokens`: its tokens are at most the batch's (or that cap), and
    its pairs at most the batch's in all, and at most each of its tokens attending to the
    batch's longest prompt."""
    tokens = sum(max(0, t.num_prefill_tokens) for t in tasks)
    pairs = sum(attention_pairs(max(0, t.num_prefill_tokens), t.cached_len) for t in tasks)
    longest = max((len(t.token_ids) for t in tasks), default=0)
    step = min(tokens, max(1, max_step_tokens))
    return step, min(pairs, step * longest)
