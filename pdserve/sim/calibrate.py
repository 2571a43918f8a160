"""Calibrating a profile on a real run: what serving costs beyond the engine's own steps.

A profile measured on an idle engine (sim/measure.py) times steps alone. A serving worker also
parses requests, streams every token and (on a small host) shares its cores with that work, so
under traffic its steps run slower and every request pays a fixed cost on the way in and out;
a remote prefill also pays the queue, the notification and the decode worker's pickup; and on
a shared host the steps vary. Five numbers capture that, fitted to a real run of a calibration
trace (prompt- and decode-heavy requests together), and a sixth can be asked for:

* ``contention_ms_per_token``: CPU the host spends outside the engine per token streamed (the
  frontend's chunks; the clients' parsing, on a shared host), which slows every step in
  proportion to the tokens streamed per second: what makes a busy worker slower than a quiet
  one, at every load; each value asked for (``contention``; default none, see below) is tried
  with the four below fitted to it, and the one whose TTFT and ITL p50 / p90 come closest to
  the run's is kept. Whose streams count (a worker's own, or all of them on one shared host) is
  the profile's ``contention_scope``. Not fitted by default: on this project's 2-core box the
  calibration's loss was flat across values, two runs picked different ones, and the picked
  values predicted the validation traces worse than none (docs/PERFORMANCE.md);
* ``step_scale``: the step's fixed, per-stream and context terms take this many times longer
  while serving; fitted to the run's inter-token latencies (p50 and p90), which the terms
  below barely move; or, where the run's engine step times are known (``decode_step_ms``: the
  workers' mean decode-only step as their cost models timed it, ``pdserve_engine_step_seconds``),
  to that, and then
* ``stream_gap_ms_per_token``: what a worker does between steps per token it streams, the one of
  ``GAPS`` whose inter-token latencies (p50 and p90) come closest: the part of the tokens'
  period the engine's cost model never sees (it times the step alone), so a simulated
  router and step budget are fed what a real one is;
* ``prefill_scale`` and ``request_overhead_ms``: over the requests the simulation prefills
  locally, the measured TTFT is regressed on the simulated one, request by request
  (``measured = overhead + m x simulated``): the slope scales the prompt-token terms, the
  intercept is added to every request's TTFT (the way in and out);
* ``request_ms_per_prompt_token``: when the run has prompts behind cached prefixes (at least
  ``MIN_HITS`` of the local ones hit), the prompt's length joins that regression
  (``measured = overhead + m x simulated + k x prompt tokens``): what a prompt's tokens cost
  outside the engine whether the engine computes them or not. Without hits the prompt's length
  and its prefill move together and cannot be told apart, so it stays 0 (in the slope);
* ``remote_overhead_ms``: added to every remote prefill (as transfer setup): the median of
  measured minus simulated TTFT over the requests prefilled remotely;
* ``noise_cv``: the spread of the steps (each step scaled by a lognormal factor of this
  coefficient of variation), the one of ``NOISE_CV`` whose run comes closest to the measured
  one (TTFT and ITL p50 / p90): a shared host's steps vary, and queueing follows.

Host stalls are measured, not fitted (``host_stalls``): where a run's token times are known,
every moment when no stream got a token for far longer than a step while some stream was
decoding is the host stopping (measured on this project's box: bench/lag_probe.py); their rate
and lognormal size go into the profile (``stall_*``) before the fit, so the fit sees them.

Each refinement moves the queueing a little, so they are repeated ``REFINE`` times. The
calibrated profile then predicts other traces: bench/sim_validate.py validates it on traces it
was not fitted to.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from .cluster import Simulation
from .profile import CostProfile, StepModel
from .report import mean_step_ms, percentile

SCALES = tuple(round(0.8 + 0.05 * i, 2) for i in range(35))  # 0.8 .. 2.5
CONTENTION_MS = (0.0,)  # host CPU per token streamed, tried (`pdserve sim calibrate --contention`)
GAPS = tuple(round(0.25 * i, 2) for i in range(13))  # ms between steps per token streamed, tried: 0 .. 3
NOISE_CV = (0.0, 0.1, 0.2, 0.3, 0.4)  # step-time noise (coefficient of variation) tried
REFINE = 3
MIN_HITS = 8  # local prompts behind a cached prefix a run needs before a per-prompt-token cost is fitted
SLOPE = (0.6, 1.6)  # bounds of one refinement's prefill slope (a noisy run cannot swing it further)


def calibrated(profile: CostProfile, step_scale: float, request_overhead_ms: float, remote_overhead_ms: float = 0.0,
               note: str = "", prefill_scale: float | None = None, contention_ms_per_token: float = 0.0,
               ms_per_prompt_token: float = 0.0, gap_ms_per_token: float = 0.0) -> CostProfile:
    """``profile`` with its steps scaled (the prompt-token terms by ``prefill_scale``, default
    ``step_scale``) and the overheads set (the note kept in its assumptions)."""
    p = step_scale if prefill_scale is None else prefill_scale
    steps = {tp: StepModel(m.fixed_ms * step_scale, m.decode_ms_per_seq * step_scale,
                           m.prefill_ms_per_token * p, m.attention_ms_per_kpair * p,
                           m.decode_ms_per_kctx * step_scale, m.kv_blocks) for tp, m in profile.steps.items()}
    return replace(profile, steps=steps, request_overhead_ms=round(request_overhead_ms, 3),
                   request_ms_per_prompt_token=round(ms_per_prompt_token, 5),
                   stream_gap_ms_per_token=gap_ms_per_token,
                   contention_ms_per_token=contention_ms_per_token,
                   transfer_setup_ms=round(profile.transfer_setup_ms + remote_overhead_ms, 3),
                   assumptions=(*profile.assumptions,
                                f"calibrated on a real run ({note}): step terms x {step_scale:g} and prompt-token "
                                f"terms x {p:.3g} while serving, {request_overhead_ms:.1f} ms per request and "
                                f"{ms_per_prompt_token * 1e3:.1f} us per prompt token outside the engine, "
                                f"{remote_overhead_ms:.1f} ms more per remote prefill, {gap_ms_per_token:g} ms "
                                f"between steps per token streamed, {contention_ms_per_token:g} ms of "
                                f"{profile.contention_scope} CPU per token streamed"))


def _simulate(requests, profile, policy, topology, seed):
    return Simulation(requests, profile, policy, topology, seed=seed).run()


def _itl_loss(sim: Simulation, real_itl: list[float]) -> float:
    loss = 0.0
    for q in (50, 90):
        s, r = percentile(sim.itls_ms, q), percentile(real_itl, q)
        if s and r:
            loss += math.log(s / r) ** 2
    return loss


def _ttfts(sim: Simulation) -> list[float]:
    return [(r.first_token - r.arrival) * 1e3 for r in sim.records if r.first_token is not None]


def _loss(sim: Simulation, real_itl: list[float], real_ttft: list[float]) -> float:
    """How far a simulated run is from the measured one: squared log errors of the ITL and
    TTFT p50 / p90."""
    sim_ttft = _ttfts(sim)
    return _itl_loss(sim, real_itl) + sum(
        math.log(_floored(sim_ttft, q) / _floored(real_ttft, q)) ** 2 for q in (50, 90))


def _floored(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (never empty here), at least 1e-3."""
    p = percentile(values, q)
    if p is None:
        raise ValueError("a percentile of no values")
    return max(p, 1e-3)


def _rows(sim: Simulation, measured: dict[int, dict], route: str) -> list[tuple[float, float, int, int]]:
    """(simulated TTFT ms, measured TTFT ms, prompt tokens, cached tokens in the simulation) of
    each request the simulation routed ``route`` (and the real router too, where the run
    recorded its route: a remote prefill's TTFT says nothing of a local one's)."""
    out = []
    for r in sim.records:
        m = measured.get(r.rid)
        if m is None or m.get("ttft_ms") is None or r.first_token is None or r.route != route or r.fell_back:
            continue
        if m.get("route") and m["route"] != route:
            continue
        out.append(((r.first_token - r.arrival) * 1e3, m["ttft_ms"], r.prompt_len, r.cached_len))
    return out


def _pairs(sim: Simulation, measured: dict[int, dict], route: str) -> list[tuple[float, float]]:
    """(simulated, measured) TTFT of each request the simulation routed ``route`` (ms)."""
    return [(x, y) for x, y, _, _ in _rows(sim, measured, route)]


def _line(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of measured on simulated."""
    n = len(pairs)
    mx = sum(x for x, _ in pairs) / n
    my = sum(y for _, y in pairs) / n
    var = sum((x - mx) ** 2 for x, _ in pairs)
    slope = sum((x - mx) * (y - my) for x, y in pairs) / var if var > 0 else 1.0
    return my - slope * mx, slope


def _prompt_fit(rows: list[tuple[float, float, int, int]], per_token: float) -> tuple[float, float]:
    """(slope on the simulated TTFT, ms per prompt token) of the measured TTFTs: the slope from
    the prompts computed whole, less what their tokens cost outside the engine; that cost from
    the prompts behind a cached prefix (the median of what each exceeds the line by, per prompt
    token: robust to the few that queued), when there are ``MIN_HITS`` of them; else 0."""
    cold = [r for r in rows if r[3] == 0]
    hits = [r for r in rows if r[3] > 0]
    if len(hits) < MIN_HITS or len(cold) < 5:
        return _line([(x, y) for x, y, _, _ in rows])[1], 0.0
    for _ in range(4):
        a, slope = _line([(x, y - per_token * n) for x, y, n, _ in cold])
        per_token = max(0.0, statistics.median((y - a - slope * x) / n for x, y, n, _ in hits))
    return slope, per_token


def fit(requests, profile: CostProfile, policy, topology, measured: dict[int, dict], seed: int = 0,
        note: str = "", contention: tuple[float, ...] | None = None,
        decode_step_ms: float | None = None) -> tuple[CostProfile, dict]:
    """The calibrated profile for a real run of ``requests``; ``measured`` maps each request's
    ``rid`` to what the run measured of it: ``ttft_ms``, ``itl_ms`` (its gaps, a list) and,
    if known, ``route`` (the real router's); ``decode_step_ms``, when known, is the run's mean
    decode-only engine step. Returns it and the fit's figures. Each contention of ``CONTENTION_MS`` is tried with the rest fitted to
    it; the one whose TTFT and ITL p50 / p90 come closest wins. The figures keep each tried
    contention's own under ``by_contention`` (its fit, loss included)."""
    real_itl = [g for m in measured.values() for g in m.get("itl_ms") or ()]
    real_ttft = [m["ttft_ms"] for m in measured.values() if m.get("ttft_ms") is not None]
    if not real_itl or not real_ttft:
        raise ValueError("calibration needs measured TTFTs and inter-token gaps of the run")
    best: tuple[float, CostProfile, dict] | None = None
    tried = {}
    for stream in contention or CONTENTION_MS:
        prof, figures, sim = _fit_at(requests, profile, policy, topology, measured, real_itl, seed, note, stream,
                                     decode_step_ms)
        sim_ttft = _ttfts(sim)
        loss = _loss(sim, real_itl, real_ttft)
        tried[stream] = dict(figures, loss=round(loss, 4))
        if best is None or loss < best[0]:
            figures.update(loss=round(loss, 4),
                           ttft_p50={"simulated": _r(percentile(sim_ttft, 50)), "measured": _r(percentile(real_ttft, 50))},
                           ttft_p90={"simulated": _r(percentile(sim_ttft, 90)), "measured": _r(percentile(real_ttft, 90))},
                           itl_p50={"simulated": _r(percentile(sim.itls_ms, 50)), "measured": _r(percentile(real_itl, 50))},
                           itl_p90={"simulated": _r(percentile(sim.itls_ms, 90)), "measured": _r(percentile(real_itl, 90))})
            best = (loss, prof, figures)
    assert best is not None  # at least one contention was tried
    best[2]["by_contention"] = tried
    return best[1], best[2]


def _grid_min(grid, f, stride: int = 4):
    """The point of the sorted ``grid`` where ``f`` is least, found coarse to fine: every
    ``stride``-th point (and the last), then every point within ``stride - 1`` of the best of
    those. About a third of the runs a full sweep of SCALES takes; it finds the full sweep's
    point when ``f`` has one valley over the grid (a step scale's loss has: a scale off either
    way lengthens or shortens every step)."""
    seen: dict[int, float] = {}

    def at(i):
        if i not in seen:
            seen[i] = f(grid[i])
        return seen[i]

    coarse = sorted({*range(0, len(grid), stride), len(grid) - 1})
    best = min(coarse, key=at)
    near = range(max(0, best - stride + 1), min(len(grid), best + stride))
    return grid[min(sorted({best, *near}), key=at)]


def _fit_at(requests, profile, policy, topology, measured, real_itl, seed, note, stream, decode_step_ms=None):
    """The step scale, prefill scale and overheads for one contention (module docstring)."""
    def prof_of(scale, local=0.0, remote=0.0, pscale=None, final_note="", per_token=0.0, gap=0.0):
        return calibrated(profile, scale, local, remote, final_note, prefill_scale=pscale,
                          contention_ms_per_token=stream, ms_per_prompt_token=per_token, gap_ms_per_token=gap)

    def run(prof):
        return _simulate(requests, prof, policy, topology, seed)

    gap = 0.0
    if decode_step_ms:  # the steps as the engine timed them, then the period's rest between them
        def off(s, g):
            ms = mean_step_ms(run(prof_of(s, gap=g)))
            return abs(math.log(ms / decode_step_ms)) if ms else math.inf
        # twice: the gap changes how many streams a step batches, so the mean step moves with it
        for _ in range(2):
            scale = _grid_min(SCALES, lambda s: off(s, gap))
            gap = min(GAPS, key=lambda g: _itl_loss(run(prof_of(scale, gap=g)), real_itl))
    else:
        scale = _grid_min(SCALES, lambda s: _itl_loss(run(prof_of(s)), real_itl))
    pscale, local, remote, per_token = scale, 0.0, 0.0, 0.0
    for _ in range(REFINE):
        sim = run(prof_of(scale, local, remote, pscale, per_token=per_token, gap=gap))
        # the engine's part of each simulated TTFT: the overheads of this round taken off
        rows = [(x - local - per_token * n, y, n, c) for x, y, n, c in _rows(sim, measured, "local")]
        if len(rows) >= 5:
            slope, per_token = _prompt_fit(rows, per_token)
            slope = min(max(slope, SLOPE[0]), SLOPE[1])
            pscale *= slope
            local = max(0.0, statistics.median(y - slope * x - per_token * n for x, y, n, _ in rows))
        sim = run(prof_of(scale, local, remote, pscale, per_token=per_token, gap=gap))
        gaps = [y - x for x, y in _pairs(sim, measured, "remote")]
        if gaps:
            remote = max(0.0, remote + statistics.median(gaps))
    prof = prof_of(scale, local, remote, pscale, note, per_token, gap)
    # the steps' spread: the noise whose run comes closest to the measured one (TTFT and ITL;
    # the step plan takes whole prompts when the streams can absorb them, so the ITL tail is
    # the plan's gap bound more than the noise, and queueing shows the noise in the TTFT tail)
    real_ttft = [m["ttft_ms"] for m in measured.values() if m.get("ttft_ms") is not None]
    noise = min(NOISE_CV, key=lambda cv: _loss(
        _simulate(requests, prof.with_noise(cv), policy, topology, seed), real_itl, real_ttft))
    prof = prof.with_noise(noise)
    figures = {"step_scale": scale, "stream_gap_ms_per_token": gap, "prefill_scale": round(pscale, 3),
               "request_overhead_ms": round(local, 2), "request_ms_per_prompt_token": round(per_token, 5),
               "remote_overhead_ms": round(remote, 2), "contention_ms_per_token": stream, "noise_cv": noise}
    return prof, figures, _simulate(requests, prof, policy, topology, seed)


STALL_MIN_MS = 250.0  # a silence shorter than this may be a step (a long prompt's, ~200 ms here), not a stall
STALL_ITL_FACTOR = 4.0  # ... or shorter than this many median inter-token gaps


def host_stalls(runs: list[list[dict]]) -> dict:
    """The host's stalls as a real run's clients saw them: ``runs`` are runs of requests, each
    request with ``times`` (the perf_counter time of each streamed chunk, one clock per run). A
    stall is a silence (no stream got a chunk) longer than ``STALL_MIN_MS`` and
    ``STALL_ITL_FACTOR`` median gaps while a stream was between its first and last chunk;
    its length is the silence less one median gap. Returns the profile's ``stall_rate_per_s``
    (stalls per second of time with a stream decoding), ``stall_median_ms``, ``stall_sigma``
    (of their log lengths), and what they came from."""
    count, observed, lengths = 0, 0.0, []
    for run in runs:
        streams = [r["times"] for r in run if not r.get("refused") and len(r.get("times") or ()) >= 2]
        gaps = [b - a for t in streams for a, b in zip(t, t[1:])]
        if not gaps:
            continue
        itl = statistics.median(gaps)
        limit = max(STALL_MIN_MS / 1e3, STALL_ITL_FACTOR * itl)
        spans = sorted((t[0], t[-1]) for t in streams)
        merged: list[list[float]] = []
        for a, b in spans:  # time with a stream decoding: the union of the spans
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        observed += sum(b - a for a, b in merged)
        ticks = sorted(x for t in streams for x in t)
        for a, b in zip(ticks, ticks[1:]):
            if b - a > limit and any(s <= a and e >= b for s, e in merged):
                count += 1
                lengths.append((b - a - itl) * 1e3)
    if not count or observed <= 0:
        return {"stall_rate_per_s": 0.0, "stall_median_ms": 0.0, "stall_sigma": 0.0, "stalls": 0,
                "decoding_s": round(observed, 1)}
    logs = [math.log(x) for x in lengths]
    return {"stall_rate_per_s": round(count / observed, 4), "stall_median_ms": round(statistics.median(lengths), 1),
            "stall_sigma": round(statistics.pstdev(logs), 3) if len(logs) > 1 else 0.0, "stalls": count,
            "decoding_s": round(observed, 1), "longest_ms": round(max(lengths), 1)}


def _r(x):
    return None if x is None else round(x, 2)
