"""Prefill-queue microbenchmark: put -> get_batch latency and task throughput.

Three Ray actors on this machine: a producer (stands in for a decode worker),
the PrefillQueue, and a consumer (a prefill worker) that long-polls
`get_batch`. Both talk to the queue through a `QueueClient`, over each
transport in turn (`--transports wire,wire-tls,ray`: the queue's socket, the
same over TLS (a second queue actor serving `queue.tls` with throw-away
certificates from `pdserve certs make`), Ray actor calls), alternating the
order round by round so that all see the same machine. As the workers do,
the producer signs every task (Ed25519, cluster/queue/signing.py) and the
consumer verifies it before taking its arrival time (`--no-sign` to leave
that out). One run measures, per transport,

0. baseline: the round trip of an empty actor call between the two actors,
   the floor that any queue hop sits on (it moves with machine load);
1. latency: the producer puts tasks at a steady rate; for each task, the time
   from just before `put` until the consumer holds it (get_batch returned),
   reported as p50 / p99 / max;
2. throughput: the producer puts as fast as it can (a window of concurrent
   puts); tasks/s from the first put to the last task received.

and, once, the cost of signing and verifying one task (`signing_us`).

    python bench/queue_latency.py            # defaults: ~1 min on 2 cores
    python bench/queue_latency.py --transports wire,wire-tls   # plaintext vs TLS wire
    python bench/queue_latency.py --transports wire --rounds 1
    python bench/queue_latency.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import timeit
import uuid

import ray

from pdserve.certs import make_certs
from pdserve.cluster.runtime import freeze_gc_heap
from pdserve.cluster.security import ClientTLS
from pdserve.kvtransfer import PrefillTask
from pdserve.cluster.queue import QueueClient, TaskSigner, get_or_create_queue, verify_task

TRANSPORTS = ("wire", "wire-tls", "ray")


def make_task(i: int, num_tokens: int, signer: TaskSigner | None = None) -> PrefillTask:
    task = PrefillTask(
        request_id=f"bench-{i}",
        epoch=0,
        token_ids=list(range(num_tokens)),
        cached_len=0,
        target_worker_id="decode-0",
        target_block_ids=list(range(num_tokens // 16 + 1)),
        sampling_params={"temperature": 0.0, "max_tokens": 1},
        deadline=time.time() + 600,
        arrival_time=time.time(),  # stamped just before put (and signing): the latency start
    )
    return signer.sign(task) if signer is not None else task


class _Clients:
    """One QueueClient per transport: "wire-tls" is the TLS queue's wire, verified with the CA."""

    def __init__(self, queues: dict, ca_file: str | None):
        self.queues, self.ca_file = queues, ca_file
        self.clients: dict[str, QueueClient] = {}

    def __call__(self, transport: str) -> QueueClient:
        if transport not in self.clients:
            if transport == "wire-tls":
                client = QueueClient(self.queues["tls"], "wire", tls=ClientTLS(ca_file=self.ca_file))
            else:
                client = QueueClient(self.queues["plain"], transport)
            self.clients[transport] = client
        return self.clients[transport]


@ray.remote(num_cpus=0)
class Producer:
    """Puts tasks on the queue (signed, as a decode worker does): paced (latency) or windowed
    flat out (throughput)."""

    def __init__(self, queues: dict, ca_file: str | None = None, sign: bool = True, freeze_gc: bool = True):
        self.client = _Clients(queues, ca_file)
        self.signer = TaskSigner() if sign else None
        if freeze_gc:  # as the workers do after start-up
            freeze_gc_heap(type(self).__name__)

    def public_key(self) -> str | None:
        return self.signer.public_key if self.signer is not None else None

    async def paced(self, transport: str, first_id: int, count: int, rate_hz: float, num_tokens: int) -> int:
        queue = self.client(transport)
        period_s, start, rejected = 1.0 / rate_hz, time.perf_counter(), 0
        for i in range(count):
            result = await queue.put(make_task(first_id + i, num_tokens, self.signer))
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

    async def flat_out(self, transport: str, first_id: int, count: int, window: int, num_tokens: int) -> int:
        queue = self.client(transport)
        rejected, i = 0, 0
        while i < count:
            n = min(window, count - i)
            results = await asyncio.gather(*[queue.put(make_task(first_id + i + k, num_tokens, self.signer))
                                             for k in range(n)])
            rejected += sum(not r.ok for r in results)
            i += n
        return rejected


@ray.remote(num_cpus=0)
class Consumer:
    """Long-polls get_batch; verifies each task's signature (as a prefill worker does), then
    records when it arrived in hand."""

    def __init__(self, queues: dict, ca_file: str | None = None, public_key: str | None = None,
                 freeze_gc: bool = True):
        self.client = _Clients(queues, ca_file)
        self.public_key = public_key
        if freeze_gc:  # as the workers do after start-up
            freeze_gc_heap(type(self).__name__)

    async def ping(self) -> None:
        return None

    async def drain(self, transport: str, count: int, max_tokens: int, max_wait_ms: float, timeout_s: float,
                    polls: int = 1) -> dict:
        """Receive `count` tasks, keeping `polls` get_batch calls outstanding.

        With one poll, a task put while the previous batch is on its way back
        (and the next call not yet at the queue) waits for that next call: up
        to one more round trip. A second outstanding poll is always waiting
        at the queue, which is what an idle prefill worker can afford.
        """
        queue = self.client(transport)
        latencies_ms, batch_sizes, received = [], [], 0
        deadline = time.time() + timeout_s
        first_receive = last_receive = None
        done: list[str] = []

        def poll():
            # The previous batch is reported done with the next request, as a prefill worker does.
            nonlocal done
            call = queue.get_batch("bench-prefill", max_tokens, max_wait_ms, None, done)
            done = []
            return asyncio.ensure_future(call)

        pending = {poll() for _ in range(polls)}
        while received < count and time.time() < deadline:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in finished:
                batch = fut.result()
                pending.add(poll())
                if self.public_key is not None:
                    bad = [t.request_id for t in batch if verify_task(t, self.public_key) is not None]
                    if bad:
                        raise RuntimeError(f"tasks {bad[:3]} failed verification")
                now = time.time()
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
        await queue.complete("bench-prefill", done)
        return {"latencies_ms": latencies_ms, "batch_sizes": batch_sizes, "received": received,
                "first_receive": first_receive, "last_receive": last_receive, "transport": queue.in_use}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))]


def signing_us(num_tokens: int, repeat: int = 2000) -> dict:
    """Microseconds to sign and to verify one task of `num_tokens` tokens (best of 5 runs)."""
    signer = TaskSigner()
    task = make_task(0, num_tokens, signer)
    sign = min(timeit.repeat(lambda: signer.sign(task), number=repeat, repeat=5)) / repeat * 1e6
    verify = min(timeit.repeat(lambda: verify_task(task, signer.public_key), number=repeat, repeat=5)) / repeat * 1e6
    return {"tokens": num_tokens, "sign_us": sign, "verify_us": verify}


def run_transport(producer, consumer, transport: str, args, round_no: int) -> dict:
    """One latency phase and one throughput phase over `transport`."""
    base = (round_no * len(TRANSPORTS) + TRANSPORTS.index(transport)) * 10_000_000
    drained = consumer.drain.remote(transport, args.latency_tasks, args.batch_tokens, args.max_wait_ms, 300, args.polls)
    rejected = ray.get(producer.paced.remote(transport, base, args.latency_tasks, args.rate_hz, args.prompt_tokens))
    lat = ray.get(drained)
    start = time.time()
    drained = consumer.drain.remote(transport, args.throughput_tasks, args.batch_tokens, args.max_wait_ms, 300, args.polls)
    rejected += ray.get(producer.flat_out.remote(transport, base + 5_000_000, args.throughput_tasks, args.window,
                                                 args.prompt_tokens))
    put_done = time.time()
    thr = ray.get(drained)
    return {"latencies_ms": lat["latencies_ms"], "in_use": lat["transport"], "rejected": rejected,
            "tasks": thr["received"], "seconds": (thr["last_receive"] or start) - start,
            "put_seconds": put_done - start, "batch_sizes": thr["batch_sizes"]}


def summarize(runs: list[dict], rate_hz: float) -> dict:
    lat = [x for r in runs for x in r["latencies_ms"]]
    tasks, seconds, put_s = (sum(r[k] for r in runs) for k in ("tasks", "seconds", "put_seconds"))
    return {
        "latency": {"tasks": len(lat), "rate_hz": rate_hz, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                    "max_ms": max(lat), "mean_ms": statistics.fmean(lat),
                    "p99_ms_per_round": [percentile(r["latencies_ms"], 99) for r in runs]},
        "throughput": {"tasks": tasks, "seconds": seconds, "tasks_per_s": tasks / seconds, "put_tasks_per_s": tasks / put_s,
                       "mean_batch_size": statistics.fmean([b for r in runs for b in r["batch_sizes"]])},
        "in_use": sorted({r["in_use"] for r in runs}),
        "rejected_puts": sum(r["rejected"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PrefillQueue microbenchmark: put->get_batch latency (p50/p99) between two Ray actors and "
        "tasks/s throughput, over the queue's wire and over Ray actor calls, side by side in one run.")
    parser.add_argument("--transports", default="wire,ray",
                        help="comma-separated transports to compare: wire, wire-tls (the wire over TLS), ray "
                        "(default %(default)s)")
    parser.add_argument("--no-sign", dest="sign", action="store_false",
                        help="put unsigned tasks and skip verification (the workers always sign and verify)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds; each runs every transport once, the order alternating (default %(default)s)")
    parser.add_argument("--latency-tasks", type=int, default=1000, help="tasks per latency phase (default %(default)s)")
    parser.add_argument("--rate-hz", type=float, default=200.0, help="put rate in the latency phase (default %(default)s)")
    parser.add_argument("--throughput-tasks", type=int, default=5000, help="tasks per throughput phase (default %(default)s)")
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
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports:
        parser.error(f"--transports: {bad or 'nothing'} given; choose from {', '.join(TRANSPORTS)}")

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_worker_niceness"] = str(args.ray_worker_niceness)  # read by the raylet Ray starts
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, namespace="pdserve-bench")
    capacity = max(args.throughput_tasks, args.latency_tasks) + 1
    name = f"bench-{uuid.uuid4().hex[:6]}"
    queues = {"plain": get_or_create_queue(name, "pdserve-bench", capacity=capacity)}
    ca_file = None
    if "wire-tls" in transports:  # a second queue whose wire speaks TLS (queue.tls), throw-away certificates
        pki = make_certs(tempfile.mkdtemp(prefix="pdserve-bench-pki-"), ["127.0.0.1"], days=1)
        ca_file = str(pki["ca"])
        queues["tls"] = get_or_create_queue(f"{name}-tls", "pdserve-bench", capacity=capacity,
                                            wire_tls={"cert": str(pki["queue"]), "key": str(pki["queue-key"])})
    producer = Producer.remote(queues, ca_file, args.sign)
    consumer = Consumer.remote(queues, ca_file, ray.get(producer.public_key.remote()))
    ray.get([q.stats.remote() for q in queues.values()] + [consumer.__ray_ready__.remote()])
    queue = queues["plain"]

    # Warm-up: first calls pay for connections and imports.
    for transport in transports:
        warm = consumer.drain.remote(transport, 50, args.batch_tokens, args.max_wait_ms, 60)
        ray.get(producer.paced.remote(transport, -1_000_000 - 1000 * len(transport), 50, args.rate_hz, args.prompt_tokens))
        ray.get(warm)

    ping_ms = ray.get(producer.ping_rtt_ms.remote(consumer, 1000))
    runs: dict[str, list[dict]] = {t: [] for t in transports}
    for round_no in range(args.rounds):
        for transport in (transports if round_no % 2 == 0 else transports[::-1]):
            run = run_transport(producer, consumer, transport, args, round_no)
            runs[transport].append(run)
            print(f"  round {round_no + 1}/{args.rounds} {transport:4s}: put->get_batch p99 "
                  f"{percentile(run['latencies_ms'], 99):.2f} ms, {run['tasks'] / run['seconds']:.0f} tasks/s",
                  file=sys.stderr, flush=True)
    ping_ms += ray.get(producer.ping_rtt_ms.remote(consumer, 1000))
    stats = ray.get(queue.stats.remote())
    ray.shutdown()
    signing = [signing_us(args.prompt_tokens), signing_us(2048)] if args.prompt_tokens != 2048 else [signing_us(2048)]

    result = {
        "transports": {t: summarize(r, args.rate_hz) for t, r in runs.items()},
        "baseline_actor_rtt": {"p50_ms": percentile(ping_ms, 50), "p99_ms": percentile(ping_ms, 99)},
        "load_avg_1m": os.getloadavg()[0],
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "queue_counters": stats.counters,
        "signing_us": signing,
    }
    if "wire" in runs and "wire-tls" in runs:
        w, t = result["transports"]["wire"], result["transports"]["wire-tls"]
        result["tls_over_wire"] = {
            "p50": t["latency"]["p50_ms"] / w["latency"]["p50_ms"], "p99": t["latency"]["p99_ms"] / w["latency"]["p99_ms"],
            "throughput": t["throughput"]["tasks_per_s"] / w["throughput"]["tasks_per_s"]}
    if "wire" in runs and "ray" in runs:
        w, r = result["transports"]["wire"], result["transports"]["ray"]
        result["ray_over_wire"] = {
            "p50": r["latency"]["p50_ms"] / w["latency"]["p50_ms"], "p99": r["latency"]["p99_ms"] / w["latency"]["p99_ms"],
            "throughput": w["throughput"]["tasks_per_s"] / r["throughput"]["tasks_per_s"]}
    print(f"prefill queue, {args.prompt_tokens}-token tasks, budget {args.batch_tokens} tokens, {os.cpu_count()} CPUs, "
          f"ray {ray.__version__}, worker niceness {args.ray_worker_niceness}, {args.rounds} round(s), "
          f"tasks {'signed and verified' if args.sign else 'unsigned'}")
    base = result["baseline_actor_rtt"]
    print(f"baseline  empty Ray actor call round trip: p50 {base['p50_ms']:.2f} ms  p99 {base['p99_ms']:.2f} ms  "
          f"(1-min load average {result['load_avg_1m']:.2f})")
    print(f"{'transport':10s} {'put->get_batch p50':>19s} {'p99':>9s} {'max':>9s}   p99 per round      "
          f"{'tasks/s':>8s} {'mean batch':>10s}")
    for t, res in result["transports"].items():
        lr, tr = res["latency"], res["throughput"]
        rounds = " ".join(f"{x:.2f}" for x in lr["p99_ms_per_round"])
        print(f"{t:10s} {lr['p50_ms']:16.2f} ms {lr['p99_ms']:6.2f} ms {lr['max_ms']:6.2f} ms   {rounds:18s} "
              f"{tr['tasks_per_s']:8.0f} {tr['mean_batch_size']:10.1f}")
        if res["in_use"] != [t.split("-")[0]]:
            print(f"warning: transport {t} ran as {res['in_use']}", file=sys.stderr)
        if res["rejected_puts"]:
            print(f"warning: {res['rejected_puts']} puts rejected over {t}", file=sys.stderr)
    if "tls_over_wire" in result:
        ratio = result["tls_over_wire"]
        print(f"wire-tls vs wire: p50 {ratio['p50']:.2f}x, p99 {ratio['p99']:.2f}x, throughput {ratio['throughput']:.2f}x")
    for sig in signing:
        print(f"signing   a {sig['tokens']}-token task: sign {sig['sign_us']:.0f} us, verify {sig['verify_us']:.0f} us")
    if "ray_over_wire" in result:
        ratio = result["ray_over_wire"]
        print(f"wire vs ray: p50 {ratio['p50']:.1f}x lower, p99 {ratio['p99']:.1f}x lower, "
              f"throughput {ratio['throughput']:.1f}x higher")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
