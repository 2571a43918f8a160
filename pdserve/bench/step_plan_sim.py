"""The step plan's variants side by side in the simulator: no machine noise, many repetitions.

    python bench/step_plan_sim.py --model .cache/models/pdserve-llama-0992c9fa   # measure, then run
    python bench/step_plan_sim.py --profile cpu.yaml --rate 4 --reps 100 --variants plan,whole,no-hold

A served run on the 2-core box moves a 40-request TTFT p99 by +-20 % between runs minutes
apart (docs/PERFORMANCE.md), more than most changes to the step plan do. This bench runs the
plan's variants on the simulator instead (sim/, docs/simulator.md): one colocated worker whose
scheduler, step plan and cost model are the product's own code, on a simulated clock whose
step costs come from a profile measured here (``--model``, as `pdserve sim profile` measures
it) with lognormal noise (``--noise-cv``). Each repetition replays the peer bench's
``long-mix`` (bench/peer_serve.py: prompts of 51-971 tokens, 3-64 output tokens, Poisson
arrivals; 40 requests), every variant on the same arrivals, so the variants compare
repetition by repetition.

Variants (``VARIANTS``), each a setting of the product's own code for the run:

* ``plan``: the step plan as shipped (engine/step_budget.py, engine/scheduler.py);
* ``whole``: vLLM's schedule: every step takes whole prompts, first come first served, up to
  ``max_num_batched_tokens`` (the peer's chunked prefill at the peer bench's 2048), no plan;
* ``hold-all``: any stream behind its TPOT target holds the prompts to steps of the target
  (``PDSERVE_STEP_PLAN_BEHIND=all``);
* ``no-hold``: no stream behind its target holds them, not even one about to end;
* ``no-tail``: a prefill chunk leaves a small tail of its prompt for a step of its own
  (``scheduler.TAIL_SHARE`` off);
* ``share``: a running prefill leaves half of the plan's tokens to the prompts waiting
  behind it (``scheduler.SHARE_UNDER_PLAN``), as under a fixed budget.
* ``target-0.9``, ``target-1.0``: the plan aiming at 0.9 or the whole of each SLO instead of
  ``step_budget.FRACTION`` (0.8) of it.

Printed per variant: the median over the repetitions of TTFT p99, ITL p99 and TPOT p99 (the
quartiles beside the first two), the mean TTFT, and the requests out of ``--slo-ttft`` /
``--slo-tpot`` of all repetitions. Figures are the simulator's: the served runs decide, this
ranks what is worth serving.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]  # the checkout (bench/ is pdserve/bench, linked from the top)
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from pdserve.engine import scheduler, step_budget  # noqa: E402

VARIANTS = ("plan", "whole", "hold-all", "no-hold", "no-tail", "share", "target-0.9", "target-1.0")
REQUESTS = 40  # per repetition, as the peer bench's runs
PROMPT, OUTPUT = (51, 971), (3, 64)  # long-mix (bench/peer_serve.py DATASETS)


def _whole_prompts(cost, targets, decoding, prompts, max_tokens, period_ms=None) -> step_budget.Budget:
    """vLLM's schedule in place of the plan: whole prompts up to the step's token limit."""
    return step_budget.Budget(max_tokens, "whole prompts (vLLM's schedule)", 0, 0, "idle")


@contextlib.contextmanager
def variant(name: str):
    """The product's code set as ``name`` asks for the duration of the block."""
    settings = {
        "plan": [],
        "whole": [(scheduler, "plan_budget", _whole_prompts)],
        "hold-all": [(step_budget, "HOLD_ALL_BEHIND", True)],
        "no-hold": [(step_budget, "ENDING_TOKENS", 0), (step_budget, "HOLD_ALL_BEHIND", False)],
        "no-tail": [(scheduler, "TAIL_SHARE", 1 << 30)],
        "share": [(scheduler, "SHARE_UNDER_PLAN", True)],
        "target-0.9": [(step_budget, "FRACTION", 0.9)],
        "target-1.0": [(step_budget, "FRACTION", 1.0)],
    }[name]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in settings]
    try:
        for mod, attr, value in settings:
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)


def workload(rate: float, rep: int):
    """One repetition's long-mix requests (seeded by rate and repetition)."""
    from pdserve.sim.workload import SimRequest

    rng, t, out = random.Random(round(1000 * rate) + rep), 0.0, []
    for i in range(REQUESTS):
        t += rng.expovariate(rate)
        out.append(SimRequest(rid=i, t=t, prompt_len=rng.randint(*PROMPT), output_len=rng.randint(*OUTPUT)))
    return out


def run_variant(name: str, profile, rate: float, reps: int, slo: tuple[float, float]) -> dict:
    """The figures of ``reps`` repetitions of one variant."""
    from pdserve.router import DEFAULT_POLICY
    from pdserve.sim.cluster import Simulation, SimTopology
    from pdserve.sim.search import with_mode

    policy = with_mode(DEFAULT_POLICY, "always_local")
    runs = []
    with variant(name):
        for rep in range(reps):
            sim = Simulation(workload(rate, rep), profile, policy, SimTopology(0, 1, 1, 1, "round_robin"),
                             seed=rep).run()
            done = [r for r in sim.records if r.finished is not None]
            ttft = [(r.first_token - r.arrival) * 1e3 for r in done]
            tpot = [(r.finished - r.first_token) * 1e3 / (r.tokens - 1) if r.tokens > 1 else 0.0 for r in done]
            missed = REQUESTS - len(done) + sum(a > slo[0] or b > slo[1] for a, b in zip(ttft, tpot))
            runs.append({"ttft_p99": float(np.percentile(ttft, 99)), "ttft_mean": statistics.fmean(ttft),
                         "itl_p99": float(np.percentile(sim.itls_ms, 99)),
                         "tpot_p99": float(np.percentile(tpot, 99)), "missed": missed})
    return {"runs": runs, **{f"{k}_median": statistics.median(r[k] for r in runs)
                             for k in ("ttft_p99", "ttft_mean", "itl_p99", "tpot_p99")},
            "missed": sum(r["missed"] for r in runs), "requests": REQUESTS * reps}


def _quartiles(runs: list[dict], key: str) -> str:
    v = [r[key] for r in runs]
    return f"{statistics.median(v):.0f} [{np.percentile(v, 25):.0f}-{np.percentile(v, 75):.0f}]"


def table(results: dict[str, dict]) -> str:
    rows = ["| variant | TTFT p99 ms [quartiles] | ITL p99 ms [quartiles] | TPOT p99 ms | TTFT mean ms | "
            "out of SLO |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        rows.append(f"| {name} | {_quartiles(r['runs'], 'ttft_p99')} | {_quartiles(r['runs'], 'itl_p99')} | "
                    f"{r['tpot_p99_median']:.1f} | {r['ttft_mean_median']:.0f} | {r['missed']}/{r['requests']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a cost profile from `pdserve sim profile`")
    src.add_argument("--model", help="measure the profile here first, with the real engine (a model directory)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (default 4)")
    p.add_argument("--reps", type=int, default=100, help="repetitions of 40 requests per variant (default 100)")
    p.add_argument("--noise-cv", type=float, default=0.15,
                   help="lognormal noise on every simulated step, coefficient of variation (default 0.15)")
    p.add_argument("--slo-ttft", type=float, default=1500.0, help="ms (default 1500, the peer bench's)")
    p.add_argument("--slo-tpot", type=float, default=50.0, help="ms (default 50)")
    p.add_argument("--output", help="write every repetition's figures as JSON")
    args = p.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := sorted(set(names) - set(VARIANTS)):
        p.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    if args.reps < 1 or args.rate <= 0 or args.noise_cv < 0:
        p.error("--reps must be >= 1, --rate > 0 and --noise-cv >= 0")
    from pdserve.sim.profile import load_profile

    if args.model:
        from pdserve.bench.peer_serve import ENGINE
        from pdserve.sim import measure

        print(f"measuring the step costs of {args.model} with the peer bench's engine limits ...", flush=True)
        profile, err = measure.measure_profile(args.model, engine_args={**ENGINE, "kv_cache_memory_bytes": 1 << 30})
        print(f"median error of the fit {err:.1%}")
    else:
        profile = load_profile(args.profile)
    if args.noise_cv:
        profile = profile.with_noise(args.noise_cv)
    results = {}
    for name in names:
        results[name] = run_variant(name, profile, args.rate, args.reps, (args.slo_ttft, args.slo_tpot))
        print(f"{name}: TTFT p99 {_quartiles(results[name]['runs'], 'ttft_p99')} ms", flush=True)
    print(f"\nlong-mix at {args.rate:g} req/s, {args.reps} repetitions of {REQUESTS} requests, "
          f"step noise cv {args.noise_cv:g}, SLOs TTFT {args.slo_ttft:g} / TPOT {args.slo_tpot:g} ms\n")
    print(table(results))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
