"""Prefill-queue microbenchmark: put -> get_batch latency and task throughput.

Three Ray actors on this machine: a producer (stands in for a decode worker),
the PrefillQueue, and a consumer (a prefill worker) that long-polls
`get_batch`. One run measures

0. baseline: the round trip of an empty actor call between the two actors,
   the floor that any queue hop sits on (it moves with machine load);
1. latency: the producer puts tasks at a steady rate; for each task, the time
   from just before `put` until the consumer holds it (get_batch returned),
   reported as p50 / p99 / max;
2. throughput: the producer puts as fast as it can (a window of concurrent
   puts); tasks/s from the first put to the last task received.

    python bench/queue_latency.py            # defaults: ~15 s on 2 cores
    python bench/queue_latency.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid

import ray

from pdserve.cluster.queue import PrefillTask, get_or_create_queue


def make_task(i: int, num_tokens: int) -> PrefillTask:
    return PrefillTask(
        request_id=f"bench-{i}",
        epoch=0,
        token_ids=list(range(num_tokens)),
        cached_len=0,
        target_worker_id="decode-0",
        target_block_ids=list(range(num_tokens // 16 + 1)),
        sampling_params={"temperature": 0.0, "max_tokens": 1},
        arrival_time=time.time(),  # stamped just before put: the latency start
    )


@ray.remote(num_cpus=0)
class Producer:
    """Puts tasks on the queue: paced (latency) or windowed flat out (throughput)."""

    def __init__(self, queue):
        self.queue = queue

    async def paced(self, first_id: int, count: int, rate_hz: float, num_tokens: int) -> int:
        period_s, start, rejected = 1.0 / rate_hz, time.perf_counter(), 0
        for i in range(count):
            result = await self.queue.put.remote(make_task(first_id + i, num_tokens))
            rejected += not result.ok
            sleep_s = start + (i + 1) * period_s - time.perf_counter()
            if sleep_s > 0:
                await asyncio.sleep(sleep_s)
        return rejected

    async def ping_rtt_ms(self, other, count: int) -> list[float]:
        """Round trips of an empty actor call: the floor any queue hop sits on."""
        out = []
        for _ in range(count):
            start = time.perf_counter()
            await other.ping.remote()
            out.append((time.perf_counter() - start) * 1000.0)
        return out

    async def flat_out(self, first_id: int, count: int, window: int, num_tokens: int) -> int:
        rejected, i = 0, 0
        while i < count:
            n = min(window, count - i)
            results = await asyncio.gather(*[self.queue.put.remote(make_task(first_id + i + k, num_tokens)) for k in range(n)])
            rejected += sum(not r.ok for r in results)
            i += n
        return rejected


@ray.remote(num_cpus=0)
class Consumer:
    """Long-polls get_batch; records when each task arrived in hand."""

    def __init__(self, queue):
        self.queue = queue

    async def ping(self) -> None:
        return None

    async def drain(self, count: int, max_tokens: int, max_wait_ms: float, timeout_s: float,
                    polls: int = 1) -> dict:
        """Receive `count` tasks, keeping `polls` get_batch calls outstanding.

        With one poll, a task put while the previous batch is on its way back
        (and the next call not yet at the queue) waits for that next call: up
        to one more round trip. A second outstanding poll is always waiting
        at the queue, which is what an idle prefill worker can afford.
        """
        latencies_ms, batch_sizes, received = [], [], 0
        deadline = time.time() + timeout_s
        first_receive = last_receive = None
        done: list[str] = []

        def poll():
            # The previous batch is reported done with the next request, as a prefill worker does.
            nonlocal done
            ref = self.queue.get_batch.remote("bench-prefill", max_tokens, max_wait_ms, None, done)
            done = []
            return asyncio.ensure_future(ref)

        pending = {poll() for _ in range(polls)}
        while received < count and time.time() < deadline:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            now = time.time()
            for fut in finished:
                batch = fut.result()
                pending.add(poll())
                done.extend(task.request_id for task in batch)
                if not batch:
                    continue
                first_receive = first_receive or now
                last_receive = now
                batch_sizes.append(len(batch))
                latencies_ms.extend((now - task.arrival_time) * 1000.0 for task in batch)
                received += len(batch)
        for fut in pending:  # outstanding polls end by their own timeout (max_wait_ms)
            batch = await fut
            done.extend(task.request_id for task in batch)
        await self.queue.complete.remote("bench-prefill", done)
        return {"latencies_ms": latencies_ms, "batch_sizes": batch_sizes, "received": received,
                "first_receive": first_receive, "last_receive": last_receive}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PrefillQueue microbenchmark: put->get_batch latency (p50/p99) between two "
        "Ray actors, and tasks/s throughput, in one run.")
    parser.add_argument("--latency-tasks", type=int, default=2000, help="tasks in the latency phase (default %(default)s)")
    parser.add_argument("--rate-hz", type=float, default=200.0, help="put rate in the latency phase (default %(default)s)")
    parser.add_argument("--throughput-tasks", type=int, default=20000, help="tasks in the throughput phase (default %(default)s)")
    parser.add_argument("--window", type=int, default=64, help="concurrent puts in the throughput phase (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="token ids per task (default %(default)s)")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="get_batch token budget (default %(default)s)")
    parser.add_argument("--max-wait-ms", type=float, default=50.0, help="get_batch long-poll (default %(default)s)")
    parser.add_argument("--polls", type=int, default=1,
                        help="get_batch calls the consumer keeps outstanding (default %(default)s; 2 = one is "
                        "always waiting at the queue, also while the previous batch travels back)")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs for the local Ray (default %(default)s)")
    parser.add_argument("--ray-worker-niceness", type=int, default=0,
                        help="nice value of Ray's worker processes (Ray's own default is 15, which lets any "
                        "other job on a shared box preempt the actors; default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_worker_niceness"] = str(args.ray_worker_niceness)  # read by the raylet Ray starts
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, namespace="pdserve-bench")
    capacity = max(args.throughput_tasks, args.latency_tasks) + 1
    queue = get_or_create_queue(f"bench-{uuid.uuid4().hex[:6]}", "pdserve-bench", capacity=capacity)
    producer, consumer = Producer.remote(queue), Consumer.remote(queue)
    ray.get([queue.stats.remote(), producer.__ray_ready__.remote(), consumer.__ray_ready__.remote()])

    # Warm-up: first calls pay for connections and imports.
    warm = consumer.drain.remote(50, args.batch_tokens, args.max_wait_ms, 60)
    ray.get(producer.paced.remote(-1_000_000, 50, args.rate_hz, args.prompt_tokens))
    ray.get(warm)

    ping_ms = ray.get(producer.ping_rtt_ms.remote(consumer, 1000))

    drained = consumer.drain.remote(args.latency_tasks, args.batch_tokens, args.max_wait_ms, 300, args.polls)
    rejected = ray.get(producer.paced.remote(0, args.latency_tasks, args.rate_hz, args.prompt_tokens))
    lat = ray.get(drained)

    start = time.time()
    drained = consumer.drain.remote(args.throughput_tasks, args.batch_tokens, args.max_wait_ms, 300, args.polls)
    rejected += ray.get(producer.flat_out.remote(10_000_000, args.throughput_tasks, args.window, args.prompt_tokens))
    put_done = time.time()
    thr = ray.get(drained)
    stats = ray.get(queue.stats.remote())
    ray.shutdown()

    l_ms = lat["latencies_ms"]
    elapsed_s = (thr["last_receive"] or start) - start
    result = {
        "latency": {"tasks": len(l_ms), "rate_hz": args.rate_hz, "p50_ms": percentile(l_ms, 50),
                    "p99_ms": percentile(l_ms, 99), "max_ms": max(l_ms), "mean_ms": statistics.fmean(l_ms)},
        "throughput": {"tasks": thr["received"], "seconds": elapsed_s, "tasks_per_s": thr["received"] / elapsed_s,
                       "put_tasks_per_s": args.throughput_tasks / (put_done - start),
                       "mean_batch_size": statistics.fmean(thr["batch_sizes"])},
        "baseline_actor_rtt": {"p50_ms": percentile(ping_ms, 50), "p99_ms": percentile(ping_ms, 99)},
        "load_avg_1m": os.getloadavg()[0],
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "rejected_puts": rejected,
        "queue_counters": stats.counters,
    }
    print(f"prefill queue, {args.prompt_tokens}-token tasks, budget {args.batch_tokens} tokens, "
          f"{os.cpu_count()} CPUs, ray {ray.__version__}, worker niceness {args.ray_worker_niceness}")
    base = result["baseline_actor_rtt"]
    print(f"baseline   empty actor call round trip: p50 {base['p50_ms']:.2f} ms  p99 {base['p99_ms']:.2f} ms  "
          f"(1-min load average {result['load_avg_1m']:.2f})")
    lr = result["latency"]
    print(f"latency    put->get_batch  {lr['tasks']} tasks at {args.rate_hz:g}/s: "
          f"p50 {lr['p50_ms']:.2f} ms  p99 {lr['p99_ms']:.2f} ms  max {lr['max_ms']:.2f} ms")
    tr = result["throughput"]
    print(f"throughput {tr['tasks']} tasks in {tr['seconds']:.2f} s: {tr['tasks_per_s']:.0f} tasks/s "
          f"(puts {tr['put_tasks_per_s']:.0f}/s, mean batch {tr['mean_batch_size']:.1f} tasks)")
    if rejected:
        print(f"warning: {rejected} puts rejected", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
