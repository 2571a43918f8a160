"""A decode worker survives every bad request: typed 4xx / INVALID_ARGUMENT naming the
field, no 5xx, no dead engine, no leaked block; an injected failure inside a running
batch fails that request only; sizes are refused before the work they bound."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import threading

import grpc
import httpx
import pytest

from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.api import AsyncClient
from pdserve.api.v1 import inference_pb2 as pb
from pdserve.engine import LLM, SamplingParams

from tests.harness import wait_until

FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.fixture(scope="module")
def reference(llama_dir):
    prompts = [[random.Random(i).randrange(3, 32000) for _ in range(n)] for i, n in enumerate((7, 30, 64, 15))]
    outs = LLM(llama_dir, max_model_len=512).generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                                              ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


def assert_healthy_and_exact(worker, reference):
    """The worker still serves, token-exact, and holds no request or block."""
    prompts, ref = reference
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        assert h.get("/health").status_code == 200
        r = h.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref[0]
    eng = worker.worker.engine
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 15.0)
    assert worker.worker.async_engine.alive


def grpc_health(target: str, service: str = "pdserve.v1.Inference"):
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def post_raw(h, path: str, body: str, **kw):
    return h.post(path, content=body.encode("utf-8", "surrogatepass"),
                  headers={"content-type": "application/json"}, **kw)


# -- HTTP -------------------------------------------------------------------------------
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_http_non_finite_numbers_are_400_naming_the_field(worker, reference, literal, path):
    base = '"prompt": "hi"' if path == "/v1/completions" else '"messages": [{"role": "user", "content": "hi"}]'
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        for name in FLOAT_FIELDS + ("ttft_slo_ms",):
            r = post_raw(h, path, f'{{{base}, "{name}": {literal}}}')
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == name
    assert_healthy_and_exact(worker, reference)


@pytest.mark.parametrize("route", ["auto", "local"])
def test_http_tiny_values_are_served(worker, reference, route):
    prompts, ref = reference
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        r = h.post("/v1/completions", json={"prompt": prompts[1], "max_tokens": 12, "temperature": 1e-40,
                                            "ignore_eos": True, "route": route})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref[1]  # tiny temperature = greedy
        for body in ({"repetition_penalty": 1e-40, "temperature": 1.0, "seed": 1},
                     {"repetition_penalty": 1e-40}, {"top_p": 1e-40, "temperature": 1.0}):
            r = h.post("/v1/completions", json={"prompt": prompts[1], "max_tokens": 5, "route": route, **body})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert_healthy_and_exact(worker, reference)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "7"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 7.5}, "max_tokens"),
    ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": "hi", "stop": ["s"] * 100_000}, "stop"),
    ({"prompt": "hi", "stop": "s" * 5000}, "stop"),
    ({"prompt": "hi", "stop_token_ids": list(range(10_000))}, "stop_token_ids"),
    ({"prompt": "hi", "request_id": "x" * 300}, "request_id"),
    ({"prompt": "hi", "request_id": "bad id\n"}, "request_id"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 10**6}, "n"),
])
def test_http_bad_parameters_are_400_naming_the_field(worker, body, param):
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_chat_seed_overflow_and_lone_surrogates_are_400(worker, reference):
    msgs = '[{"role": "user", "content": "hi"}]'
    cases = [
        ("/v1/chat/completions", f'{{"messages": {msgs}, "seed": -9223372036854775809}}', "seed"),
        ("/v1/completions", '{"prompt": "x\\ud800y"}', "prompt"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\udfff"]}', "stop"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content"),
    ]
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        for path, body, param in cases:
            r = post_raw(h, path, body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param
    assert_healthy_and_exact(worker, reference)


def test_oversized_body_is_413_before_parsing(worker, reference):
    limit = worker.worker.frontend.limits.max_body_bytes
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        big = json.dumps({"prompt": "a" * (limit + 10)})
        r = h.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["param"] == "body"

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(limit // 65536 + 2):
                yield b"a" * 65536

        r = h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
    assert_healthy_and_exact(worker, reference)


def test_prompt_over_the_character_bound_is_refused_without_tokenizing(worker, reference, monkeypatch):
    fe = worker.worker.frontend
    calls = []
    tok = fe.engine.engine.tokenizer
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        r = h.post("/v1/completions", json={"prompt": "a" * (fe.max_prompt_chars + 1)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "characters" in r.json()["error"]["message"]
        r = h.post("/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "b" * (fe.max_prompt_chars + 1)}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
        many = [{"role": "user", "content": "b" * (fe.max_prompt_chars // 2 + 1)}] * 2  # the bound is on the total
        r = h.post("/v1/chat/completions", json={"messages": many})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert calls == []
    monkeypatch.undo()
    assert_healthy_and_exact(worker, reference)


def test_huge_header_is_431(worker):
    host, port = worker.worker.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 431"), head[:80]


def test_tokenization_never_blocks_the_event_loop(worker, reference, monkeypatch):
    """While a prompt is being tokenized (held here on an event), /health and gRPC
    health answer and a token-id request (no tokenizer) streams to its end."""
    tok = worker.worker.frontend.engine.engine.tokenizer
    encode = tok.encode
    entered, release = threading.Event(), threading.Event()

    def slow_encode(*a, **k):
        entered.set()
        assert release.wait(30)
        return encode(*a, **k)

    monkeypatch.setattr(tok, "encode", slow_encode)
    prompts, ref = reference
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        box = {}
        t = threading.Thread(target=lambda: box.update(r=h.post("/v1/completions", json={
            "prompt": "some text to tokenize", "max_tokens": 2})))
        t.start()
        try:
            assert entered.wait(30)
            with httpx.Client(base_url=worker.http, timeout=10) as h2:
                assert h2.get("/health").status_code == 200
                r = h2.post("/v1/completions", json={"prompt": prompts[2], "max_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True})
                assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref[2]
            assert grpc_health(worker.grpc) == health_pb2.HealthCheckResponse.SERVING
        finally:
            release.set()
            t.join(60)
        assert box["r"].status_code == 200
    monkeypatch.undo()


# -- gRPC ----------------------------------------------------------------------------------
def test_grpc_non_finite_and_tiny_numbers(worker, reference):
    prompts, ref = reference
    with grpc.insecure_channel(worker.grpc) as ch:
        gen = ch.unary_stream("/pdserve.v1.Inference/Generate", request_serializer=pb.GenerateRequest.SerializeToString,
                              response_deserializer=pb.GenerateResponse.FromString)
        for name in FLOAT_FIELDS:
            for value in (math.nan, math.inf, -math.inf):
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[0]),
                                         sampling=pb.SamplingParams(**{name: value}))
                with pytest.raises(grpc.RpcError) as info:
                    list(gen(req, timeout=30))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, value)
                assert name in info.value.details()
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[3]),
                                 sampling=pb.SamplingParams(max_tokens=12, temperature=1e-40, ignore_eos=True))
        assert [t for m in gen(req, timeout=60) for t in m.token_ids] == ref[3]
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[3]), sampling=pb.SamplingParams(
            max_tokens=4, temperature=1.0, repetition_penalty=1e-40))
        assert sum(len(m.token_ids) for m in gen(req, timeout=60)) == 4
    assert_healthy_and_exact(worker, reference)


def test_grpc_undecodable_bytes_are_invalid_argument(worker, reference):
    with grpc.insecure_channel(worker.grpc) as ch:
        raw_stream = ch.unary_stream("/pdserve.v1.Inference/Generate")
        raw_unary = ch.unary_unary("/pdserve.v1.Inference/Abort")
        garbage = [b"\xff\xff\xff\xff", b"\x0a\x05\xff\xfe\xfd\xfc\xfb"]  # bad varint; invalid UTF-8 text
        for body in garbage:
            with pytest.raises(grpc.RpcError) as info:
                list(raw_stream(body, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            with pytest.raises(grpc.RpcError) as info:
                raw_unary(body, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_healthy_and_exact(worker, reference)


# -- a failure inside a running batch ------------------------------------------------------
def test_injected_failure_in_a_running_batch_fails_one_stream_only(worker, reference):
    """Four streams run batched; one request's detokenizer raises mid-stream. That stream
    ends with a typed error (gRPC INTERNAL naming the failure), the other three complete
    token-exact, and the engine keeps stepping."""
    prompts, ref = reference
    eng = worker.worker.engine
    victim = "victim-stream"

    def sabotage(engine):
        detok = engine._detok[worker.worker.frontend.engine_id(victim)]

        def push(token_id, stops_on=True):
            raise TypeError("injected detokenizer failure")
        detok.push = push

    async def run():
        async with AsyncClient(worker.grpc) as c:
            async def one(i):
                rid = victim if i == 1 else f"ok-{i}"
                toks = []
                try:
                    async for m in c.stream(prompts[i], max_tokens=12, temperature=0.0, ignore_eos=True,
                                            request_id=rid):
                        toks += list(m.token_ids)
                        if rid == victim and len(toks) == 3:
                            worker.worker.async_engine.call(sabotage)
                    return toks
                except grpc.aio.AioRpcError as exc:
                    return exc
            return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(run())
    err = results[1]
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INTERNAL
    assert "injected detokenizer failure" in err.details()
    for i in (0, 2, 3):
        assert results[i] == ref[i]
    assert eng.stats.num_failed >= 1
    assert_healthy_and_exact(worker, reference)
