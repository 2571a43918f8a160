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
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from dataclasses import dataclass, field

ASYNC_FAULTS = ("abort_storm", "reuse_ids")


@dataclass
class ClientFaultStats:
    """What the client-side faults did, for the report."""

    aborted: int = 0  # streams dropped on purpose by abort_storm
    reused: int = 0  # ids sent again by reuse_ids
    crossed: int = 0  # a reused id answered with tokens that are not its own prompt's: must be 0
    reuse_failed: int = 0  # a reused id that ended in an error (typed errors included)
    # another client's short request just before a storm and right after its last drop (ms)
    storm_probe_ttft_ms: list = field(default_factory=list)  # [(before, after), ...]
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
