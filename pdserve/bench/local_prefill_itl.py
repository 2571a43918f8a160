"""Running streams' inter-token latency while a decode worker prefills a long prompt locally:
the planned step budget (engine/step_budget.py, engine/step_plan.py) against an unbounded
step and a fixed 16-token chunk (what the TPOT-only budget of issue 16 came to with 4 streams on
one core), side by side.

A decode worker (`pdserve serve-decode`, its own process, pinned to one core) streams
``--streams`` requests; once they are decoding, a ``--long-tokens`` prompt is sent with
``route: local``. The ITL of the streams' tokens that arrive while the long prompt is
prefilled (from its submission to its first token) is what running users feel; the
long prompt's own TTFT is what the budget costs. Modes alternate for ``--rounds`` rounds.

    python bench/local_prefill_itl.py                       # 3 rounds, 1,500-token prompt, 4 streams
    python bench/local_prefill_itl.py --rounds 1 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

MODES = {"unbounded": 4096, "fixed-16": 16, "planned": None}  # --local-prefill-budget-tokens; None: planned


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: the bench's default model under .cache/)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--tpot-slo-ms", type=float, default=50.0, help="the policy's qos.tpot_slo_ms")
    p.add_argument("--cpu", type=int, default=None, help="pin the decode worker to this core (default: the last)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(model: str, policy: str, budget: int | None, cpu: int) -> tuple[subprocess.Popen, str, str]:
    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "serve-decode", "--model", model, "--grpc-port", str(grpc_port),
           "--http-port", str(http_port), "--router-policy", policy, "--log-level", "warning",
           "--engine-args", json.dumps({"max_num_batched_tokens": 4096, "kv_cache_memory_bytes": 256 << 20})]
    if budget is not None:
        cmd += ["--local-prefill-budget-tokens", str(budget)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "gRPC" in line:
            return proc, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}/metrics"
        if proc.poll() is not None:
            raise SystemExit(f"serve-decode exited with {proc.returncode}")
    proc.kill()
    raise SystemExit("serve-decode did not start within 120 s")


async def one_round(target: str, args) -> dict:
    from pdserve.api import AsyncClient

    gaps: list[tuple[float, float]] = []  # (arrival time, gap ms)
    decoding = asyncio.Event()
    started = 0

    async with AsyncClient(target, timeout_s=300) as c:
        async def stream(i: int):
            nonlocal started
            last = None
            async for msg in c.stream(f"Stream {i}: tell a long story.", max_tokens=400, temperature=0.0,
                                      ignore_eos=True, route="local"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now, (now - last) * 1e3))
                elif (started := started + 1) == args.streams:
                    decoding.set()
                last = now
                if long_done.is_set() and now > long_done.t + 0.3:
                    return

        long_done = asyncio.Event()
        long_done.t = float("inf")
        tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
        await asyncio.wait_for(decoding.wait(), 60)
        await asyncio.sleep(0.5)
        salt = int(time.time() * 1000)  # a fresh prompt each round: no prefix-cache hit
        prompt = [(7 * j + salt) % 29000 + 100 for j in range(args.long_tokens)]
        t0 = time.perf_counter()
        out = await c.generate(prompt, max_tokens=1, temperature=0.0, route="local")
        t1 = time.perf_counter()
        long_done.t = t1
        long_done.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    during = sorted(g for t, g in gaps if t0 <= t <= t1)
    q = statistics.quantiles(during, n=100) if len(during) >= 2 else [during[0]] * 99
    return {"itl_p50_ms": statistics.median(during), "itl_p99_ms": q[98], "itl_max_ms": during[-1],
            "samples": len(during), "long_ttft_ms": (t1 - t0) * 1e3, "long_prompt_tokens": out.breakdown["prompt_tokens"]}


def budget_gauge(url: str) -> float:
    """The worker's pdserve_local_prefill_budget_tokens (what its engine runs with now)."""
    import urllib.request

    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return float(next(x for x in body.splitlines() if x.startswith("pdserve_local_prefill_budget_tokens{")).split()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is None:
        sys.path.insert(0, os.path.dirname(__file__))
        from engine_throughput import default_model

        args.model = default_model()
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        policy = os.path.join(tmp, "router.yaml")
        with open(policy, "w") as f:
            f.write(f"qos:\n  tpot_slo_ms: {args.tpot_slo_ms}\n  enable_early_rejection: false\n")
        for r in range(args.rounds):
            for mode, budget in MODES.items():
                proc, target, metrics = start_worker(args.model, policy, budget, cpu)
                try:
                    asyncio.run(one_round(target, args))  # warm-up: learns its costs, fills caches
                    res = asyncio.run(one_round(target, args))
                    res["budget_tokens"] = budget_gauge(metrics)
                finally:
                    proc.terminate()
                    proc.wait(30)
                results[mode].append(res)
                print(f"round {r + 1} {mode:<9}: ITL p50 {res['itl_p50_ms']:6.1f} ms  p99 {res['itl_p99_ms']:7.1f} ms  "
                      f"max {res['itl_max_ms']:7.1f} ms ({res['samples']} gaps); long prompt "
                      f"{res['long_prompt_tokens']} tokens TTFT {res['long_ttft_ms']:.0f} ms; budget {res['budget_tokens']:.0f} "
                      "tokens/step", flush=True)
    summary = {}
    print(f"\nmedian of {args.rounds} rounds (min-max); decode worker on CPU {cpu}; tpot_slo_ms {args.tpot_slo_ms:g}")
    for mode, rows in results.items():
        agg = {k: (statistics.median(r[k] for r in rows), min(r[k] for r in rows), max(r[k] for r in rows))
               for k in ("itl_p50_ms", "itl_p99_ms", "long_ttft_ms")}
        summary[mode] = agg
        print(f"{mode:<9}: ITL p99 {agg['itl_p99_ms'][0]:7.1f} ms ({agg['itl_p99_ms'][1]:.1f}-{agg['itl_p99_ms'][2]:.1f}) "
              f"= {agg['itl_p99_ms'][0] / args.tpot_slo_ms:.2f}x tpot_slo_ms; ITL p50 {agg['itl_p50_ms'][0]:.1f} ms; "
              f"long prompt TTFT {agg['long_ttft_ms'][0]:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": results, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
