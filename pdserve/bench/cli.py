"""`pdserve bench serve` and `pdserve bench sweep`: the serving benchmark's command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

from .datasets import DATASET_NAMES, DatasetConfig
from .metrics import DEFAULT_PERCENTILES, parse_goodput

DEFAULTS = DatasetConfig()


def register(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="serving benchmark: load generator (serve) and goodput sweep over serving modes (sweep)",
        description="Serving benchmarks against pdserve's gRPC API. `pdserve bench serve` drives a running "
                    "cluster; `pdserve bench sweep` starts clusters itself and compares serving modes.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    serve = sub.add_parser(
        "serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="send a workload to running decode workers and report throughput, latency and goodput",
        description="Send a workload to the decode workers of a running cluster (round-robin) over gRPC, "
                    "streaming every request, and report request and token throughput, TTFT / TPOT / ITL / "
                    "end-to-end latency (mean, median, percentiles), goodput, the route mix and the remote "
                    "prefill handoff breakdown. Result field names follow vLLM's `bench serve`.")
    where = serve.add_argument_group("where to send")
    where.add_argument("--target", action="append", default=None, metavar="HOST:PORT",
                       help="gRPC address of a decode worker; repeat for several (default: every decode worker "
                            "of --topology)")
    where.add_argument("--topology", default=None,
                       help="topology file of a cluster started with `pdserve up`: its decode workers are the "
                            "targets and its model directory the tokenizer")
    where.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="model directory whose tokenizer.json counts ShareGPT tokens (without one: ~4 "
                            "characters per token)")
    _dataset_args(serve, default_name="random")
    _load_args(serve, with_rate=True)
    _metric_args(serve, default_goodput=None)
    out = serve.add_argument_group("output")
    out.add_argument("--num-workers", type=int, default=None,
                     help="workers the cluster runs, for goodput per worker (default: from --topology)")
    out.add_argument("--result-file", default=None, metavar="PATH",
                     help="write the metrics and every request's raw samples to this JSON file")
    serve.set_defaults(func=_serve)

    sweep = sub.add_parser(
        "sweep", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="goodput vs request rate for colocated, always-remote and conditional serving (starts clusters)",
        description="Run the same workload on the same number of workers in up to three modes, each on a "
                    "fresh cluster started with the launcher from one base topology: colocated (every worker "
                    "decodes, no prefill pool), always-remote (P prefill + N-P decode, every prompt prefilled "
                    "remotely) and conditional (the same split, the conditional router). Rate i uses dataset "
                    "seed SEED+1000*i in every mode. Writes OUTPUT_DIR/sweep.json (table, metrics and raw "
                    "per-request samples) and PNG plots: goodput vs rate, p90 latency vs rate, TTFT and TPOT "
                    "CDFs at one rate.")
    s = sweep.add_argument_group("clusters")
    s.add_argument("--topology", default=None,
                   help="base topology: model, engine settings, resources (default: "
                        "configs/topologies/1p1d-local.yaml); replicas, ports and policies are set per mode")
    s.add_argument("--num-workers", type=int, default=2, help="workers in every mode (N)")
    s.add_argument("--prefill-workers", type=int, default=None,
                   help="prefill workers (P) in the disaggregated modes (default: N // 2)")
    s.add_argument("--modes", default=",".join(("colocated", "always-remote", "conditional")),
                   help="comma-separated subset of: colocated, always-remote, conditional")
    s.add_argument("--conditional-policy", default=None, metavar="FILE",
                   help="router policy of the conditional mode (default: configs/router/default.yaml)")
    s.add_argument("--extra-conditional-policy", action="append", default=[], metavar="FILE",
                   help="add a conditional mode that uses this router policy, named conditional-<file stem> "
                        "(repeatable; e.g. to compare the cost model with a length threshold in one sweep)")
    s.add_argument("--admission", choices=("slo", "policy", "off"), default="slo",
                   help="QoS early rejection: slo = the policies' TTFT/TPOT SLOs set to --goodput's; policy = "
                        "as in the policy files; off = the same SLOs, admit everything")
    s.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up requests after each cluster starts")
    s.add_argument("--interleave", action="store_true",
                   help="start every mode's cluster at once and let the modes take turns at each rate, so that "
                        "foreign load on a shared host hits all modes alike (needs memory for all clusters)")
    s.add_argument("--repeats", type=int, default=1,
                   help="runs per mode and rate, each with its own prompts (interleaved with --interleave); "
                        "the table shows the median run by goodput, with min-max over the runs")
    s.add_argument("--wait-load-below", type=float, default=None, metavar="LOAD",
                   help="before each run, wait until the host's 1-minute load average is under LOAD (a shared "
                        "host's other jobs then fall between runs rather than in them); default: do not wait")
    s.add_argument("--wait-load-timeout-s", type=float, default=600.0,
                   help="longest wait for --wait-load-below before running anyway")
    s.add_argument("--ray-worker-niceness", type=int, default=0,
                   help="nice value of the workers when the sweep starts the Ray head (Ray's own default, 15, "
                        "lets any other process on the host preempt them)")
    s.add_argument("--request-rates", type=_rate, nargs="+", default=[0.5, 1.0, 2.0],
                   help="request rates to sweep (req/s for the whole cluster; inf = all at once)")
    s.add_argument("--cdf-rate", type=_rate, default=None,
                   help="the rate whose TTFT/TPOT CDFs are plotted (default: the middle of --request-rates)")
    s.add_argument("--output-dir", default=None,
                   help="where sweep.json and the PNGs go (default: runs/bench-sweep-DATE-TIME)")
    _dataset_args(sweep, default_name="mixed", default_num_prompts=40)
    _load_args(sweep, with_rate=False)
    _metric_args(sweep, default_goodput=["ttft:500", "tpot:50"])
    sweep.set_defaults(func=_sweep)


# -- shared flags ----------------------------------------------------------------------------
    report = sub.add_parser(
        "report", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="print a finished sweep's summary and tables again (optionally redraw its plots)",
        description="Read a sweep.json written by `pdserve bench sweep` and print, as Markdown, each mode's "
                    "peak goodput and the highest rate it sustained with the given SLO attainment, the ratios "
                    "between modes, and the sweep tables. Nothing is re-run.")
    report.add_argument("sweep_json", metavar="SWEEP_JSON", help="the sweep.json of a finished sweep")
    report.add_argument("--attainment", type=float, default=0.9,
                        help="SLO attainment (good / sent, 0-1) a rate must reach to count as sustained")
    report.add_argument("--plots", action="store_true",
                        help="also redraw the PNG plots next to SWEEP_JSON")
    report.add_argument("--cdf-rate", type=_rate, default=None,
                        help="rate of the TTFT/TPOT CDF plots (default: the sweep's)")
    report.set_defaults(func=_report)


def _dataset_args(p, default_name: str, default_num_prompts: int = 100) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=DATASET_NAMES, default=default_name,
                   help="random: lengths around --random-*-len; shared-prefix: groups sharing a system prompt; "
                        "mixed: short chat turns + long documents; sharegpt: a ShareGPT JSON file")
    g.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (--dataset-name sharegpt)")
    g.add_argument("--num-prompts", type=int, default=default_num_prompts, help="requests per run")
    g.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrival process")
    g.add_argument("--random-range-ratio", type=float, default=DEFAULTS.range_ratio,
                   help="every synthetic length is uniform in [L*(1-r), L*(1+r)]; 0 = exactly L")
    g.add_argument("--random-input-len", type=int, default=DEFAULTS.input_len, help="random: prompt tokens")
    g.add_argument("--random-output-len", type=int, default=DEFAULTS.output_len, help="random: tokens to generate")
    g.add_argument("--shared-prefix-len", type=int, default=DEFAULTS.prefix_len,
                   help="shared-prefix: tokens of each group's shared system prompt")
    g.add_argument("--shared-prefix-suffix-len", type=int, default=DEFAULTS.suffix_len,
                   help="shared-prefix: tokens each request adds after the shared prefix")
    g.add_argument("--shared-prefix-groups", type=int, default=DEFAULTS.num_groups,
                   help="shared-prefix: distinct shared prefixes (requests cycle through them)")
    g.add_argument("--shared-prefix-output-len", type=int, default=DEFAULTS.output_len,
                   help="shared-prefix: tokens to generate")
    g.add_argument("--mixed-short-input-len", type=int, default=DEFAULTS.short_input_len,
                   help="mixed: prompt tokens of a short chat turn")
    g.add_argument("--mixed-short-output-len", type=int, default=DEFAULTS.short_output_len,
                   help="mixed: tokens generated for a short chat turn")
    g.add_argument("--mixed-long-input-len", type=int, default=DEFAULTS.long_input_len,
                   help="mixed: prompt tokens of a long document")
    g.add_argument("--mixed-long-output-len", type=int, default=DEFAULTS.long_output_len,
                   help="mixed: tokens generated for a long document")
    g.add_argument("--mixed-long-fraction", type=float, default=DEFAULTS.long_fraction,
                   help="mixed: fraction of requests that are long documents (exact count, shuffled)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: generate this many tokens instead of the reply's length")


def _load_args(p, with_rate: bool) -> None:
    g = p.add_argument_group("load")
    if with_rate:
        g.add_argument("--request-rate", type=_rate, default=math.inf,
                       help="requests per second; inf sends every request at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight; with --request-rate inf this is a fixed-concurrency run")
    g.add_argument("--duration-s", type=float, default=None,
                   help="stop releasing requests after this many seconds (default: send all --num-prompts)")
    g.add_argument("--drain-timeout-s", type=float, default=300.0,
                   help="after the last release, cancel requests still running this long (they count as failed)")
    g.add_argument("--request-timeout-s", type=float, default=600.0, help="gRPC deadline of one request")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the dataset's output length, ignoring EOS")
    g.add_argument("--route", choices=("auto", "local", "remote"), default="auto",
                   help="routing override sent with every request (auto = the router decides)")
    g.add_argument("--priority", choices=("normal", "high", "low"), default="normal", help="request priority")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")


def _metric_args(p, default_goodput) -> None:
    g = p.add_argument_group("metrics")
    g.add_argument("--goodput", nargs="+", default=default_goodput, metavar="NAME:MS",
                   help="SLOs a good request meets, of ttft, tpot, e2el in ms (e.g. ttft:500 tpot:50)")
    g.add_argument("--metric-percentiles", default=",".join(f"{p:g}" for p in DEFAULT_PERCENTILES),
                   help="comma-separated percentiles reported for every latency metric")


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (or inf)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a rate must be > 0")
    return value


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: use comma-separated numbers, e.g. 50,90,99") from None
    if not ps or any(not 0 < p < 100 for p in ps):
        raise ValueError(f"--metric-percentiles {text!r}: each percentile must be in (0, 100)")
    return ps


def dataset_config(args) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset_name, num_prompts=args.num_prompts, seed=args.seed, range_ratio=args.random_range_ratio,
        input_len=args.random_input_len,
        output_len=args.shared_prefix_output_len if args.dataset_name == "shared-prefix" else args.random_output_len,
        prefix_len=args.shared_prefix_len, suffix_len=args.shared_prefix_suffix_len,
        num_groups=args.shared_prefix_groups, short_input_len=args.mixed_short_input_len,
        short_output_len=args.mixed_short_output_len, long_input_len=args.mixed_long_input_len,
        long_output_len=args.mixed_long_output_len, long_fraction=args.mixed_long_fraction,
        path=args.dataset_path, sharegpt_output_len=args.sharegpt_output_len)


def load_config(args, request_rate: float = math.inf):
    from .serve import LoadConfig

    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    return LoadConfig(
        request_rate=getattr(args, "request_rate", request_rate), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, duration_s=args.duration_s, drain_timeout_s=args.drain_timeout_s,
        request_timeout_s=args.request_timeout_s, seed=args.seed, temperature=args.temperature,
        ignore_eos=args.ignore_eos, route=args.route, priority=args.priority, progress=args.progress)


# -- commands ------------------------------------------------------------------------------
def _serve(args) -> int:
    from .datasets import load_dataset
    from .metrics import compute_metrics, format_summary, json_safe, records_json
    from .serve import model_info, run_load

    slos = parse_goodput(args.goodput)
    percentiles = _percentiles(args.metric_percentiles)
    targets, tokenizer, num_workers = list(args.target or []), args.tokenizer, args.num_workers
    if args.topology:
        from pdserve.cluster.topology import load_topology
        from pdserve.launcher import ClusterState, state_path

        if not Path(args.topology).is_file():
            raise FileNotFoundError(f"--topology {args.topology}: no such file")
        state = ClusterState.load(state_path(load_topology(args.topology)))
        targets = targets or [e["grpc"] for e in state.decode_endpoints]
        tokenizer = tokenizer or state.model
        num_workers = num_workers or len(state.actors)
    if not targets:
        raise ValueError("give --target HOST:PORT (repeatable) or --topology FILE of a running cluster")
    info = model_info(targets[0])
    cfg = dataset_config(args)
    if cfg.name == "sharegpt" and not tokenizer:
        print("bench serve: no --tokenizer: ShareGPT lengths estimated at ~4 characters per token", file=sys.stderr)
    requests = load_dataset(cfg, int(info.get("vocab_size") or 32000), tokenizer)
    load = load_config(args)
    records, duration = asyncio.run(run_load(targets, requests, load))
    metrics = compute_metrics(records, duration, slos=slos, percentiles=percentiles, num_workers=num_workers)
    print(format_summary(metrics))
    if args.result_file:
        doc = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "pdserve-grpc", "model_id": info.get("id"),
               "targets": targets, "request_rate": load.request_rate, "burstiness": load.burstiness,
               "max_concurrency": load.max_concurrency, "dataset": vars(cfg), **metrics,
               "requests": records_json(records)}
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(json_safe(doc), indent=1))
        print(f"results written to {args.result_file}")
    return 0 if metrics["completed"] else 1


def _sweep(args) -> int:
    from .report import markdown_table
    from .sweep import DEFAULT_TOPOLOGY, SweepConfig, run_sweep

    extra = {f"conditional-{Path(f).stem}": f for f in args.extra_conditional_policy}
    cfg = SweepConfig(
        output_dir=args.output_dir or f"runs/bench-sweep-{time.strftime('%Y%m%d-%H%M%S')}",
        request_rates=list(args.request_rates), topology=args.topology or str(DEFAULT_TOPOLOGY),
        modes=[m.strip() for m in args.modes.split(",") if m.strip()] + list(extra), extra_policies=extra,
        num_workers=args.num_workers,
        prefill_workers=args.prefill_workers, conditional_policy=args.conditional_policy,
        admission=args.admission, slos=parse_goodput(args.goodput), percentiles=_percentiles(args.metric_percentiles),
        cdf_rate=args.cdf_rate, warmup=args.warmup, interleave=args.interleave, repeats=args.repeats,
        wait_load_below=args.wait_load_below, wait_load_timeout_s=args.wait_load_timeout_s,
        ray_worker_niceness=args.ray_worker_niceness, dataset=dataset_config(args), load=load_config(args))
    if cfg.dataset.name == "sharegpt" and not cfg.dataset.path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE")
    doc = run_sweep(cfg)
    print(markdown_table(doc))
    print(f"\nresults: {Path(cfg.output_dir) / 'sweep.json'}")
    for name, path in doc["plots"].items():
        if name != "cdf_rate":
            print(f"plot:    {path}")
    return 0


def _report(args) -> int:
    from .plots import write_plots
    from .report import markdown_table, sweep_summary, sweep_table

    path = Path(args.sweep_json)
    if not path.is_file():
        raise FileNotFoundError(f"SWEEP_JSON {path}: no such file")
    if not 0.0 < args.attainment <= 1.0:
        raise ValueError(f"--attainment {args.attainment:g}: use a fraction in (0, 1]")
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or "results" not in doc:
        raise ValueError(f"SWEEP_JSON {path}: not a sweep.json (no 'results')")
    doc["table"] = sweep_table(doc["results"])
    doc["summary"] = sweep_summary(doc["results"], args.attainment)
    print(markdown_table(doc))
    if args.plots:
        cdf_rate = args.cdf_rate if args.cdf_rate is not None else (doc.get("plots") or {}).get("cdf_rate")
        if cdf_rate is None:
            rates = doc["config"]["request_rates"]
            cdf_rate = rates[len(rates) // 2]
        for name, plot in write_plots(doc, path.parent, cdf_rate).items():
            if name != "cdf_rate":
                print(f"plot:    {plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.bench.cli serve|sweep ...`: the same commands without the `pdserve` entry point."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.cli")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve bench {args.bench_command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
