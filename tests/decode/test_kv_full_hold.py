"""A prompt the KV pool cannot hold beside the running streams waits for room
(``qos.kv_full_wait_ms``) instead of being refused at once: served once a stream ends,
token-exact; refused with how long it waited when the wait runs out; refused at once with 0.
A real worker with a pool of 32 blocks of 16 tokens (512 slots)."""

from __future__ import annotations

import asyncio
import random

import grpc
import httpx
import pytest

from pdserve.api import AsyncClient
from pdserve.api.ingress import KV_WAIT_HEADER, kv_wait_of_metadata
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import WorkerThread

POLICY = """
qos:
  kv_full_wait_ms: {wait}
"""


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture
def small_pool(llama_dir, tmp_path):
    workers = []

    def start(wait_ms: float) -> WorkerThread:
        path = tmp_path / f"router-{wait_ms:g}.yaml"
        path.write_text(POLICY.format(wait=wait_ms))
        w = WorkerThread(DecodeWorkerConfig(
            model=llama_dir, router_policy=str(path), calibrate=False,
            engine_args={"num_gpu_blocks_override": 32, "block_size": 16, "max_model_len": 512})).start()
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop()


async def beside_a_long_stream(target: str, second: list[int], metadata=None):
    """A stream that takes most of the pool (a 400-token prompt, 100 tokens out), and once its
    first token is out, ``second`` (sent with ``metadata``): (the second's result or its error,
    the first's tokens)."""
    async with AsyncClient(target) as c, AsyncClient(target) as c2:
        c2._md = metadata  # per-call metadata, as a gateway sends it
        first_token = asyncio.Event()
        long_tokens: list[int] = []

        async def long():
            async for msg in c.stream(prompt(400, 1), max_tokens=100, temperature=0.0, ignore_eos=True,
                                      timeout_s=120):
                long_tokens.extend(msg.token_ids)
                if msg.token_ids:
                    first_token.set()

        task = asyncio.ensure_future(long())
        await asyncio.wait_for(first_token.wait(), 60)
        try:
            out = await c2.generate(second, max_tokens=8, temperature=0.0, ignore_eos=True, timeout_s=120)
        except grpc.aio.AioRpcError as exc:
            out = exc
        await asyncio.wait_for(task, 120)
        return out, long_tokens


def test_a_prompt_without_room_waits_for_the_stream_and_is_served_exactly(small_pool):
    w = small_pool(60_000)
    second = prompt(150, 2)
    out, long_tokens = asyncio.run(beside_a_long_stream(w.grpc, second))
    assert not isinstance(out, grpc.aio.AioRpcError), f"refused instead of held: {out}"
    assert len(long_tokens) == 100, "the running stream was cut short"

    async def alone():
        async with AsyncClient(w.grpc) as c:
            return await c.generate(second, max_tokens=8, temperature=0.0, ignore_eos=True, timeout_s=120)

    assert out.token_ids == asyncio.run(alone()).token_ids
    text = httpx.get(f"{w.http}/metrics", timeout=10).text
    held = [line for line in text.splitlines() if line.startswith("pdserve_admission_held_for_kv_seconds_count")]
    assert held and float(held[0].split()[-1]) == 1, held
    assert 'reason="kv_pool_full"' not in "".join(
        line for line in text.splitlines() if line.startswith("pdserve_admissions_refused_total"))


def test_when_the_wait_runs_out_the_refusal_says_how_long_it_waited(small_pool):
    w = small_pool(1)
    out, long_tokens = asyncio.run(beside_a_long_stream(w.grpc, prompt(150, 2)))
    assert isinstance(out, grpc.aio.AioRpcError) and out.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV pool" in out.details() and "qos.kv_full_wait_ms 1" in out.details()
    assert len(long_tokens) == 100


def test_zero_refuses_at_once(small_pool):
    w = small_pool(0)
    out, _ = asyncio.run(beside_a_long_stream(w.grpc, prompt(150, 2)))
    assert isinstance(out, grpc.aio.AioRpcError) and out.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waited" not in out.details()


def test_a_caller_with_somewhere_else_to_go_asks_for_no_hold(small_pool):
    """A gateway with another worker to ask sends x-pdserve-kv-full-wait-ms: 0 and gets the
    refusal at once, though the policy would hold the prompt for a minute."""
    w = small_pool(60_000)
    out, _ = asyncio.run(beside_a_long_stream(w.grpc, prompt(150, 2), ((KV_WAIT_HEADER, "0"),)))
    assert isinstance(out, grpc.aio.AioRpcError) and out.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waited" not in out.details()


def test_the_wait_header_is_read_as_a_non_negative_number_or_ignored():
    assert kv_wait_of_metadata(((KV_WAIT_HEADER, "0"),)) == 0.0
    assert kv_wait_of_metadata((("other", "1"), (KV_WAIT_HEADER, "250.5"))) == 250.5
    assert kv_wait_of_metadata(((KV_WAIT_HEADER, "soon"),)) is None
    assert kv_wait_of_metadata(((KV_WAIT_HEADER, "-5"),)) is None
    assert kv_wait_of_metadata(None) is None


def test_a_second_request_with_the_label_of_one_held_for_room_is_refused_not_admitted(small_pool):
    """The request_id check reserves the label before the hold (an await): a second request with
    the same id, sent while the first waits for KV room, gets ALREADY_EXISTS at once; the first
    is then served. (Before, both passed the check and both were admitted.)"""
    w = small_pool(60_000)

    async def run():
        async with AsyncClient(w.grpc) as c, AsyncClient(w.grpc) as c2, AsyncClient(w.grpc) as c3:
            first_token = asyncio.Event()

            async def long():
                async for msg in c.stream(prompt(400, 1), max_tokens=100, temperature=0.0, ignore_eos=True,
                                          timeout_s=120):
                    if msg.token_ids:
                        first_token.set()

            task = asyncio.ensure_future(long())
            await asyncio.wait_for(first_token.wait(), 60)
            held = asyncio.ensure_future(c2.generate(prompt(150, 2), max_tokens=8, temperature=0.0,
                                                     ignore_eos=True, timeout_s=120, request_id="dup"))

            deadline = asyncio.get_running_loop().time() + 30
            while not w.worker.frontend._kv_waiters:  # the first waits for room (read across threads: a list)
                assert asyncio.get_running_loop().time() < deadline, "the first request was never held"
                await asyncio.sleep(0.02)
            try:
                second = await c3.generate(prompt(150, 3), max_tokens=8, temperature=0.0, ignore_eos=True,
                                           timeout_s=120, request_id="dup")
            except grpc.aio.AioRpcError as exc:
                second = exc
            first = await asyncio.wait_for(held, 120)
            await asyncio.wait_for(task, 120)
            return first, second

    first, second = asyncio.run(run())
    assert isinstance(second, grpc.aio.AioRpcError), f"admitted beside the held request: {second}"
    assert second.code() == grpc.StatusCode.ALREADY_EXISTS and second.details().startswith("request_id: ")
    assert len(first.token_ids) == 8
    assert not w.worker.frontend._labels_admitting and not w.worker.frontend.inflight
