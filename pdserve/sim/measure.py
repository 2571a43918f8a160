"""`pdserve sim profile`: measure a worker's step model on this machine with the real engine.

A grid of steps is timed on an idle `LLMEngine` (the one the workers run, loaded from a
model directory, with the engine arguments the workers use): whole prompts of several
lengths, a long prompt in chunks that attend to the earlier ones, decode steps at several
batch sizes and context lengths, and mixed steps. Each shape is timed ``repeats`` times and
its median kept. `fit_step_model` fits the five terms of sim/profile.py's `StepModel` to them
by least squares (non-negative, refitted without a term that comes out negative). Every
request made is aborted; prompts carry their own cache salt, so none hits another's blocks.

What this does not measure (transfer bandwidth and setup, the queue hop) comes from the
command line, with defaults measured on this kind of machine (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import random
import statistics
import time

from pdserve.engine.request import SamplingParams

from .profile import CostProfile, StepModel

PROMPTS = (16, 64, 128, 256, 512)
CHUNKED = (512, 2)  # a prompt of 2 x 512 tokens, in chunks of 512
DECODES = ((1, 64), (4, 64), (8, 64), (16, 64), (8, 480), (16, 240))  # (batch, context)
MIXED = ((8, 128), (4, 256))  # (decoding streams, prompt tokens)
SALT = b"pdserve-sim-profile"
_TERMS = ("fixed_ms", "decode_ms_per_seq", "prefill_ms_per_token", "attention_ms_per_kpair", "decode_ms_per_kctx")


def measure_steps(engine, repeats: int = 3, progress=None) -> list[tuple[float, int, int, int, int]]:
    """(ms, decoding streams, prompt tokens, attention pairs, decode context tokens) per shape."""
    if engine.has_work():
        raise RuntimeError("profiling needs an idle engine")
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    longest = min(engine.config.max_num_batched_tokens, engine.max_model_len - 2)
    made: list[str] = []
    out: list[tuple[float, int, int, int, int]] = []
    sched = engine.scheduler

    def add(n: int, max_tokens: int = 1):
        rid = f"sim-profile-{len(made)}"
        req = engine.add_request([rng.randrange(3, vocab) for _ in range(n)],
                                 SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                 request_id=rid)
        req.cache_salt = SALT
        made.append(rid)
        return req

    def timed() -> tuple[float, int, int, int, int]:
        context = sum(r.num_computed_tokens for r in sched.running if r.output_token_ids)
        t0 = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - t0) * 1e3
        _, tokens, decodes = engine.last_step
        return ms, decodes, tokens - decodes - engine.last_step_drafts, engine.last_step_pairs, context if decodes else 0

    def clear():
        for rid in made:
            engine.abort_request(rid)
        made.clear()

    def median_of(shape_fn):
        runs = [shape_fn() for _ in range(repeats)]
        ms = statistics.median(r[0] for r in runs)
        return (ms, *runs[0][1:])

    saved = sched.prefill_token_budget
    sched.prefill_token_budget = None
    shapes = 0
    try:
        add(16)
        engine.step()  # warm-up
        clear()
        for n in PROMPTS:
            if n <= longest:
                def one(n=n):
                    add(n)
                    got = timed()
                    clear()
                    return got
                out.append(median_of(one))
                shapes += 1
                if progress:
                    progress(f"prompt of {n} tokens: {out[-1][0]:.1f} ms")
        chunk, parts = CHUNKED
        if chunk * parts <= engine.max_model_len - 2 and chunk <= longest:
            sched.prefill_token_budget = chunk
            for _ in range(repeats):
                add(chunk * parts)
                for _ in range(parts):
                    out.append(timed())
                clear()
            sched.prefill_token_budget = None
            if progress:
                progress(f"a {chunk * parts}-token prompt in chunks of {chunk}: {out[-1][0]:.1f} ms (last chunk)")
        for batch, context in DECODES:
            if context + 8 > engine.max_model_len or batch > engine.config.max_num_seqs:
                continue
            for _ in range(batch):
                add(context, max_tokens=repeats + 8)
            while any(not r.output_token_ids for r in sched.running) or sched.waiting:
                engine.step()  # their prompts (not timed)
            for _ in range(repeats):
                out.append(timed())
            clear()
            if progress:
                progress(f"decode, {batch} streams at {context} tokens of context: {out[-1][0]:.1f} ms")
        for batch, prompt in MIXED:
            if prompt > longest or batch > engine.config.max_num_seqs:
                continue
            for _ in range(batch):
                add(32, max_tokens=repeats + 8)
            while any(not r.output_token_ids for r in sched.running) or sched.waiting:
                engine.step()
            for _ in range(repeats):
                add(prompt)
                out.append(timed())
            clear()
            if progress:
                progress(f"mixed, {batch} streams + a {prompt}-token prompt: {out[-1][0]:.1f} ms")
    finally:
        clear()
        sched.prefill_token_budget = saved
    return [s for s in out if s[1] or s[2]]


def fit_step_model(samples, kv_blocks: int) -> StepModel:
    """Least squares of step ms on (1, streams, prompt tokens, pairs / 1000, context / 1000),
    relative to each step's time (a 10 ms decode step counts as much as a 100 ms prompt), every
    coefficient >= 0: a term that comes out negative is dropped and the rest refitted."""
    import numpy as np

    x = np.array([[1.0, d, p, pairs / 1e3, ctx / 1e3] for _, d, p, pairs, ctx in samples])
    y = np.array([s[0] for s in samples])
    w = 1.0 / np.maximum(y, 1e-3)
    x, y = x * w[:, None], y * w
    active = list(range(5))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        neg = [a for a, c in zip(active, coef) if c < 0 and a != 2]
        if not neg:
            break
        active.remove(min(neg, key=lambda a: coef[active.index(a)]))
    full = [0.0] * 5
    for a, c in zip(active, coef):
        full[a] = float(c)
    full[2] = max(full[2], 1e-6)
    return StepModel(**{k: round(v, 6) for k, v in zip(_TERMS, full)}, kv_blocks=kv_blocks)


def fit_error(model: StepModel, samples) -> float:
    """Median relative error of ``model`` over the samples it was fitted to."""
    errs = [abs(model.step_ms(d, p, pairs, ctx) - ms) / ms for ms, d, p, pairs, ctx in samples if ms > 0]
    return statistics.median(errs) if errs else 0.0


def measure_profile(model_dir: str, *, name: str | None = None, engine_args: dict | None = None,
                    repeats: int = 3, transfer_setup_ms: float = 1.0, transfer_gb_per_s: float = 4.0,
                    queue_hop_ms: float = 1.0, progress=None) -> tuple[CostProfile, float]:
    """Load the engine, time the grid, fit: (profile at TP 1, the fit's median relative error)."""
    from pdserve.engine import EngineConfig, LLMEngine

    args = dict(engine_args or {})
    engine = LLMEngine(EngineConfig.from_kwargs(model_dir, **args))
    try:
        samples = measure_steps(engine, repeats, progress)
        kv_blocks = engine.kv.pool.num_blocks
        model = fit_step_model(samples, kv_blocks)
        err = fit_error(model, samples)
        cfg = engine.config
        prof = CostProfile(
            name=name or f"{model_dir} on this machine", source=f"measured: {len(samples)} steps, {time.ctime()}",
            kv_bytes_per_token=engine.connector.kv_bytes_per_token, steps={1: model}, block_size=cfg.block_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            transfer_setup_ms=transfer_setup_ms, transfer_gb_per_s=transfer_gb_per_s, queue_hop_ms=queue_hop_ms,
            noise_cv=0.0,
            assumptions=(f"engine arguments: {args or 'defaults'}",
                         f"step model fitted to {len(samples)} timed steps, median error {err:.1%}",
                         f"transfer {transfer_setup_ms:g} ms + bytes at {transfer_gb_per_s:g} GB/s, "
                         f"queue hop {queue_hop_ms:g} ms: given, not measured here"),
        )
        return prof, err
    finally:
        engine.close()
