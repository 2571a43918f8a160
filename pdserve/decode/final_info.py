"""What a finished request's last delta carries from the engine to its stream: `FinalInfo`,
the facts its breakdown reports (decode/breakdown.py), built on the engine thread when the
engine releases the request (decode/async_engine.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine import RequestOutput


@dataclass
class FinalInfo:
    """Per-request facts sent with the last delta (for the breakdown)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    num_preemptions: int
    spec_tokens: tuple[int, int] | None = None  # speculative decoding: (proposed, accepted); None: off


def final_info(out: RequestOutput | None) -> FinalInfo | None:
    """The facts of a request the engine released (None: it had none to give)."""
    if out is None or out.times is None:  # (the engine's release always sets its times)
        return None
    t = out.times
    return FinalInfo(
        prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
        cached_tokens=out.num_cached_tokens, arrival_time=t.arrival_time,
        first_scheduled_time=t.first_scheduled_time, first_token_time=t.first_token_time,
        finish_time=time.monotonic(), num_preemptions=t.num_preemptions, spec_tokens=t.spec_tokens,
    )
