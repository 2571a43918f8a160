"""prefill/progress.py: how long a prefill batch's step may take before its worker counts as
hung: an upper bound drawn from the worker's own timed steps, times a margin."""

from __future__ import annotations

import pytest

from pdserve.engine.step_budget import attention_pairs
from pdserve.kvtransfer import PrefillTask
from pdserve.prefill.progress import PROGRESS_FACTOR, UNTIMED_STEP_S, StepTimes, slowest_step


def task(n: int, cached: int = 0) -> PrefillTask:
    return PrefillTask(request_id=f"r{n}-{cached}", epoch=0, token_ids=list(range(n)), cached_len=cached,
                       target_worker_id="d0", target_block_ids=[0])


def step_ms(tokens: int, pairs: int) -> float:
    """A made-up step cost curve of the engine's form: fixed + per token + per attention pair."""
    return 20.0 + 0.5 * tokens + 0.002 * pairs


def test_the_prediction_bounds_any_step_of_the_engines_cost_form_from_above():
    """Timed steps of a cost curve fixed + per token + per pair bound a step with more work,
    from above, and a step with less work by the smallest timed step that covers it."""
    times = StepTimes()
    assert times.predict(100, 5050) is None
    for n, start in ((64, 0), (512, 0), (512, 512)):
        pairs = attention_pairs(n, start)
        times.observe(step_ms(n, pairs) / 1e3, n, pairs)
    for n, start in ((32, 0), (256, 100), (512, 512), (1024, 0), (2048, 4096)):
        pairs = attention_pairs(n, start)
        predicted = times.predict(n, pairs)
        assert predicted >= step_ms(n, pairs) / 1e3 - 1e-12, (n, start)
    # Covered by a timed step: no more than that step took.
    assert times.predict(32, attention_pairs(32, 0)) <= step_ms(64, attention_pairs(64, 0)) / 1e3 + 1e-12


def test_a_step_with_no_prompt_token_is_not_kept():
    times = StepTimes()
    times.observe(0.01, 0, 0)
    assert len(times) == 0 and times.predict(10, 55) is None


def test_the_slowest_step_of_a_batch_is_capped_by_the_step_budget_and_the_longest_prompt():
    batch = [task(100), task(300, cached=100)]
    tokens, pairs = slowest_step(batch, max_step_tokens=8192)
    assert tokens == 300 and pairs == attention_pairs(100, 0) + attention_pairs(200, 100)
    tokens, pairs = slowest_step(batch, max_step_tokens=64)
    assert tokens == 64 and pairs == 64 * 300  # each of its tokens attends to at most 300 positions


def test_the_allowance_is_a_multiple_of_the_prediction_or_the_untimed_one():
    times = StepTimes()
    assert times.allowance([task(100)], 8192) == UNTIMED_STEP_S
    times.observe(0.2, 100, attention_pairs(100, 0))
    assert times.allowance([task(100)], 8192) == pytest.approx(PROGRESS_FACTOR * 0.2)
    assert times.allowance([task(200)], 8192) > PROGRESS_FACTOR * 0.2  # more work, more time
