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
  below barely move;
* ``prefill_scale`` and ``request_overhead_ms``: over the requests the simulation prefills
  locally, the measured TTFT is regressed on the simulated one, request by request
  (``measured = overhead + m x simulated``): the slope scales the prompt-token terms, the
  intercept is added to every request's TTFT (the way in and out);
* ``remote_overhead_ms``: added to every remote prefill (as transfer setup): the median of
  measured minus simulated TTFT over the requests prefilled remotely;
* ``noise_cv``: the spread of the steps (each step scaled by a lognormal factor of this
  coefficient of variation), the one of ``NOISE_CV`` whose ITL p99 comes closest to the run's:
  a shared host's steps vary, and the tails of TTFT and ITL follow.

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
from .report import percentile

SCALES = tuple(round(0.8 + 0.05 * i, 2) for i in range(35))  # 0.8 .. 2.5
CONTENTION_MS = (0.0,)  # host CPU per token streamed, tried (`pdserve sim calibrate --contention`)
NOISE_CV = (0.0, 0.1, 0.2, 0.3, 0.4)  # step-time noise (coefficient of variation) tried, on the ITL p99
REFINE = 3
SLOPE = (0.6, 1.6)  # bounds of one refinement's prefill slope (a noisy run cannot swing it further)


def calibrated(profile: CostProfile, step_scale: float, request_overhead_ms: float, remote_overhead_ms: float = 0.0,
               note: str = "", prefill_scale: float | None = None, contention_ms_per_token: float = 0.0) -> CostProfile:
    """``profile`` with its steps scaled (the prompt-token terms by ``prefill_scale``, default
    ``step_scale``) and the overheads set (the note kept in its assumptions)."""
    p = step_scale if prefill_scale is None else prefill_scale
    steps = {tp: StepModel(m.fixed_ms * step_scale, m.decode_ms_per_seq * step_scale,
                           m.prefill_ms_per_token * p, m.attention_ms_per_kpair * p,
                           m.decode_ms_per_kctx * step_scale, m.kv_blocks) for tp, m in profile.steps.items()}
    return replace(profile, steps=steps, request_overhead_ms=round(request_overhead_ms, 3),
                   contention_ms_per_token=contention_ms_per_token,
                   transfer_setup_ms=round(profile.transfer_setup_ms + remote_overhead_ms, 3),
                   assumptions=(*profile.assumptions,
                                f"calibrated on a real run ({note}): step terms x {step_scale:g} and prompt-token "
                                f"terms x {p:.3g} while serving, {request_overhead_ms:.1f} ms per request outside "
                                f"the engine, {remote_overhead_ms:.1f} ms more per remote prefill, {contention_ms_per_token:g} ms of "
                                f"{profile.contention_scope} CPU per token streamed"))


def _simulate(requests, profile, policy, topology, seed):
    return Simulation(requests, profile, policy, topology, seed=seed).run()


def _itl_loss(sim, real_itl: list[float]) -> float:
    loss = 0.0
    for q in (50, 90):
        s, r = percentile(sim.itls_ms, q), percentile(real_itl, q)
        if s and r:
            loss += math.log(s / r) ** 2
    return loss


def _pairs(sim, measured: dict[int, dict], route: str) -> list[tuple[float, float]]:
    """(simulated, measured) TTFT of each request the simulation routed ``route`` (ms)."""
    out = []
    for r in sim.records:
        m = measured.get(r.rid)
        if m is None or m.get("ttft_ms") is None or r.first_token is None or r.route != route or r.fell_back:
            continue
        out.append(((r.first_token - r.arrival) * 1e3, m["ttft_ms"]))
    return out


def _line(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of measured on simulated."""
    n = len(pairs)
    mx = sum(x for x, _ in pairs) / n
    my = sum(y for _, y in pairs) / n
    var = sum((x - mx) ** 2 for x, _ in pairs)
    slope = sum((x - mx) * (y - my) for x, y in pairs) / var if var > 0 else 1.0
    return my - slope * mx, slope


def fit(requests, profile: CostProfile, policy, topology, measured: dict[int, dict], seed: int = 0,
        note: str = "", contention: tuple[float, ...] | None = None) -> tuple[CostProfile, dict]:
    """The calibrated profile for a real run of ``requests``; ``measured`` maps each request's
    ``rid`` to what the run measured of it: ``ttft_ms`` and ``itl_ms`` (its gaps, a list).
    Returns it and the fit's figures. Each contention of ``CONTENTION_MS`` is tried with the
    rest fitted to it; the one whose TTFT and ITL p50 / p90 come closest wins."""
    real_itl = [g for m in measured.values() for g in m.get("itl_ms") or ()]
    real_ttft = [m["ttft_ms"] for m in measured.values() if m.get("ttft_ms") is not None]
    if not real_itl or not real_ttft:
        raise ValueError("calibration needs measured TTFTs and inter-token gaps of the run")
    best = None
    for stream in contention or CONTENTION_MS:
        prof, figures, sim = _fit_at(requests, profile, policy, topology, measured, real_itl, seed, note, stream)
        sim_ttft = [(r.first_token - r.arrival) * 1e3 for r in sim.records if r.first_token is not None]
        loss = _itl_loss(sim, real_itl) + sum(
            math.log(max(percentile(sim_ttft, q), 1e-3) / max(percentile(real_ttft, q), 1e-3)) ** 2 for q in (50, 90))
        if best is None or loss < best[0]:
            figures.update(loss=round(loss, 4),
                           ttft_p50={"simulated": _r(percentile(sim_ttft, 50)), "measured": _r(percentile(real_ttft, 50))},
                           ttft_p90={"simulated": _r(percentile(sim_ttft, 90)), "measured": _r(percentile(real_ttft, 90))},
                           itl_p50={"simulated": _r(percentile(sim.itls_ms, 50)), "measured": _r(percentile(real_itl, 50))},
                           itl_p90={"simulated": _r(percentile(sim.itls_ms, 90)), "measured": _r(percentile(real_itl, 90))})
            best = (loss, prof, figures)
    return best[1], best[2]


def _fit_at(requests, profile, policy, topology, measured, real_itl, seed, note, stream):
    """The step scale, prefill scale and overheads for one contention (module docstring)."""
    def prof_of(scale, local=0.0, remote=0.0, pscale=None, final_note=""):
        return calibrated(profile, scale, local, remote, final_note, prefill_scale=pscale,
                          contention_ms_per_token=stream)

    scale = min(SCALES, key=lambda s: _itl_loss(_simulate(requests, prof_of(s), policy, topology, seed), real_itl))
    pscale, local, remote = scale, 0.0, 0.0
    for _ in range(REFINE):
        sim = _simulate(requests, prof_of(scale, local, remote, pscale), policy, topology, seed)
        pairs = [(x - local, y) for x, y in _pairs(sim, measured, "local")]
        if len(pairs) >= 5:
            _, slope = _line(pairs)
            slope = min(max(slope, SLOPE[0]), SLOPE[1])
            pscale *= slope
            local = max(0.0, statistics.median(y - slope * x for x, y in pairs))
        sim = _simulate(requests, prof_of(scale, local, remote, pscale), policy, topology, seed)
        gaps = [y - x for x, y in _pairs(sim, measured, "remote")]
        if gaps:
            remote = max(0.0, remote + statistics.median(gaps))
    prof = prof_of(scale, local, remote, pscale, note)
    # the steps' spread: the noise whose ITL p99 comes closest to the run's (it barely moves the means)
    real_p99 = percentile(real_itl, 99)
    noise = min(NOISE_CV, key=lambda cv: abs(math.log(
        max(percentile(_simulate(requests, prof.with_noise(cv), policy, topology, seed).itls_ms, 99), 1e-3) / real_p99)))
    prof = prof.with_noise(noise)
    figures = {"step_scale": scale, "prefill_scale": round(pscale, 3), "request_overhead_ms": round(local, 2),
               "remote_overhead_ms": round(remote, 2), "contention_ms_per_token": stream, "noise_cv": noise}
    return prof, figures, _simulate(requests, prof, policy, topology, seed)


def _r(x):
    return None if x is None else round(x, 2)
