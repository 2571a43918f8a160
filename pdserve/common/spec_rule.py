"""Speculative decoding's load rule and its expected yield, in plain numbers: the engine's
proposer applies the rule (engine/spec_decode.py), the router explains it and prices a
decode step with it (router/decide.py, `pdserve policy explain`), so both read one rule.

The rule: no request speculates in a step whose running batch exceeds
``disable_by_batch_size``; otherwise it gets ``num_speculative_tokens`` proposals, never more
than its ``max_tokens`` or the model's length leave room for (``room``: tokens it may still
emit after this step's own). The acceptance pause (a request proposing poorly waits a few
steps) is per request and stays in the engine.

The yield: a verifying step emits the accepted prefix of the k proposals plus one token. With
each proposal accepted with probability ``a`` given the previous ones were (the usual
independence assumption), a step emits 1 + a + a^2 + ... + a^k tokens on average.
"""

from __future__ import annotations


def spec_k(num_speculative_tokens: int, disable_by_batch_size: int, batch: int, room: int | None = None) -> int:
    """Proposals a decoding request gets in a step whose running batch is ``batch``."""
    if batch > disable_by_batch_size:
        return 0
    k = num_speculative_tokens
    if room is not None:
        k = min(k, room)
    return max(0, k)


def tokens_per_step(k: int, acceptance: float) -> float:
    """Mean tokens a verifying step emits for one request: k proposals, each accepted with
    probability ``acceptance`` (0-1) while the previous ones were, plus the step's own token."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance {acceptance!r} must be in [0, 1]")
    return sum(acceptance ** i for i in range(max(0, k) + 1))
