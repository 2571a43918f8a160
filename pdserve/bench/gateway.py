"""The gateway's routing against random routing (a Kubernetes Service), side by side, on two
decode workers. Two workloads:

``--workload load`` (default), driven by vLLM's own client: one worker slowed by a busy loop
on its core;
``--workload chat``: multi-turn chats on shared system prompts (bench/prefix_cluster.py's),
the workers publishing KV events, so the gateway sees which worker holds a chat's history.

    python bench/gateway.py                         # load: 120 prompts at 3 req/s per routing
    python bench/gateway.py --rate 4 --num-prompts 200 --busy-loops 2
    python bench/gateway.py --workload chat         # 32 chats x 6 turns per routing
    python bench/gateway.py --workload race         # racing on against off, an intermittent neighbour

Setup on this host: etcd; two `pdserve serve-decode` processes, one pinned to each core
(OpenMP 1 thread each); ``--busy-loops`` processes spinning on the second worker's core, so
it runs at a fraction of the first one's speed (a noisy neighbour). For each routing
(``ttft``: the gateway's predicted TTFT, gateway/pick.py; ``random``: any live worker, what a
Service does) a `pdserve gateway --routing R` process is started and `vllm bench serve
--backend openai --endpoint /v1/completions` (from the `make vllm-venv` virtualenv) sends the
same prompts (same seed) to its HTTP surface. The table gives, per routing, the share of
requests the slowed worker took (the gateway's `pdserve_gateway_routed_total`), completed
requests, goodput under ``--goodput``, and TTFT p50/p90/p99; then the ratios ttft / random.

Chat: no busy loop; each worker's KV pool holds ``--pool-tokens`` and records KV events; the
chats (``--chats``, ``--turns``, ``--think-s``; bench/prefix_cluster.py `run_chats`, our gRPC
client: vLLM's client has no multi-turn sessions) go through the gateway with no session
affinity, so only the gateway's view of the caches keeps a chat's turns together. The table
gives, per routing, the prefix hit rate (prompt tokens the serving worker had cached, from
each reply's breakdown) and TTFT p50/p90.

Race: the gateway's routing with racing off (``ttft``) and on (``race``: ``--race-fraction``,
``--race-risk``) on the same workers; decode-1's core is shared with a neighbour that spins
for ``--burst-s`` then sleeps for twice that (an intermittent tail no prediction sees
coming). Requests carry ``ttft_slo_ms`` (our gRPC client: racing needs the target, and
vLLM's client cannot send it). Per mode: TTFT p50/p90/p99, the races won by the predicted
best and by the runner-up, and the extra work (prompt tokens sent to losers / all prompt
tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]  # the checkout (bench/ is pdserve/bench, linked from the top)
sys.path.insert(0, str(REPO))  # bench.* when run as a script
SERVED_NAME = "gw-model"


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def spawn(args: list[str], log_path: Path, cpus: str | None = None, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve", *args]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def wait_line(path: Path, pattern: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text())
        if m:
            return m
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode}: {path.read_text()[-2000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{pattern!r} not printed within {timeout_s} s: see {path}")


def warm_up(grpc_addr: str) -> None:
    """A few requests of the benchmark's sizes straight to a worker before anything is timed:
    the first routing measured would otherwise pay every worker's first-call costs."""
    import random

    from pdserve.api import Client

    rng = random.Random(12345)
    with Client(grpc_addr, timeout_s=120) as c:
        for n in (64, 128, 256, 384, 512, 768, 64, 256):
            c.generate([rng.randrange(3, 32000) for _ in range(n)], max_tokens=8, temperature=0.0, ignore_eos=True)


def routed(http: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'pdserve_gateway_routed_total\{.*worker_id="([^"]+)".*\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def run_client(args, url: str, result: Path) -> dict:
    cmd = [args.vllm_python, str(HERE / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--endpoint", "/v1/completions", "--base-url", url, "--model", SERVED_NAME, "--tokenizer", args.model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", "0.8", "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.rate), "--ignore-eos", "--seed", str(args.seed), "--goodput", *args.goodput,
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99", "--save-result",
           "--result-dir", str(result.parent), "--result-filename", result.name, "--disable-tqdm"]
    with open(result.with_suffix(".log"), "w") as logf:
        rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=args.run_timeout_s,
                            env=dict(os.environ, VLLM_TARGET_DEVICE="cpu")).returncode
    if rc != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve failed (rc {rc}); see {result.with_suffix('.log')}")
    return json.loads(result.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: the ~34M model under .cache/)")
    p.add_argument("--rate", type=float, default=3.0, help="requests/s (default 3)")
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--input-len", type=int, default=256, help="mean prompt tokens (range ratio 0.8)")
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--busy-loops", type=int, default=1, help="spinning processes on the slowed worker's core")
    p.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:100"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routings", default="ttft,random")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--run-timeout-s", type=float, default=900)
    p.add_argument("--output", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--workload", choices=("load", "chat", "race"), default="load")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed passes (other prompts, same sizes) before the timed routings (default 1)")
    p.add_argument("--chats", type=int, default=32, help="chat: chats (3 system prompts of 512 tokens)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--think-s", type=float, default=4.0)
    p.add_argument("--chat-rate", type=float, default=4.0, help="chat: chats started per second")
    p.add_argument("--pool-tokens", type=int, default=4096, help="chat: each worker's KV pool, in tokens")
    p.add_argument("--race-fraction", type=float, default=0.3, help="race: the gateway's --race-fraction")
    p.add_argument("--race-risk", type=float, default=0.2, help="race: the gateway's --race-risk")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0, help="race: each request's ttft_slo_ms")
    p.add_argument("--burst-s", type=float, default=1.0, help="race: the neighbour spins this long, sleeps 2x")
    p.add_argument("--reps", type=int, default=1,
                   help="race: timed passes per routing, alternating (ttft, race, ttft, race, ...); the report gives "
                        "each pass, the medians, and the race/no-race ratio of each adjacent pair")
    args = p.parse_args(argv)
    if args.workload == "load" and not Path(args.vllm_python).is_file():
        raise SystemExit(f"--vllm-python {args.vllm_python}: missing; run `make vllm-venv` (vLLM's client)")
    from bench.engine_throughput import default_model
    from pdserve.cluster.etcd_server import EmbeddedEtcd

    args.model = args.model or default_model()
    if args.workload == "race" and args.routings == "ttft,random":
        args.routings = "ttft,race"
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    policy = work / "router.yaml"
    policy.write_text("qos:\n  enable_early_rejection: false\n")
    procs: list[subprocess.Popen] = []
    results = {}
    try:
        with EmbeddedEtcd(work / "etcd") as etcd:
            workers = {}
            engine = {}
            if args.workload == "chat":
                from pdserve.engine.config import ModelConfig

                m = ModelConfig.from_dir(args.model)
                per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4  # float32 on CPU
                engine = {"kv_events": True, "kv_cache_memory_bytes": args.pool_tokens * per_token,
                          "max_model_len": args.pool_tokens}
            for i in range(2):
                wid = f"decode-{i}"
                path = work / f"{wid}.log"
                proc = spawn(["serve-decode", "--model", args.model, "--etcd", etcd.endpoint, "--cluster", "gwbench",
                              "--worker-id", wid, "--grpc-port", "0", "--http-port", "0", "--router-policy",
                              str(policy), "--served-model-name", SERVED_NAME, "--engine-args", json.dumps(engine)],
                             path, cpus=str(i), env={"OMP_NUM_THREADS": "1"})
                procs.append(proc)
                workers[wid] = (proc, path)
            for wid, (proc, path) in workers.items():
                addr = wait_line(path, r"gRPC (\S+)  HTTP", proc).group(1)
                warm_up(addr)
                log(f"{wid} up (warmed up)")
            for _ in range(args.busy_loops if args.workload == "load" else 0):
                procs.append(subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"]))
            spin = (f"import time\nwhile True:\n    t = time.time() + {args.burst_s}\n"
                    f"    while time.time() < t: pass\n    time.sleep({2 * args.burst_s})\n")
            if args.workload == "load":
                log(f"decode-1 slowed by {args.busy_loops} busy loop(s) on core 1")
            order = args.routings.split(",")
            # An untimed pass first, other prompts (seed + 1000), same sizes: the first timed
            # routing would otherwise pay the workers' first-time costs (oneDNN builds a kernel
            # per new shape), measured as a 4x TTFT p50 for whichever routing ran first.
            passes = [("warm-up", order[0])] * args.warmup + [(r, r) for _ in range(max(1, args.reps)) for r in order]
            seed = args.seed
            for label, routing in passes:
                args.seed = seed + 1000 if label == "warm-up" else seed
                path = work / f"gateway-{label}.log"
                extra = (["--routing", "ttft", "--race-fraction", str(args.race_fraction), "--race-risk",
                          str(args.race_risk)] if routing == "race" else ["--routing", routing])
                gw = spawn(["gateway", "--etcd", etcd.endpoint, "--cluster", "gwbench", "--model", args.model,
                            *extra], path)
                procs.append(gw)
                m = wait_line(path, r"gRPC (\S+), HTTP (\S+), 2 decode worker", gw)
                grpc_addr, http = m.group(1), m.group(2)
                if args.workload == "chat":
                    res = run_chat(args, grpc_addr, http)
                elif args.workload == "race":
                    # The neighbour starts with the pass, so every pass's arrivals (same seed) meet
                    # it in the same phase: otherwise identical passes differ up to 4x by where
                    # the arrivals fall in its cycle (docs/PERFORMANCE.md, session 24).
                    neighbour = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", spin])
                    try:
                        res = run_race(args, grpc_addr, http)
                    finally:
                        neighbour.kill()
                        neighbour.wait(30)
                if args.workload in ("chat", "race"):
                    gw.terminate()
                    gw.wait(30)
                    if label != "warm-up":
                        if args.workload == "race":
                            results.setdefault(routing, []).append(res)
                        else:
                            results[routing] = res
                    log(f"  {label}: {json.dumps(res)}")
                    continue
                log(f"{label} ({routing}): vllm bench serve, {args.num_prompts} prompts at {args.rate} req/s ...")
                raw = run_client(args, http, work / f"{label}.json")
                sent = routed(http)
                gw.terminate()
                gw.wait(30)
                total = sum(sent.values()) or 1
                results[routing] = {
                    "slowed_share": round(sent.get("decode-1", 0) / total, 3), "routed": sent,
                    **{k: raw.get(k) for k in ("completed", "request_goodput", "request_throughput", "p50_ttft_ms",
                                               "p90_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")}}
                if label == "warm-up":
                    del results[routing]
                else:
                    log(f"  {json.dumps(results[routing])}")
        args.seed = seed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait(30)
    if args.workload == "chat":
        report_chat(args, results)
    elif args.workload == "race":
        report_race(args, results)
    else:
        report_load(args, results)
    if args.output:
        args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                          indent=2))
    return 0


def run_chat(args, grpc_addr: str, http: str) -> dict:
    import asyncio
    import types

    from bench.prefix_cluster import make_chats, pct, run_chats
    from pdserve.engine.config import ModelConfig

    cfg = types.SimpleNamespace(seed=args.seed, systems=3, system_len=512, chats=args.chats, turns=args.turns,
                                user_len=96, output_len=32, rate=args.chat_rate, think_s=args.think_s,
                                request_timeout_s=300.0)
    chats = make_chats(cfg, ModelConfig.from_dir(args.model).vocab_size)
    log(f"chat: {args.chats} chats x {args.turns} turns through {grpc_addr} ...")
    records, _lags = asyncio.run(run_chats([grpc_addr], chats, cfg))
    ok = [r for r in records if r["error"] is None and r["ttft_ms"] is not None]
    prompt = sum(r["prompt_len"] for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    later = [r for r in ok if r["turn"] > 0]
    return {"requests": len(records), "errors": len(records) - len(ok), "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": round(cached / max(prompt, 1), 3),
            "later_turn_hit_rate": round(sum(r.get("cached_tokens") or 0 for r in later) /
                                         max(sum(r["prompt_len"] for r in later), 1), 3),
            "p50_ttft_ms": pct([r["ttft_ms"] for r in ok], 50), "p90_ttft_ms": pct([r["ttft_ms"] for r in ok], 90),
            "routed": routed(http)}


def gateway_counters(http: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'pdserve_gateway_races_total\{.*outcome="([^"]+)".*\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
        elif line.startswith("pdserve_gateway_race_wasted_prompt_tokens_total{"):
            out["wasted_prompt_tokens"] = float(line.rsplit(" ", 1)[1])
    return out


def run_race(args, grpc_addr: str, http: str) -> dict:
    """Poisson arrivals of random prompts with a TTFT target, streamed through the gateway."""
    import asyncio
    import random

    from bench.prefix_cluster import pct
    from pdserve.api import AsyncClient

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(64, 2 * args.input_len))]
               for _ in range(args.num_prompts)]
    gaps = [rng.expovariate(args.rate) for _ in prompts]

    async def main() -> list:
        async with AsyncClient(grpc_addr, timeout_s=300) as c:
            async def one(i: int, ids: list[int]) -> float | None:
                start = time.perf_counter()
                async for msg in c.stream(ids, max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                                          ttft_slo_ms=args.ttft_slo_ms):
                    if msg.token_ids:
                        return (time.perf_counter() - start) * 1e3
                return None

            tasks = []
            for i, ids in enumerate(prompts):
                tasks.append(asyncio.ensure_future(one(i, ids)))
                await asyncio.sleep(gaps[i])
            return await asyncio.gather(*tasks, return_exceptions=True)

    log(f"race: {args.num_prompts} prompts at {args.rate} req/s through {grpc_addr} ...")
    ttfts = asyncio.run(main())
    ok = [t for t in ttfts if isinstance(t, float)]
    counters = gateway_counters(http)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"requests": len(prompts), "errors": len(prompts) - len(ok),
            "p50_ttft_ms": pct(ok, 50), "p90_ttft_ms": pct(ok, 90), "p99_ttft_ms": pct(ok, 99),
            "within_slo": round(sum(t <= args.ttft_slo_ms for t in ok) / len(prompts), 3),
            "races": counters, "extra_work": round(counters.get("wasted_prompt_tokens", 0) / prompt_tokens, 3),
            "routed": routed(http)}


def report_race(args, results: dict[str, list[dict]]) -> None:
    """Each pass, the medians per routing, and the race / no-race ratios of adjacent pairs."""
    import statistics

    print(f"\n2 decode workers, decode-1's core shared with a neighbour spinning {args.burst_s} s of every "
          f"{3 * args.burst_s} s (restarted with each pass); {args.num_prompts} prompts (64-{2 * args.input_len} "
          f"tokens, {args.output_len} out) at {args.rate} req/s, ttft_slo_ms {args.ttft_slo_ms}; racing: fraction "
          f"{args.race_fraction}, risk {args.race_risk}; {max(1, args.reps)} pass(es) per routing")
    print(f"{'mode':<12} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'in SLO':>7} {'won 1st':>8} {'won 2nd':>8} "
          f"{'extra work':>10}")
    keys = ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "within_slo", "extra_work")
    for r, runs in results.items():
        for i, x in enumerate(runs):
            races = x["races"]
            print(f"{f'{r} #{i + 1}':<12} {x['p50_ttft_ms']:>9.0f} {x['p90_ttft_ms']:>8.0f} {x['p99_ttft_ms']:>8.0f} "
                  f"{x['within_slo']:>7.2f} {races.get('won_first', 0):>8.0f} {races.get('won_second', 0):>8.0f} "
                  f"{x['extra_work']:>10.2f}")
        med = {k: statistics.median(x[k] for x in runs) for k in keys}
        print(f"{f'{r} median':<12} {med['p50_ttft_ms']:>9.0f} {med['p90_ttft_ms']:>8.0f} {med['p99_ttft_ms']:>8.0f} "
              f"{med['within_slo']:>7.2f} {'':>8} {'':>8} {med['extra_work']:>10.2f}")
    if {"ttft", "race"} <= set(results):
        pairs = list(zip(results["race"], results["ttft"]))
        for q in ("p99", "p90", "p50"):
            ratios = sorted(a[f"{q}_ttft_ms"] / b[f"{q}_ttft_ms"] for a, b in pairs)
            print(f"race/no race TTFT {q}: median {statistics.median(ratios):.2f}x over {len(ratios)} pair(s) "
                  f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]")
        extra = statistics.median(a["extra_work"] for a, _ in pairs)
        print(f"extra prompt work with racing: median {extra:.0%}")


def report_chat(args, results: dict) -> None:
    print(f"\n2 decode workers (KV events on, {args.pool_tokens}-token pools); {args.chats} chats x {args.turns} "
          f"turns on 3 shared 512-token system prompts, think {args.think_s} s, through the gateway")
    print(f"{'routing':<8} {'hit rate':>8} {'later turns':>11} {'TTFT p50':>9} {'p90':>8} {'errors':>6}")
    for r, x in results.items():
        print(f"{r:<8} {x['hit_rate']:>8.2f} {x['later_turn_hit_rate']:>11.2f} {x['p50_ttft_ms']:>9.0f} "
              f"{x['p90_ttft_ms']:>8.0f} {x['errors']:>6}")
    if {"ttft", "random"} <= set(results):
        a, b = results["ttft"], results["random"]
        print(f"ratio ttft/random: TTFT p90 {a['p90_ttft_ms'] / b['p90_ttft_ms']:.2f}x, p50 "
              f"{a['p50_ttft_ms'] / b['p50_ttft_ms']:.2f}x; hit rate {a['hit_rate']:.2f} vs {b['hit_rate']:.2f}")


def report_load(args, results: dict) -> None:
    print(f"\n2 decode workers, decode-1 sharing its core with {args.busy_loops} busy loop(s); vllm bench serve, "
          f"{args.num_prompts} random prompts (~{args.input_len} in, {args.output_len} out) at {args.rate} req/s, "
          f"goodput {' '.join(args.goodput)}")
    print(f"{'routing':<8} {'slowed share':>12} {'completed':>9} {'goodput':>8} {'TTFT p50':>9} {'p90':>8} {'p99':>8}")
    for r, x in results.items():
        print(f"{r:<8} {x['slowed_share']:>12.2f} {x['completed']:>9} {x['request_goodput'] or 0:>8.2f} "
              f"{x['p50_ttft_ms']:>9.0f} {x['p90_ttft_ms']:>8.0f} {x['p99_ttft_ms']:>8.0f}")
    if {"ttft", "random"} <= set(results):
        a, b = results["ttft"], results["random"]
        print(f"ratio ttft/random: TTFT p99 {a['p99_ttft_ms'] / b['p99_ttft_ms']:.2f}x, p90 "
              f"{a['p90_ttft_ms'] / b['p90_ttft_ms']:.2f}x, goodput "
              f"{(a['request_goodput'] or 0) / max(b['request_goodput'] or 0, 1e-9):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
