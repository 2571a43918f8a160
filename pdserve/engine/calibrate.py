"""Boot calibration: time a few real engine steps that span the step cost curve.

Before a worker serves, its router knows only the policy's seed costs, which may be off by
several times on the hardware at hand (a 2-core CPU, an H100), and the first minute of traffic
would be routed, admitted and chunked on guesses. ``measure_steps`` runs a short, fixed set of
steps on the loaded engine, synthetic prompts only, and returns their timings as
``(ms, decoding streams, prompt tokens, attention pairs)``, the samples the step curve is fitted on
(router/costs.py ``CostModel.calibrate``):

* prompts alone: 32 and 128 tokens, then a 1024-token prompt in two chunks of 512 (the
  second attends to the first: the attention term that makes long prompts cost more per
  token), within the engine's limits; they give the fixed part, the per-token slope and the
  attention term;
* decode steps at two batch sizes (1 and 8 streams), which give the per-stream part;
* one mixed step (8 streams + a 128-token prompt), a check that the parts add up.

A warm-up step comes first and is not counted (first-call allocations, packed weights). It runs
on the caller's thread, before the engine thread starts; every request it made is aborted and
its blocks freed, and its prompts carry their own cache salt, so no client prompt can ever hit
their blocks in the prefix cache. About half a second on the 2-core CI box.
"""

from __future__ import annotations

import random
import time

from .request import SamplingParams

PROMPT_LENGTHS = (32, 128)
LONG_CHUNK = 512  # the long prompt: two chunks of this
DECODE_BATCHES = (8, 1)
DECODE_STEPS = 3  # steps timed per batch size
SALT = b"pdserve-boot-calibration"


def measure_steps(engine) -> list[tuple[float, int, int, int]]:
    """Time the calibration steps on ``engine`` (an idle ``LLMEngine``)."""
    if engine.has_work():
        raise RuntimeError("calibration needs an idle engine")
    cfg = engine.config
    longest = min(cfg.max_num_batched_tokens, engine.max_model_len - 2)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    made: list[str] = []
    samples: list[tuple[float, int, int, int]] = []

    def add(n: int, max_tokens: int = 1):
        rid = f"calibration-{len(made)}"
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        req = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                 request_id=rid)
        req.cache_salt = SALT
        made.append(rid)
        return req

    def timed_step() -> tuple[float, int, int, int]:
        t0 = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - t0) * 1e3
        _, tokens, decodes = engine.last_step
        return ms, decodes, tokens - decodes - engine.last_step_drafts, engine.last_step_pairs

    budget = engine.scheduler.prefill_token_budget
    engine.scheduler.prefill_token_budget = None  # whole prompts: the steps this plan expects
    try:
        add(min(16, longest))
        timed_step()  # warm-up, not counted
        for n in PROMPT_LENGTHS:
            if n <= longest:
                add(n)
                samples.append(timed_step())
        chunk = min(LONG_CHUNK, longest // 2)
        if chunk >= 64:
            engine.scheduler.prefill_token_budget = chunk
            add(2 * chunk)
            samples.append(timed_step())
            samples.append(timed_step())  # the second chunk, attending to the first
            engine.scheduler.prefill_token_budget = None
        batch = max(DECODE_BATCHES)
        streams = [add(min(16, longest), max_tokens=DECODE_STEPS * 3 + 4) for _ in range(batch)]
        samples.append(timed_step())  # their prompts together
        if 128 <= longest:
            for _ in range(DECODE_STEPS):
                samples.append(timed_step())
            add(128)
            samples.append(timed_step())  # mixed
        for size in DECODE_BATCHES[1:]:
            for req in streams[size:]:
                engine.abort_request(req.request_id)
            for _ in range(DECODE_STEPS):
                samples.append(timed_step())
    finally:
        for rid in made:
            engine.abort_request(rid)
        engine.scheduler.prefill_token_budget = budget
    return [s for s in samples if s[1] or s[2]]
