"""What tracing costs a decode worker: engine step time and TTFT with tracing off, on at 1%
and on at 100% (docs/cluster.md, "Tracing").

One decode worker in this process (local prefill, no cluster), driven over gRPC by a client
that sends new random prompts in each run (no run finds another's prefix cached), after a
warm-up run; the modes alternate round by round so that all see the same machine. Spans go to an in-memory exporter (the SDK's batch processor still runs, as
with OTLP), or with ``--otlp-endpoint`` to a real collector. Reported per mode: the mean engine
step (ms, the worker's decode steps), TTFT p50 / mean (ms) and the spans exported.

    python bench/tracing.py --model DIR                       # defaults
    python bench/tracing.py --model DIR --requests 4 --rounds 1 --max-tokens 4 --json out.json

Needs a quiet machine for figures worth quoting; the smoke test runs it with small settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from pdserve.api import AsyncClient
from pdserve.common import tracing
from pdserve.decode.worker import DecodeWorker, DecodeWorkerConfig

MODES = {"off": None, "1%": 0.01, "100%": 1.0}


def _tracer(ratio: float | None, endpoint: str | None):
    if ratio is None:
        return tracing.configure("decode", None), None
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = None if endpoint else InMemorySpanExporter()
    cfg = {"otlp_traces_endpoint": endpoint or "http://127.0.0.1:4317", "otlp_traces_sample_ratio": ratio}
    return tracing.configure("decode", cfg, exporter=exporter), exporter


async def _run_mode(worker: DecodeWorker, client: AsyncClient, prompts: list[list[int]], max_tokens: int,
                    concurrency: int) -> dict:
    steps0, ms0 = worker.decode_steps, worker.decode_ms
    ttfts: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(ids: list[int]) -> None:
        async with sem:
            t0 = time.perf_counter()
            first = None
            async for c in client.stream(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                if c.token_ids and first is None:
                    first = (time.perf_counter() - t0) * 1e3
            ttfts.append(first if first is not None else float("nan"))

    await asyncio.gather(*(one(p) for p in prompts))
    steps = worker.decode_steps - steps0
    return {"ttft_ms": ttfts, "steps": steps, "step_ms_total": worker.decode_ms - ms0}


async def main_async(args) -> dict:
    worker = DecodeWorker(DecodeWorkerConfig(model=args.model, calibrate=False, access_log=False,
                                             engine_args={"device": "cpu"} if args.cpu else {}))
    await worker.start()
    rng = random.Random(0)

    def fresh() -> list[list[int]]:
        """New prompts for each run: no run finds another's prefix in the cache."""
        return [[rng.randrange(3, 32000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    out: dict[str, dict] = {m: {"ttft_ms": [], "steps": 0, "step_ms_total": 0.0, "spans": 0} for m in MODES}
    try:
        async with AsyncClient(worker.grpc_address) as client:
            await _run_mode(worker, client, fresh(), args.max_tokens, args.concurrency)  # warm-up
            for r in range(args.rounds):
                order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    tr, exporter = _tracer(MODES[mode], args.otlp_endpoint)
                    got = await _run_mode(worker, client, fresh(), args.max_tokens, args.concurrency)
                    tr.flush(10)
                    o = out[mode]
                    o["ttft_ms"] += got["ttft_ms"]
                    o["steps"] += got["steps"]
                    o["step_ms_total"] += got["step_ms_total"]
                    o["spans"] += len(exporter.get_finished_spans()) if exporter is not None else 0
    finally:
        tracing.configure("decode", None)
        await worker.stop()
    report = {}
    for mode, o in out.items():
        t = [x for x in o["ttft_ms"] if x == x]
        report[mode] = {"requests": len(o["ttft_ms"]), "ttft_p50_ms": statistics.median(t) if t else None,
                        "ttft_mean_ms": statistics.fmean(t) if t else None,
                        "step_mean_ms": o["step_ms_total"] / o["steps"] if o["steps"] else None,
                        "steps": o["steps"], "spans_exported": o["spans"]}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--requests", type=int, default=64, help="requests per mode and round (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, modes alternating (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--cpu", action="store_true", help="run the engine on the CPU")
    p.add_argument("--otlp-endpoint", default=None, help="export to this OTLP gRPC collector instead of memory")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    report = asyncio.run(main_async(args))
    print(f"{'mode':<6} {'requests':>8} {'TTFT p50':>9} {'TTFT mean':>10} {'step ms':>8} {'spans':>6}")
    for mode, r in report.items():
        f = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        print(f"{mode:<6} {r['requests']:>8} {f(r['ttft_p50_ms']):>9} {f(r['ttft_mean_ms']):>10} "
              f"{f(r['step_mean_ms']):>8} {r['spans_exported']:>6}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
