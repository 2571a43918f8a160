"""`pdserve sim`: simulate an XpYd cluster with the product's own router, QoS, scheduler, queue
and planner on a simulated clock (sim/, docs/simulator.md).

    pdserve sim profile --model DIR --out cpu.yaml          measure a worker here (real engine)
    pdserve sim profile --roofline llama-3-70b --gpu h100 --out h100.yaml   from datasheet numbers
    pdserve sim calibrate --profile cpu.yaml --trace t.jsonl --measured m.jsonl --out cpu-served.yaml
    pdserve sim run --profile cpu.yaml --topology 1P1D --mix long-prompt --rate 2.5 --requests 200
    pdserve sim run --profile h100.yaml --topology 2P6D --prefill-tp 4 --decode-tp 4 --trace trace.jsonl
    pdserve sim search --profile h100.yaml --budget 16 --tp 4,8 --mix chat --rate 36 --requests 1500

Goodput counts the completed requests that met ``--slo-ttft`` and ``--slo-tpot`` per second,
as `vllm bench serve --goodput` does. ``--json FILE`` writes every figure; ``--explain``
prints the router's reasons and the planner's decisions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time

import yaml

TOPOLOGY = re.compile(r"^(\d+)P(\d+)D$", re.I)


def register(subparsers) -> None:
    sim = subparsers.add_parser("sim", help="simulate a cluster (XpYd, TP, router, planner) on cost profiles",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = sim.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    sim.set_defaults(func=lambda args: (sim.print_help(), 2)[1])

    prof = sub.add_parser("profile", help="measure a cost profile with the real engine, or derive one "
                          "from published GPU numbers", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    prof.add_argument("--model", help="model directory to measure (the real engine runs here)")
    prof.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                      help="an engine argument of the workers to profile (repeatable), e.g. num_threads=1")
    prof.add_argument("--repeats", type=int, default=3, help="times each step shape is timed (median kept)")
    prof.add_argument("--transfer-gb-per-s", type=float, default=4.0,
                      help="KV transfer bandwidth between workers (default 4: NIXL on this host, "
                      "docs/PERFORMANCE.md)")
    prof.add_argument("--transfer-setup-ms", type=float, default=1.0, help="per-transfer setup (default 1)")
    prof.add_argument("--queue-hop-ms", type=float, default=1.0, help="one prefill-queue call (default 1)")
    prof.add_argument("--roofline", metavar="MODEL", help="derive from a model's shape instead: "
                      "llama-3-70b | llama-3-8b | llama-3.2-1b")
    prof.add_argument("--gpu", default="h100", help="with --roofline: h100 | h200 (default h100)")
    prof.add_argument("--tp", default="1,2,4,8", help="with --roofline: tensor-parallel sizes (default 1,2,4,8)")
    prof.add_argument("--name", help="the profile's name")
    prof.add_argument("--out", help="write the profile here (.yaml or .json); default: print it")
    prof.set_defaults(func=run_profile)

    cal = sub.add_parser("calibrate", help="fit a profile's serving costs to a real run of a trace",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cal.add_argument("--profile", required=True, help="the profile to calibrate (measured on an idle engine)")
    cal.add_argument("--trace", required=True, help="the trace the real run replayed (JSON lines, with rid)")
    cal.add_argument("--measured", required=True, help="what the run measured, JSON lines: rid, ttft_ms, itl_ms "
                     "(the gaps between its tokens), optionally route (local or remote: the real router's); "
                     "bench/sim_validate.py writes them")
    cal.add_argument("--topology", default="0P1D", help="the real cluster's XpYd (default 0P1D)")
    cal.add_argument("--prefill-tp", type=int, default=1)
    cal.add_argument("--decode-tp", type=int, default=1)
    cal.add_argument("--ingress", default="round_robin", choices=("round_robin", "random", "gateway"))
    cal.add_argument("--policy", help="the real cluster's router policy file (default: the built-in default)")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--contention", default="0", metavar="MS,MS,...",
                     help="host CPU ms per token streamed to try (the closest fit kept; docs/simulator.md); "
                     "default 0: not fitted")
    cal.add_argument("--shared-host", action="store_true",
                     help="every worker of the real run (and its clients) shared one host's cores: the streams "
                     "of all of them slow every step (contention_scope: cluster); default: each worker's own")
    cal.add_argument("--decode-step-ms", type=float, metavar="MS",
                     help="the run's mean decode-only engine step, as the workers timed it (their "
                     "pdserve_engine_step_seconds{kind=\"decode\"} sum / count over the run): the steps are fitted to "
                     "it and the rest of the tokens' period to what the workers do between steps "
                     "(stream_gap_ms_per_token); default: unknown, the steps fitted to the inter-token gaps")
    cal.add_argument("--out", required=True, help="write the calibrated profile here")
    cal.set_defaults(func=run_calibrate)

    run = sub.add_parser("run", help="simulate one cluster on one traffic", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(run)
    run.add_argument("--topology", default="1P1D", help="XpYd: prefill and decode workers (default 1P1D; "
                     "0P1D is one colocated worker)")
    run.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of each prefill worker")
    run.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of each decode worker")
    run.add_argument("--ingress", default="round_robin", choices=("round_robin", "random", "gateway"),
                     help="how requests reach the decode workers (gateway: gateway/pick.py by predicted TTFT)")
    run.add_argument("--mode", choices=("conditional", "always_remote", "always_local"),
                     help="override the router policy's mode")
    run.add_argument("--autoscale", metavar="FILE", help="an autoscale policy: the planner runs every interval_s")
    run.add_argument("--start-s", type=float, default=30.0, help="with --autoscale: seconds a new worker takes to "
                     "serve (default 30)")
    run.add_argument("--explain", action="store_true", help="print the router's reasons and planner decisions")
    run.set_defaults(func=run_sim)

    se = sub.add_parser("search", help="the best XpYd, TP sizes and router mode under a device budget",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(se)
    se.add_argument("--budget", type=int, required=True, help="devices (GPUs, or CPU workers) to spend")
    se.add_argument("--tp", default="1", help="tensor-parallel sizes to try, comma-separated (default 1)")
    se.add_argument("--modes", default="conditional,always_remote",
                    help="router modes for disaggregated candidates (default conditional,always_remote)")
    se.add_argument("--vary", action="append", default=[], metavar="PATH=V1,V2",
                    help="a router policy setting to sweep, by its path in the policy file; repeat for more (every "
                    "combination is tried), e.g. --vary router.cost_model.min_gain_ms=0,20 "
                    "--vary qos.enable_early_rejection=true,false")
    se.add_argument("--ingress", default="round_robin", choices=("round_robin", "random", "gateway"))
    se.add_argument("--max-workers", type=int, default=64, help="at most this many workers per role")
    se.add_argument("--top", type=int, default=10, help="rows printed (default 10)")
    se.set_defaults(func=run_search)


def _common(p) -> None:
    p.add_argument("--profile", required=True, help="a cost profile (.yaml/.json from `pdserve sim profile`)")
    p.add_argument("--prefill-profile", help="another profile for the prefill workers (other hardware)")
    p.add_argument("--policy", help="a router policy file (default: the built-in default policy)")
    p.add_argument("--trace", help="a JSON-lines trace (t, prompt_len, output_len, ...) instead of a mix")
    p.add_argument("--mix", default="long-prompt", help="synthetic mix: long-prompt | decode-heavy | prefix (CPU-sized), rag | chat "
                   "(GPU-sized; sim/workload.py MIXES)")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second of the mix (default 1)")
    p.add_argument("--requests", type=int, default=200, help="requests of the mix (default 200)")
    p.add_argument("--arrival", default="poisson", choices=("poisson", "gamma"), help="arrival process")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma: coefficient of variation of the gaps")
    p.add_argument("--slo-ttft", type=float, default=1500.0, help="goodput's TTFT SLO, ms (default 1500)")
    p.add_argument("--slo-tpot", type=float, default=50.0, help="goodput's TPOT SLO, ms (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic and of every random draw")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")


def _workload(args):
    from pdserve.sim.workload import WorkloadSpec, generate, load_trace, mix

    if args.trace:
        return load_trace(args.trace), f"trace {args.trace}"
    spec = mix(args.mix, args.rate, args.requests)
    spec = WorkloadSpec(**{**spec.__dict__, "arrival": args.arrival, "burstiness_cv": args.burstiness})
    return generate(spec, args.seed), f"mix {args.mix} at {args.rate:g} req/s, {args.requests} requests"


def _profiles(args):
    from pdserve.sim.profile import load_profile

    prof = load_profile(args.profile)
    return prof, load_profile(args.prefill_profile) if args.prefill_profile else None


def _policy(args):
    from pdserve.router import DEFAULT_POLICY, load_policy_file

    return load_policy_file(args.policy) if args.policy else DEFAULT_POLICY


def _topology(text: str, args):
    from pdserve.sim.cluster import SimTopology

    m = TOPOLOGY.match(text.strip())
    if not m:
        raise ValueError(f"--topology {text!r}: write XpYd, e.g. 1P1D or 2P6D (0P1D: colocated)")
    return SimTopology(int(m.group(1)), int(m.group(2)), args.prefill_tp, args.decode_tp, args.ingress)


def run_profile(args) -> int:
    from pdserve.sim import measure
    from pdserve.sim.profile import GPUS, MODELS, roofline

    if bool(args.model) == bool(args.roofline):
        raise ValueError("give --model DIR (measure here) or --roofline MODEL (published numbers), one of them")
    if args.roofline:
        if args.roofline not in MODELS:
            raise ValueError(f"--roofline {args.roofline!r}: known models are {', '.join(MODELS)}")
        if args.gpu not in GPUS:
            raise ValueError(f"--gpu {args.gpu!r}: known GPUs are {', '.join(GPUS)}")
        prof = roofline(MODELS[args.roofline], GPUS[args.gpu], tuple(_ints(args.tp, "--tp")))
        print("assumptions (printed into the profile too):")
        for a in prof.assumptions:
            print(f"  - {a}")
    else:
        engine_args = {}
        for item in args.engine_arg:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--engine-arg {item!r}: write KEY=VALUE")
            engine_args[key] = yaml.safe_load(value)
        print(f"profiling {args.model} with the real engine ({engine_args or 'default arguments'}) ...", flush=True)
        t0 = time.perf_counter()
        prof, err = measure.measure_profile(
            args.model, name=args.name, engine_args=engine_args, repeats=args.repeats,
            transfer_setup_ms=args.transfer_setup_ms, transfer_gb_per_s=args.transfer_gb_per_s,
            queue_hop_ms=args.queue_hop_ms, progress=lambda line: print(f"  {line}", flush=True))
        print(f"fitted in {time.perf_counter() - t0:.1f} s; median error of the fit {err:.1%}")
    if args.name:
        prof = type(prof)(**{**prof.__dict__, "name": args.name})
    for tp, m in sorted(prof.steps.items()):
        print(f"TP {tp}: step = {m.fixed_ms:g} ms + {m.decode_ms_per_seq:g} ms/stream + {m.prefill_ms_per_token:g} "
              f"ms/prompt token + {m.attention_ms_per_kpair:g} ms/k attention pairs + {m.decode_ms_per_kctx:g} "
              f"ms/k context tokens; {m.kv_blocks} KV blocks")
    if args.out:
        prof.save(args.out)
        print(f"wrote {args.out}")
    else:
        print(yaml.safe_dump(prof.to_dict(), sort_keys=False))
    return 0


def run_calibrate(args) -> int:
    from pdserve.sim.calibrate import fit
    from pdserve.sim.cluster import check_profile
    from pdserve.sim.workload import load_trace

    prof = _profiles(argparse.Namespace(profile=args.profile, prefill_profile=None))[0]
    if args.shared_host:
        prof = dataclasses.replace(prof, contention_scope="cluster")
    topo = _topology(args.topology, args)
    check_profile(prof, topo)
    requests = load_trace(args.trace)
    measured = {}
    with open(args.measured) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                body = json.loads(line)
                measured[int(body["rid"])] = {"ttft_ms": float(body["ttft_ms"]),
                                              "itl_ms": [float(x) for x in body.get("itl_ms") or ()],
                                              "route": body.get("route")}
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{args.measured}:{n}: a line is {{\"rid\": N, \"ttft_ms\": MS, \"itl_ms\": [MS, "
                                 f"...]}} ({exc.__class__.__name__}: {exc})") from None
    known = {r.rid for r in requests}
    unknown = sorted(set(measured) - known)
    if unknown:
        raise ValueError(f"{args.measured}: rid {unknown[0]} is not in {args.trace}")
    print(f"calibrating {prof.name} on {len(measured)} measured requests of {len(requests)} ({topo.label}) ...",
          flush=True)
    try:
        grid = tuple(float(x) for x in args.contention.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--contention {args.contention!r}: comma-separated ms per token, e.g. 0,0.5,1") from None
    if not grid or min(grid) < 0:
        raise ValueError(f"--contention {args.contention!r}: values must be >= 0")
    if args.decode_step_ms is not None and not args.decode_step_ms > 0:
        raise ValueError(f"--decode-step-ms {args.decode_step_ms}: a step's mean in ms, > 0")
    cal, figures = fit(requests, prof, _policy(args), topo, measured, args.seed, note=f"{args.measured}",
                       contention=grid, decode_step_ms=args.decode_step_ms)
    tried = figures.pop("by_contention", {})
    for k, v in figures.items():
        print(f"  {k}: {v}")
    if len(tried) > 1:
        print("  each contention tried (ms per token streamed: loss, step scale):")
        for c, f in tried.items():
            print(f"    {c:g}: loss {f['loss']}, step scale {f['step_scale']}")
    cal.save(args.out)
    print(f"wrote {args.out}")
    return 0


def run_sim(args) -> int:
    from pdserve.sim.cluster import Simulation, check_profile
    from pdserve.sim.report import Slo, summarize
    from pdserve.sim.search import with_mode

    prof, pprof = _profiles(args)
    topo = _topology(args.topology, args)
    check_profile(prof, topo)
    policy = _policy(args)
    if args.mode:
        policy = with_mode(policy, args.mode)
    requests, what = _workload(args)
    scaler = None
    if args.autoscale:
        from pdserve.cluster.planner.policy import load_autoscale_file
        from pdserve.sim.autoscale import Autoscaler

        scaler = Autoscaler(load_autoscale_file(args.autoscale).autoscale, start_s=args.start_s)
    print(f"simulating {topo.label} ({prof.name}), {what}, router {policy.router.mode}/{policy.router.policy}",
          flush=True)
    t0 = time.perf_counter()
    sim = Simulation(requests, prof, policy, topo, seed=args.seed, prefill_profile=pprof, autoscale=scaler).run()
    wall = time.perf_counter() - t0
    s = summarize(sim, Slo(args.slo_ttft, args.slo_tpot))
    s["wall_s"] = round(wall, 2)
    _print_summary(s, args)
    if args.explain:
        print("router reasons:", ", ".join(f"{k} {v}" for k, v in sorted(s["reasons"].items())) or "none")
        from pdserve.router.cli import costs_line
        from pdserve.sim.report import percentile

        for d in sim.decode:  # what each decode worker's router decided with at the end (as `pdserve router explain`)
            print(f"{d.wid} costs at the end: {costs_line(d.state.costs.snapshot())}")
        for route in sorted({r.route for r in sim.records if r.route}):
            got = [((r.first_token - r.arrival) * 1e3, r.predicted_ttft_ms) for r in sim.records
                   if r.route == route and r.first_token is not None and r.predicted_ttft_ms is not None]
            if got:
                sim_ms, pred_ms = percentile([x for x, _ in got], 50), percentile([y for _, y in got], 50)
                print(f"route {route}: {len(got)} requests, TTFT p50 {sim_ms:.1f} ms, the router predicted "
                      f"p50 {pred_ms:.1f} ms")
        if scaler is not None:
            acts = [a for a in scaler.decisions if a["action"] != "hold"]
            print(f"planner: {len(acts)} action(s); holds are in --json")
            for a in acts:
                print(f"  t={a['t']:>8.1f} s {a['role']}: {a['action']} {a['current']} -> {a['desired']} "
                      f"({a['reason']}): {a['explanation']}")
    if scaler is not None:
        s["planner"] = {"decisions": scaler.decisions, "timeline": scaler.timeline}
    s["samples"] = sim.samples
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _print_summary(s: dict, args) -> None:
    def p(d):
        return f"p50 {d['p50']} / p90 {d['p90']} / p99 {d['p99']}"
    print(f"{s['completed']}/{s['requests']} completed"
          + (f", refused {s['refused']}" if s["refused"] else "")
          + f" in {s['duration_s']} s simulated ({s['events']} events, {s.get('wall_s', 0)} s wall)")
    print(f"goodput {s['goodput_req_s']} req/s at TTFT <= {args.slo_ttft:g} ms and TPOT <= {args.slo_tpot:g} ms "
          f"({s['good']} good); throughput {s['throughput_req_s']} req/s, {s['output_tokens_s']} output tokens/s")
    print(f"TTFT ms {p(s['ttft_ms'])}; TPOT ms {p(s['tpot_ms'])}; ITL ms {p(s['itl_ms'])}")
    print(f"routes {s['routes']}; utilisation decode {s['utilization']['decode']}, "
          f"prefill {s['utilization']['prefill']}; queue depth max {s['queue_depth']['max']}; "
          f"router's TTFT prediction error (median) {s['prediction_error_median']}")


def run_search(args) -> int:
    from pdserve.sim.report import Slo, table
    from pdserve.sim.search import candidates, search

    prof, _ = _profiles(args)
    requests, what = _workload(args)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in ("conditional", "always_remote", "always_local")]
    if bad:
        raise ValueError(f"--modes: {bad[0]!r} is not a router mode (conditional, always_remote, always_local)")
    from pdserve.sim.search import variations

    grid = variations(args.vary)
    cands = candidates(args.budget, tuple(_ints(args.tp, "--tp")), modes, args.ingress, args.max_workers, prof, grid)
    if not cands:
        raise ValueError(f"no candidate fits --budget {args.budget} with --tp {args.tp} and the profile's sizes "
                         f"{sorted(prof.steps)}")
    print(f"searching {len(cands)} candidates on {args.budget} devices ({prof.name}), {what}", flush=True)
    rows = search(requests, prof, _policy(args), cands, Slo(args.slo_ttft, args.slo_tpot), args.seed,
                  progress=lambda line: print(f"  {line}", flush=True))
    print(table(rows[:args.top], [("candidate", "candidate"), ("devices", "devices"), ("goodput req/s", "goodput_req_s"),
                                  ("vs best", "margin.goodput_vs_best"), ("TTFT p50", "ttft_ms.p50"),
                                  ("TTFT p99", "ttft_ms.p99"), ("p99 / SLO", "margin.ttft_p99_vs_slo"),
                                  ("TPOT p99", "tpot_ms.p99"), ("refused", "refused")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: comma-separated integers, e.g. 1,2,4") from None
    if not out or min(out) < 1:
        raise ValueError(f"{flag} {text!r}: sizes must be >= 1")
    return out

