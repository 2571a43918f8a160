"""The gateway in front of several decode workers, on a real etcd: it serves both APIs
unchanged, explains its picks, moves a stream whose worker dies to another worker
token-exact, and asks another worker when one refuses."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from pdserve.api import AsyncClient, Client
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.gateway.server import GatewayConfig
from tests.harness import PERMISSIVE_POLICY, GatewayThread, WorkerThread, wait_until

CLUSTER = "gw-test"


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw")
    policy = tmp / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    with EmbeddedEtcd(tmp / "etcd") as etcd:
        workers, gw = [], None
        try:
            for i in range(3):
                cfg = DecodeWorkerConfig(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER,
                                         lease_ttl_s=3, worker_id=f"decode-{i}", router_policy=str(policy),
                                         load_report_s=0.5)
                workers.append(WorkerThread(cfg).start())
            gw = GatewayThread(GatewayConfig([etcd.endpoint], CLUSTER, model=llama_dir, seed=0)).start()
            wait_until(lambda: len(gw.gateway.backends.workers) == 3, 20)
            yield etcd, workers, gw
        finally:
            if gw is not None:
                gw.stop()
            for w in workers:
                w.stop()


def prompt(n=40, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


def no_leaks(workers):
    for w in workers:
        eng = w.worker.engine
        wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 15)


def test_both_apis_through_the_gateway_equal_a_worker_called_directly(cluster):
    _, workers, gw = cluster
    ids = prompt(seed=1)
    with Client(workers[0].grpc) as direct, Client(gw.gateway.grpc_address) as via:
        want = direct.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True)
        got = via.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert via.list_models()[0]["id"] == direct.list_models()[0]["id"]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.breakdown["worker_id"] in {"decode-0", "decode-1", "decode-2"}
    assert got.breakdown["migrations"] == 0 and got.breakdown["completion_tokens"] == 12
    with httpx.Client(base_url=f"http://{gw.gateway.http_address}", timeout=60) as h:
        r = h.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        bad = h.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 0})
        assert bad.status_code == 400 and "max_tokens" in bad.text
        assert h.get("/health").json()["status"] == "ok"
        assert b"pdserve_gateway_routed_total{" in h.get("/metrics").content
        ex = h.post("/gateway/explain", json={"prompt": "Hello there"}).json()
        assert ex["chosen"] in {"decode-0", "decode-1", "decode-2"}
        assert {s["worker_id"] for s in ex["scores"]} == {"decode-0", "decode-1", "decode-2"}
        assert all(s["ttft_ms"] >= 0 and "rate_ms" in s for s in ex["scores"])
    no_leaks(workers)


def test_the_official_openai_sdk_through_the_gateway_equals_a_worker(cluster):
    from openai import BadRequestError, OpenAI

    _, workers, gw = cluster
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]
    outs = []
    for base in (workers[1].http, f"http://{gw.gateway.http_address}"):
        with OpenAI(base_url=f"{base}/v1", api_key="not-used", max_retries=0, timeout=120) as sdk:
            model = sdk.models.list().data[0].id
            whole = sdk.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0)
            stream = sdk.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            many = sdk.completions.create(model=model, prompt=["first prompt", "second one"], max_tokens=3, n=2,
                                          temperature=1.0, seed=5)
            with pytest.raises(BadRequestError) as ei:
                sdk.completions.create(model=model, prompt="hi", max_tokens=3, temperature=-1)
            outs.append((whole.choices[0].message.content, text, chunks[-1].usage.completion_tokens,
                         [c.text for c in many.choices], ei.value.body.get("param")))
    assert outs[0] == outs[1]
    assert outs[1][0] == outs[1][1] and outs[1][4] == "temperature"
    no_leaks(workers)


def test_a_client_that_leaves_mid_stream_frees_its_blocks_on_the_worker(cluster):
    _, workers, gw = cluster

    async def leave():
        async with AsyncClient(gw.gateway.grpc_address) as c:
            got = 0
            async for msg in c.stream(prompt(seed=77), max_tokens=200, ignore_eos=True, temperature=0.0):
                got += len(msg.token_ids)
                if got >= 3:
                    break  # closes the call: the gateway's stream, then the worker's
        return got

    assert asyncio.run(leave()) >= 3
    wait_until(lambda: not gw.gateway.frontend.streams, 10)
    no_leaks(workers)


def test_a_raced_request_streams_the_winner_only_and_frees_the_loser(cluster):
    """Racing on (every request may race), a target the best prediction puts at risk: each
    request runs on two workers; the client gets one stream equal to a direct run, usage counts
    it once, and the loser's worker holds nothing afterwards."""
    _, workers, gw = cluster
    fe = gw.gateway.frontend
    fe.race_fraction, fe.race_risk = 1.0, 1e-6
    try:
        with Client(workers[0].grpc) as direct, Client(gw.gateway.grpc_address) as via:
            for i in range(4):
                ids = prompt(seed=200 + i)
                want = direct.generate(ids, max_tokens=10, temperature=0.0, ignore_eos=True)
                got = via.generate(ids, max_tokens=10, temperature=0.0, ignore_eos=True, ttft_slo_ms=1000.0)
                assert got.token_ids == want.token_ids and got.breakdown["completion_tokens"] == 10
            plain = via.generate(prompt(seed=300), max_tokens=4, temperature=0.0)  # no target: never raced
            assert plain.finish_reason == "length"
        with httpx.Client(base_url=f"http://{gw.gateway.http_address}", timeout=30) as h:
            text = h.get("/metrics").text
        won = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("pdserve_gateway_races_total{") and 'outcome="won_' in line)
        assert won == 4
        assert "pdserve_gateway_race_wasted_prompt_tokens_total" in text
        no_leaks(workers)
    finally:
        fe.race_fraction, fe.race_risk = 0.0, 0.5


def test_a_stream_whose_worker_dies_continues_token_exact_on_another(cluster):
    """Streams on one worker, its gRPC server killed mid-stream: every one completes through
    the gateway with the tokens of an undisturbed run (greedy and seeded)."""
    _, workers, gw = cluster
    target = gw.gateway.grpc_address
    cases = [(prompt(seed=10 + i), dict(temperature=0.0) if i % 2 else dict(temperature=0.8, seed=i))
             for i in range(6)]

    async def run_all(victim=None):
        async with AsyncClient(target) as c:
            async def one(ids, sampling):
                toks, finish, b = [], None, None
                async for msg in c.stream(ids, max_tokens=40, ignore_eos=True, **sampling):
                    toks += msg.token_ids
                    finish = msg.finish_reason or finish
                    if msg.HasField("breakdown"):
                        b = msg.breakdown
                return toks, finish, b

            tasks = [asyncio.ensure_future(one(ids, s)) for ids, s in cases]
            if victim is not None:
                await asyncio.sleep(0)
                await victim()
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    undisturbed = asyncio.run(run_all())
    assert all(f == "length" and len(t) == 40 for t, f, _ in undisturbed)
    # Every stream on one worker: the others are avoided for the run's length.
    doomed = workers[2]
    for w in ("decode-0", "decode-1"):
        gw.gateway.backends.workers[w].avoid_until = float("inf")

    async def kill():
        wait = asyncio.get_running_loop().time() + 30
        while doomed.worker.frontend.num_decoding < len(cases) and asyncio.get_running_loop().time() < wait:
            await asyncio.sleep(0.01)
        for w in ("decode-0", "decode-1"):
            gw.gateway.backends.workers[w].avoid_until = 0.0
        asyncio.run_coroutine_threadsafe(doomed.worker.grpc.server.stop(0), doomed.loop).result(10)

    moved = asyncio.run(run_all(kill))
    for (want, _, _), (got, finish, b) in zip(undisturbed, moved):
        assert finish == "length" and got == want
        assert b.migrations == 1 and b.worker_id in {"decode-0", "decode-1"} and b.completion_tokens == 40
    no_leaks(workers[:2])

