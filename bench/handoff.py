"""Remote-prefill handoff cost: TTFT local vs remote, split into its parts, in one run.

Starts a 1P1D cluster in this process (embedded etcd, a local Ray, the
prefill worker as a Ray actor, the decode worker on a thread), then for each
prompt length sends requests one at a time (fresh prompts: no prefix-cache
hits), alternating forced-local and forced-remote. Prints medians of:

  local : TTFT, prefill (first scheduled -> first token)
  remote: TTFT, queue wait, prefill compute (on the prefill worker),
          transfer + notification, and overhead = TTFT - prefill compute

    python bench/handoff.py                       # default ~34M model, lengths 128 512 2048
    python bench/handoff.py --lengths 128 2048 --reps 7 --no-layerwise
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: make the default model under .cache/)")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--reps", type=int, default=5, help="requests per length and route")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--no-layerwise", action="store_true", help="write pages after the forward, not per layer")
    p.add_argument("--json", default=None, help="also write results to this JSON file")
    return p.parse_args(argv)


class LoopThread:
    """An event loop on a thread, for the decode worker."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ucx = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
    os.environ.update(ucx)
    import ray

    from pdserve.api import Client
    from pdserve.cluster.etcd_server import EmbeddedEtcd
    from pdserve.decode.worker import DecodeWorker, DecodeWorkerConfig
    from pdserve.prefill.worker import PrefillWorker

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engine_throughput import default_model

    model = args.model or default_model()
    engine_args = {"max_num_batched_tokens": max(2048, max(args.lengths))}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="pdserve-bench")
    tmp = tempfile.mkdtemp(prefix="pdserve-handoff-")
    loop = LoopThread()
    with EmbeddedEtcd(os.path.join(tmp, "etcd")) as etcd:
        common = dict(model=model, engine_args=engine_args, etcd_endpoints=[etcd.endpoint], cluster="handoff",
                      ucx_env=ucx, queue_name="handoff-queue")
        import torch

        # Ray sets OMP_NUM_THREADS from an actor's num_cpus; give the prefill
        # worker the threads the in-process decode worker has, for a fair comparison.
        threads = {"env_vars": {"OMP_NUM_THREADS": str(torch.get_num_threads())}}
        prefill = ray.remote(PrefillWorker).options(num_cpus=0, runtime_env=threads).remote(
            dict(common, worker_id="prefill-0", layerwise=not args.no_layerwise))
        ray.get(prefill.start.remote(), timeout=300)
        decode = DecodeWorker(DecodeWorkerConfig(**common, worker_id="decode-0", remote_prefill=True))
        loop.run(decode.start())
        deadline = time.monotonic() + 30
        while decode.frontend.prefill_view.pool_size < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        rng = random.Random(0)
        vocab = decode.engine.model_config.vocab_size
        rows = []
        with Client(decode.grpc_address, timeout_s=300) as client:
            warm = [rng.randrange(3, vocab) for _ in range(64)]
            for route in ("local", "remote"):  # connect NIXL, warm up both paths
                client.generate(warm + [3 + (route == "local")], max_tokens=2, temperature=0.0, route=route, priority="high")
            for n in args.lengths:
                samples = {"local": [], "remote": []}
                for _ in range(args.reps):
                    for route in ("local", "remote"):
                        prompt = [rng.randrange(3, vocab) for _ in range(n)]
                        out = client.generate(prompt, max_tokens=args.max_tokens, temperature=0.0,
                                              ignore_eos=True, route=route, priority="high")
                        b = out.breakdown
                        assert b["route"] == route, b
                        samples[route].append(b)
                rows.append(summarise(n, samples))
                print_row(rows[-1])
        loop.run(decode.stop())
        ray.get(prefill.stop.remote(), timeout=60)
    loop.close()
    ray.shutdown()
    print_table(rows, layerwise=not args.no_layerwise)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def summarise(n: int, samples: dict) -> dict:
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    loc, rem = samples["local"], samples["remote"]
    row = {
        "prompt_tokens": n,
        "local_ttft_ms": med(loc, "ttft_ms"), "local_prefill_ms": med(loc, "prefill_ms"),
        "remote_ttft_ms": med(rem, "ttft_ms"), "queue_wait_ms": med(rem, "queue_wait_ms"),
        "remote_prefill_ms": med(rem, "prefill_ms"), "transfer_notify_ms": med(rem, "transfer_ms"),
        "transfer_bytes": med(rem, "transfer_bytes"),
        "overhead_ms": statistics.median(r["ttft_ms"] - r["prefill_ms"] for r in rem),
    }
    return row


def print_row(r: dict) -> None:
    print(f"  {r['prompt_tokens']:>5} tokens: local TTFT {r['local_ttft_ms']:.1f} ms, "
          f"remote TTFT {r['remote_ttft_ms']:.1f} ms", flush=True)


def print_table(rows: list[dict], layerwise: bool) -> None:
    print(f"\nmedians, ms (layer-wise page writes: {'on' if layerwise else 'off'})")
    head = (f"{'tokens':>6} | {'local TTFT':>10} {'prefill':>8} | {'remote TTFT':>11} {'queue':>6} "
            f"{'prefill':>8} {'xfer+notif':>10} {'MB':>6} | {'overhead':>8} {'remote/local':>12}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['prompt_tokens']:>6} | {r['local_ttft_ms']:>10.1f} {r['local_prefill_ms']:>8.1f} | "
              f"{r['remote_ttft_ms']:>11.1f} {r['queue_wait_ms']:>6.1f} {r['remote_prefill_ms']:>8.1f} "
              f"{r['transfer_notify_ms']:>10.1f} {r['transfer_bytes'] / 1e6:>6.2f} | {r['overhead_ms']:>8.1f} "
              f"{r['remote_ttft_ms'] / r['local_ttft_ms']:>11.2f}x")
    print("overhead = remote TTFT - prefill compute on the prefill worker (goal at 2k tokens: < 10 ms)")


if __name__ == "__main__":
    sys.exit(main())
