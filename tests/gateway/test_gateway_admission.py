"""Admission with the cluster view: a worker that refuses a request (QoS) is not the end of
it; the gateway asks another, and refuses only when every worker refused (429 / RESOURCE_EXHAUSTED
with the prediction)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from pdserve.api import AsyncClient
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.gateway.server import GatewayConfig
from tests.harness import PERMISSIVE_POLICY, GatewayThread, WorkerThread, wait_until

REFUSE_LOW = """
qos:
  low_priority_threshold_ms: 0.001
"""


@pytest.fixture(scope="module")
def pair(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwa")
    (tmp / "refuse.yaml").write_text(REFUSE_LOW)
    (tmp / "open.yaml").write_text(PERMISSIVE_POLICY)
    with EmbeddedEtcd(tmp / "etcd") as etcd:
        workers, gw = [], None
        try:
            for wid, pol in (("decode-busy", "refuse.yaml"), ("decode-idle", "open.yaml")):
                workers.append(WorkerThread(DecodeWorkerConfig(
                    model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster="gwa", lease_ttl_s=3, worker_id=wid,
                    router_policy=str(tmp / pol))).start())
            gw = GatewayThread(GatewayConfig([etcd.endpoint], "gwa", model=llama_dir, seed=1)).start()
            wait_until(lambda: len(gw.gateway.backends.workers) == 2, 20)
            yield workers, gw
        finally:
            if gw is not None:
                gw.stop()
            for w in workers:
                w.stop()


def test_a_worker_that_refuses_sends_the_request_to_another(pair):
    _, gw = pair
    idle = gw.gateway.backends.workers["decode-idle"]
    idle.queued_tokens += 100_000  # a long queue as far as the gateway knows: the busy worker is the first pick

    async def run():
        async with AsyncClient(gw.gateway.grpc_address) as c:
            return await asyncio.gather(*(c.generate(f"question number {i}", max_tokens=3, priority="low")
                                          for i in range(12)))

    try:
        outs = asyncio.run(run())
    finally:
        idle.queued_tokens -= 100_000
    assert all(o.finish_reason == "length" and o.breakdown["worker_id"] == "decode-idle" for o in outs)
    with httpx.Client(base_url=f"http://{gw.gateway.http_address}", timeout=30) as h:
        text = h.get("/metrics").text
    retried = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith('pdserve_gateway_retries_total{') and 'code="resource_exhausted"' in line)
    routed_busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("pdserve_gateway_routed_total{") and "decode-busy" in line)
    assert retried == routed_busy == 12  # each went to the busy worker first, was refused there, then served


def test_when_every_worker_refuses_the_client_gets_the_refusal(pair):
    _, gw = pair
    gw.gateway.backends.workers["decode-idle"].avoid_until = float("inf")
    try:
        async def run():
            async with AsyncClient(gw.gateway.grpc_address) as c:
                await c.generate("hello", max_tokens=3, priority="low")

        with pytest.raises(grpc.aio.AioRpcError) as ei:
            asyncio.run(run())
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "predicted TTFT" in ei.value.details()
        assert any(k == "retry-after-ms" for k, _ in ei.value.trailing_metadata())
        with httpx.Client(base_url=f"http://{gw.gateway.http_address}", timeout=30) as h:
            r = h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "priority": "low"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    finally:
        gw.gateway.backends.workers["decode-idle"].avoid_until = 0.0


def test_a_worker_with_another_behind_it_is_asked_not_to_hold_the_prompt_for_kv_room(pair, monkeypatch):
    """A decode worker holds a prompt its full KV pool cannot take (qos.kv_full_wait_ms) before
    refusing it; with another worker to ask, the gateway wants the refusal at once (metadata
    x-pdserve-kv-full-wait-ms: 0). The last worker it can ask holds as its policy says."""
    workers, gw = pair
    seen = []
    for w in workers:
        fe = w.worker.frontend
        real = fe.prepare

        async def spy(inp, real=real, wid=w.worker.worker_id):
            seen.append((wid, inp.kv_full_wait_ms))
            return await real(inp)

        monkeypatch.setattr(fe, "prepare", spy)
    idle = gw.gateway.backends.workers["decode-idle"]
    idle.queued_tokens += 100_000  # the busy worker is the first pick, and refuses low priority

    async def run():
        async with AsyncClient(gw.gateway.grpc_address) as c:
            return await c.generate("a question", max_tokens=3, priority="low")

    try:
        out = asyncio.run(run())
    finally:
        idle.queued_tokens -= 100_000
    assert out.breakdown["worker_id"] == "decode-idle"
    assert seen == [("decode-busy", 0.0), ("decode-idle", None)]
