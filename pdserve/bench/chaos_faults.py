"""The chaos soak's faults that clients and hung processes cause (bench/chaos.py).

- ``stop_prefill``: SIGSTOP of the prefill worker's process for ``stop_s`` seconds, then
  SIGCONT. A hung process, not a dead one: its etcd lease lives until its TTL, so only the
  queue's liveness (no heartbeat past ``queue.stall_timeout_s``) fails its tasks back.
- ``abort_storm``: ``storm_size`` streams forced remote, each dropped by its client at a
  random moment in the first ``storm_cut_s`` seconds (before or after its first token).
  Nothing they held may stay: queued tasks withdrawn, blocks freed (the soak's final
  leak check covers it).
- ``reuse_ids``: ``reuse_pairs`` times, a stream is dropped after its first token and its
  request_id is sent again at once with another prompt. The second request must get its
  own prompt's tokens (or ALREADY_EXISTS while the first is torn down, then its own
  tokens): a reused id that receives anything else is a crossed output.
- ``poison_request``: ``poison_count`` requests whose prompt the engine fails on every worker
  (failpoint ``request.poison``, common/failpoints.py), sent through the gateway. Each must
  come back as its own error (INTERNAL marked ``x-pdserve-error-scope: request``), and a short
  request right after must be served: a gateway that took the workers out of rotation for
  them would refuse it ("no decode worker can take this request").
- ``loan_race``: fresh prefixes, each sent once with route local (the decode worker caches
  it) and once forced remote (the prefill worker lacks it and borrows it from the decode
  worker, kvtransfer/lending.py): half of them beside a flood of fresh long local prompts that
  presses the holder's pool and keeps its engine busy, half after it. With ``kv_transport.verify`` on, a lent block that changed under the read is
  a checksum mismatch (must be 0); a lease that ended first is ``stale`` (computed instead).
  Every borrowing request must be token-exact either way.
- ``second_cluster``: a second `pdserve up` cluster (one decode worker, its own name, etcd,
  Ray head and ports) started on this host while the soak runs, ``second_requests`` prompts
  sent to it and compared with the reference, then `pdserve down`. Its Ray head takes over
  Ray's "current cluster" file: nothing of the soak's cluster may notice.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import uuid
from dataclasses import dataclass, field

ASYNC_FAULTS = ("abort_storm", "reuse_ids", "poison_request", "second_cluster", "loan_race")


@dataclass
class ClientFaultStats:
    """What the client-side faults did, for the report."""

    aborted: int = 0  # streams dropped on purpose by abort_storm
    reused: int = 0  # ids sent again by reuse_ids
    crossed: int = 0  # a reused id answered with tokens that are not its own prompt's: must be 0
    reuse_failed: int = 0  # a reused id that ended in an error (typed errors included)
    # another client's short request just before a storm and right after its last drop (ms)
    storm_probe_ttft_ms: list = field(default_factory=list)  # [(before, after), ...]
    poison_sent: int = 0
    poison_returned: int = 0  # came back as the request's own error (INTERNAL, scope request)
    poison_other: int = 0  # anything else (served, another code, unmarked): must be 0
    poison_probes: int = 0  # short requests right after a firing
    poison_probe_ok: int = 0
    second_sent: int = 0  # requests to the second cluster
    second_exact: int = 0
    race_sent: int = 0  # loan_race: requests whose prefix the prefill worker should borrow
    race_exact: int = 0
    loans_granted: int = 0  # over all loan_race firings, summed over the workers' lenders
    loans_confirmed: int = 0  # borrowers: the holder confirmed the blocks stayed pinned
    loans_stale: int = 0  # borrowers: the lease had ended (the prefix computed instead)
    checksum_mismatch: int = 0  # borrowers, kv_transport.verify: must be 0
    loans_not_cheaper: int = 0  # the prefill worker's cost model said computing was cheaper
    borrow_outcomes: dict = field(default_factory=dict)  # the prefill worker's borrows by outcome (read, timed_out, ...)
    details: list = field(default_factory=list)


@dataclass
class FaultContext:
    """What the client-side faults need from the load driver."""

    client: object  # pdserve.api.AsyncClient
    prompts: list  # (kind, token ids)
    refs: list  # greedy reference token ids, per prompt
    stats: ClientFaultStats
    rng: random.Random
    storm_size: int = 50
    storm_cut_s: float = 3.0
    reuse_pairs: int = 8
    max_tokens: int = 8
    poison_count: int = 4
    second_requests: int = 4
    work: object = None  # the run's directory (Path): the second cluster lives under it
    model_dir: str | None = None
    race_sets: list = field(default_factory=list)  # loan_race: one (pairs, flood) per firing (chaos.make_race_sets)
    lend_counters: object = None  # () -> the workers' loan counters, summed (chaos.Cluster.lend_counters)


def stop_prefill(pid: int, stop_s: float) -> str:
    """SIGSTOP `pid` for `stop_s` seconds, then SIGCONT (blocking: run it in an executor)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(stop_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    return f"SIGSTOP prefill worker pid {pid} for {stop_s:g} s, then SIGCONT"


async def abort_storm(ctx: FaultContext) -> str:
    async def one(i: int, cut_s: float):
        _, prompt = ctx.prompts[i % len(ctx.prompts)]
        stream = ctx.client.stream(prompt, max_tokens=400, temperature=0.0, ignore_eos=True, route="remote",
                                   priority="high", request_id=f"chaos-storm-{uuid.uuid4().hex[:8]}")
        task = asyncio.ensure_future(_consume(stream))
        await asyncio.sleep(cut_s)
        task.cancel()  # the client goes away; its RPC is cancelled
        await asyncio.gather(task, return_exceptions=True)

    cuts = [ctx.rng.uniform(0.0, ctx.storm_cut_s) for _ in range(ctx.storm_size)]
    before = await _probe_ttft_ms(ctx)
    await asyncio.gather(*(one(i, c) for i, c in enumerate(cuts)))
    after = await _probe_ttft_ms(ctx)
    ctx.stats.aborted += len(cuts)
    ctx.stats.storm_probe_ttft_ms.append((before, after))
    return (f"{len(cuts)} remote streams dropped by their clients within {ctx.storm_cut_s:g} s; another "
            f"client's short request TTFT {before:.0f} ms before, {after:.0f} ms right after")


async def _probe_ttft_ms(ctx: FaultContext) -> float:
    """TTFT of a short request of another client (local prefill by the router's choice)."""
    short = next(p for kind, p in ctx.prompts if kind == "short")
    t0, first = time.monotonic(), None
    async for msg in ctx.client.stream(short, max_tokens=2, temperature=0.0, ignore_eos=True):
        if msg.token_ids and first is None:
            first = time.monotonic()
    return ((first or time.monotonic()) - t0) * 1e3


async def reuse_ids(ctx: FaultContext) -> str:
    crossed0 = ctx.stats.crossed
    for _ in range(ctx.reuse_pairs):
        rid = f"chaos-reuse-{uuid.uuid4().hex[:8]}"
        i, j = ctx.rng.sample(range(len(ctx.prompts)), 2)
        first = ctx.client.stream(ctx.prompts[i][1], max_tokens=400, temperature=0.0, ignore_eos=True,
                                  request_id=rid)
        try:
            await asyncio.wait_for(first.__anext__(), 60)
        except Exception:  # noqa: BLE001  (a refusal or an error: the id is reused all the same)
            pass
        await first.aclose()  # the client leaves after the first token
        ctx.stats.reused += 1
        got, error = await _again(ctx, rid, ctx.prompts[j][1])
        if error is not None:
            ctx.stats.reuse_failed += 1
            ctx.stats.details.append(f"{rid}: {error}")
        elif got != ctx.refs[j]:
            ctx.stats.crossed += 1
            ctx.stats.details.append(f"{rid}: got {got[:8]}..., its own prompt gives {ctx.refs[j][:8]}...")
    return (f"{ctx.reuse_pairs} request ids reused right after a disconnect "
            f"({ctx.stats.crossed - crossed0} crossed)")


async def _again(ctx: FaultContext, rid: str, prompt: list[int]) -> tuple[list[int], str | None]:
    """The reused id's request: its tokens, or the error it ended with (ALREADY_EXISTS while
    the first request is torn down is retried for up to 10 s)."""
    import grpc

    deadline = time.monotonic() + 10.0
    while True:
        toks: list[int] = []
        try:
            async for msg in ctx.client.stream(prompt, max_tokens=ctx.max_tokens, temperature=0.0, ignore_eos=True,
                                               request_id=rid):
                toks += list(msg.token_ids)
                if msg.finish_reason and msg.finish_reason not in ("length", "stop"):
                    return toks, f"finish_reason {msg.finish_reason}"
            return toks, None
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() > deadline:
                return toks, f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(0.05)


async def _consume(stream) -> None:
    try:
        async for _ in stream:
            pass
    finally:
        await stream.aclose()


async def poison_request(ctx: FaultContext) -> str:
    import grpc

    from pdserve.common.failpoints import POISON_PREFIX
    from pdserve.api.ingress import ERROR_SCOPE_HEADER, REQUEST_SCOPE

    async def one(i: int) -> None:
        _, prompt = ctx.prompts[i % len(ctx.prompts)]
        ctx.stats.poison_sent += 1
        try:
            await ctx.client.generate(list(POISON_PREFIX) + list(prompt), max_tokens=ctx.max_tokens,
                                      temperature=0.0, ignore_eos=True, request_id=f"chaos-poison-{uuid.uuid4().hex[:8]}")
        except grpc.aio.AioRpcError as exc:
            scope = dict(exc.trailing_metadata() or ()).get(ERROR_SCOPE_HEADER)
            if exc.code() == grpc.StatusCode.INTERNAL and scope == REQUEST_SCOPE:
                ctx.stats.poison_returned += 1
                return
            ctx.stats.poison_other += 1
            ctx.stats.details.append(f"poison: {exc.code().name} (scope {scope}): {exc.details()[:200]}")
            return
        ctx.stats.poison_other += 1
        ctx.stats.details.append("poison: served, though every engine fails it")

    returned0 = ctx.stats.poison_returned
    await asyncio.gather(*(one(i) for i in range(ctx.poison_count)))
    ctx.stats.poison_probes += 1
    short = next(p for kind, p in ctx.prompts if kind == "short")
    try:
        await ctx.client.generate(short, max_tokens=2, temperature=0.0, ignore_eos=True)
        ctx.stats.poison_probe_ok += 1
        probe = "served"
    except Exception as exc:  # noqa: BLE001  (recorded: the finding this fault looks for)
        probe = f"refused: {exc}"
        ctx.stats.details.append(f"poison: the short request right after was {probe[:200]}")
    return (f"{ctx.poison_count} poison requests through the gateway, {ctx.stats.poison_returned - returned0} "
            f"returned as their own error; a short request right after {probe}")


async def second_cluster(ctx: FaultContext) -> str:
    return await asyncio.get_running_loop().run_in_executor(None, _second_cluster, ctx)


def _second_cluster(ctx: FaultContext) -> str:
    """`pdserve up` a one-decode-worker cluster of the same model beside the soak's, serve it,
    `pdserve down` it (subprocesses, as an operator would)."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from pdserve.api import Client

    name = f"chaos-second-{os.getpid()}-{ctx.stats.second_sent}"
    work = Path(ctx.work) / name
    work.mkdir(parents=True, exist_ok=True)
    topo = {"cluster": name, "model": {"path": str(ctx.model_dir)},
            "roles": {"prefill": {"replicas": 0},
                      "decode": {"replicas": 1, "resources": {"num_cpus": 0},
                                 "engine": {"device": "cpu", "kv_cache_memory_bytes": 33554432},
                                 "ports": {"grpc": 0, "http": 0}}},
            "etcd": {"lease_ttl_s": 3}, "ray": {"namespace": name}, "run_dir": str(work / "runs")}
    path = work / "topology.yaml"
    path.write_text(yaml.safe_dump(topo, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_FAILPOINTS"}  # a plain cluster

    def pdserve(*args):
        return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                              timeout=300, env=env)

    up = pdserve("up", "--topology", str(path))
    try:
        if up.returncode != 0:
            ctx.stats.details.append(f"second cluster: up failed: {(up.stdout + up.stderr)[-300:]}")
            return f"second cluster {name} did not start"
        state = json.loads((work / "runs" / f"{name}.state.json").read_text())
        target = state["actors"][0]["grpc"]
        exact = 0
        with Client(target) as c:
            for i in range(ctx.second_requests):
                _, prompt = ctx.prompts[i % len(ctx.prompts)]
                ctx.stats.second_sent += 1
                try:
                    out = c.generate(prompt, max_tokens=ctx.max_tokens, temperature=0.0, ignore_eos=True)
                except Exception as exc:  # noqa: BLE001  (recorded)
                    ctx.stats.details.append(f"second cluster: {exc}"[:300])
                    continue
                if out.token_ids == ctx.refs[i % len(ctx.prompts)]:
                    exact += 1
        ctx.stats.second_exact += exact
        return f"second cluster {name} up beside this one, {exact} of {ctx.second_requests} requests token-exact"
    finally:
        down = pdserve("down", "--topology", str(path))
        if down.returncode != 0:
            ctx.stats.details.append(f"second cluster: down failed: {(down.stdout + down.stderr)[-300:]}")


async def loan_race(ctx: FaultContext) -> str:
    if not ctx.race_sets:
        return "no race set left (chaos.make_race_sets sizes them by the fault schedule)"
    pairs, flood = ctx.race_sets.pop(0)
    loop = asyncio.get_running_loop()
    before = await loop.run_in_executor(None, ctx.lend_counters)

    async def exact(prompt, ref, route) -> bool:
        toks: list[int] = []
        try:
            async for msg in ctx.client.stream(prompt, max_tokens=ctx.max_tokens, temperature=0.0, ignore_eos=True,
                                               route=route, priority="high"):
                toks += list(msg.token_ids)
        except Exception as exc:  # noqa: BLE001  (recorded)
            ctx.stats.details.append(f"loan_race: {route}: {exc}"[:300])
            return False
        if toks != ref:
            ctx.stats.details.append(f"loan_race: {route} got {toks[:8]}..., its reference {list(ref)[:8]}...")
        return toks == ref

    await asyncio.gather(*(exact(a, ref_a, "local") for a, _, ref_a, _ in pairs))  # the holder caches them

    async def press(prompt) -> None:
        try:
            async for _ in ctx.client.stream(prompt, max_tokens=1, temperature=0.0, route="local"):
                pass
        except Exception:  # noqa: BLE001  (pressure only: a refusal is fine)
            pass

    # Half the loans beside the flood (the holder busy: leases may end before the borrower's
    # release, answered stale), half after it (a quiet holder: the loans complete, and with
    # kv_transport.verify every block they lend is checksummed).
    pressed, quiet = pairs[:len(pairs) // 2], pairs[len(pairs) // 2:]
    results = await asyncio.gather(*(exact(b, ref_b, "remote") for _, b, _, ref_b in pressed),
                                   *(press(p) for p in flood))
    results = list(results[:len(pressed)])
    results += await asyncio.gather(*(exact(b, ref_b, "remote") for _, b, _, ref_b in quiet))
    ok = sum(bool(r) for r in results)
    ctx.stats.race_sent += len(pairs)
    ctx.stats.race_exact += ok
    after = await loop.run_in_executor(None, ctx.lend_counters)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    granted, confirmed, stale, bad = (delta("lender.granted"), delta("borrower.confirmed"), delta("borrower.stale"),
                                      delta("borrower.checksum_mismatch"))
    ctx.stats.loans_granted += granted
    ctx.stats.loans_confirmed += confirmed
    ctx.stats.loans_stale += stale
    ctx.stats.checksum_mismatch += bad
    ctx.stats.loans_not_cheaper += delta("prefill_borrows.not_cheaper")
    outcomes = {k.split(".", 1)[1]: delta(k) for k in after if k.startswith("prefill_borrows.") and delta(k)}
    for k, v in outcomes.items():
        ctx.stats.borrow_outcomes[k] = ctx.stats.borrow_outcomes.get(k, 0) + v
    return (f"{len(pairs)} borrowed prefixes ({len(pressed)} beside {len(flood)} fresh local prompts, {len(quiet)} "
            f"after): {ok} token-exact; loans "
            f"granted {granted}, confirmed {confirmed}, stale {stale}, checksum mismatches {bad}; the prefill "
            f"worker's borrows by outcome {outcomes or '{}'}")
