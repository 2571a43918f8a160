"""A client's request_id is a label, never the engine's key (issue: hardening).

A client that leaves and sends the same id again while the engine has not yet torn
the old sequence down must get its own prompt's tokens: never the old sequence's next
token, never its abort, never a 5xx. The engine thread is held on a gate while the old
stream is cut and the new one admitted, so the old sequence is guaranteed to be still
alive when the id comes back (the window the leak needed)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import httpx
import pytest

from pdserve.api import AsyncClient, Client
from pdserve.engine import LLM, SamplingParams

from tests.harness import wait_until

OLD_PROMPT = "The old request talks about a long and winding road"
NEW_PROMPTS = {"same prompt": OLD_PROMPT, "other prompt": "A completely different question about rivers"}


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, max_model_len=512)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return {p: llm.generate([p], params)[0].token_ids for p in set(NEW_PROMPTS.values())}


class Gate:
    """Holds the engine thread (a posted call that waits) until opened."""

    def __init__(self, worker):
        self.entered, self.opened = threading.Event(), threading.Event()
        worker.worker.async_engine.call(self._hold)
        assert self.entered.wait(10.0), "the engine thread never ran the gate"

    def _hold(self, _engine):
        self.entered.set()
        self.opened.wait(30.0)

    def open(self):
        self.opened.set()


def _blocks_back(worker):
    eng = worker.worker.engine
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 15.0)


async def _grpc_retrying(c: AsyncClient, prompt: str, rid: str) -> list:
    """The new request: an ALREADY_EXISTS (the old one not yet released) is retried."""
    deadline = time.monotonic() + 10.0
    while True:
        try:
            return [m async for m in c.stream(prompt, max_tokens=8, temperature=0.0, ignore_eos=True,
                                              request_id=rid)]
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("which", sorted(NEW_PROMPTS))
def test_grpc_id_reused_after_a_disconnect_gets_its_own_tokens(worker, reference, which):
    rid = f"reused-grpc-{which.replace(' ', '-')}"

    async def run():
        async with AsyncClient(worker.grpc) as old:
            agen = old.stream(OLD_PROMPT, max_tokens=400, temperature=0.0, ignore_eos=True, request_id=rid)
            async for _ in agen:
                break
            gate = Gate(worker)  # the old sequence is alive and cannot be aborted yet
            await agen.aclose()
        try:
            async with AsyncClient(worker.grpc) as new:
                task = asyncio.ensure_future(_grpc_retrying(new, NEW_PROMPTS[which], rid))
                await asyncio.sleep(0.3)  # admitted while the engine still holds the old sequence
                gate.open()
                return await asyncio.wait_for(task, 60.0)
        finally:
            gate.open()

    msgs = asyncio.run(run())
    assert [t for m in msgs for t in m.token_ids] == reference[NEW_PROMPTS[which]]
    assert msgs[-1].finish_reason == "length"
    _blocks_back(worker)


def test_http_id_reused_after_a_disconnect_gets_its_own_tokens(worker, reference):
    rid, prompt = "reused-http", NEW_PROMPTS["other prompt"]
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json={"prompt": OLD_PROMPT, "max_tokens": 400, "stream": True,
                                                        "ignore_eos": True, "request_id": rid}) as r:
            next(r.iter_lines())
            gate = Gate(worker)
        try:
            deadline = time.monotonic() + 10.0  # 409 until the worker has seen the old stream go
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "request_id": rid}

            async def post():
                async with httpx.AsyncClient(base_url=worker.http, timeout=60) as c:
                    while True:
                        r = await c.post("/v1/completions", json=body)
                        if r.status_code != 409 or time.monotonic() > deadline:
                            return r
                        await asyncio.sleep(0.02)

            async def run():
                task = asyncio.ensure_future(post())
                await asyncio.sleep(0.3)
                gate.open()
                return await task

            r = asyncio.run(run())
        finally:
            gate.open()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == reference[prompt] and choice["finish_reason"] == "length"
    _blocks_back(worker)


def test_an_id_in_flight_is_refused_with_already_exists(worker):
    with Client(worker.grpc) as c:
        stream = c.stream("Busy with a long answer", max_tokens=400, temperature=0.0, ignore_eos=True,
                          request_id="twice")
        assert next(stream).token_ids
        with pytest.raises(grpc.RpcError) as exc:
            c.generate("again", max_tokens=2, request_id="twice")
        assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert exc.value.details().startswith("request_id: ")
        with httpx.Client(base_url=worker.http, timeout=60) as h:
            r = h.post("/v1/completions", json={"prompt": "again", "max_tokens": 2, "request_id": "twice"})
        assert r.status_code == 409 and r.json()["error"]["param"] == "request_id"
        assert c.abort("twice")
        assert list(stream)[-1].finish_reason == "abort"
    _blocks_back(worker)
