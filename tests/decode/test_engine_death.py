"""An engine that cannot step is visible everywhere: gRPC health NOT_SERVING, /health 503,
`pdserve_engine_alive 0`, the worker leaves etcd, new requests get UNAVAILABLE; with
`exit_on_engine_death` the process exits so that its supervisor restarts it."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.cluster.registry import Registry
from pdserve.decode import worker as worker_module
from pdserve.decode.async_engine import MAX_CONSECUTIVE_STEP_FAILURES
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import WorkerThread, wait_until


def members(endpoint: str, cluster: str) -> dict:
    async def read():
        async with Registry([endpoint], cluster) as reg:
            return await reg.members(role="decode")
    return asyncio.run(read())


def health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Inference"), timeout=10).status


@pytest.mark.parametrize("exit_on_death", [False, True])
def test_dead_engine_is_visible_and_leaves_the_registry(llama_dir, tmp_path, monkeypatch, exit_on_death):
    exits = []
    monkeypatch.setattr(worker_module.os, "_exit", exits.append)  # record the exit instead of dying
    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        cluster = f"death-{int(exit_on_death)}"
        cfg = DecodeWorkerConfig(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=cluster,
                                 lease_ttl_s=3, worker_id="decode-dies", exit_on_engine_death=exit_on_death)
        w = WorkerThread(cfg).start()
        try:
            assert "decode-dies" in members(etcd.endpoint, cluster)
            with httpx.Client(base_url=w.http, timeout=60) as h:
                assert h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200

                def broken(*args):
                    raise RuntimeError("injected device failure")

                monkeypatch.setattr(w.worker.engine.runner, "execute", broken)
                # Each request fails its own step with a typed error; the engine keeps
                # trying until MAX_CONSECUTIVE_STEP_FAILURES steps in a row have failed.
                for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
                    r = h.post("/v1/completions", json={"prompt": f"try {i}", "max_tokens": 2})
                    assert r.status_code in (500, 503), r.text
                    assert "injected device failure" in r.json()["error"]["message"] or r.status_code == 503
                wait_until(lambda: not w.worker.async_engine.alive, 10)
                r = h.get("/health")
                assert r.status_code == 503 and "engine is not running" in r.json()["error"]["message"]
                wait_until(lambda: health(w.grpc) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
                assert 'pdserve_engine_alive{role="decode",worker_id="decode-dies"} 0.0' in h.get("/metrics").text
                wait_until(lambda: "decode-dies" not in members(etcd.endpoint, cluster), 10)
                r = h.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
                assert r.status_code == 503 and "retry on another decode worker" in r.json()["error"]["message"]
                with pytest.raises(grpc.RpcError) as info:
                    with grpc.insecure_channel(w.grpc) as ch:
                        from pdserve.api.v1 import inference_pb2 as pb
                        gen = ch.unary_stream("/pdserve.v1.Inference/Generate",
                                              request_serializer=pb.GenerateRequest.SerializeToString,
                                              response_deserializer=pb.GenerateResponse.FromString)
                        list(gen(pb.GenerateRequest(text="after"), timeout=10))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            if exit_on_death:
                wait_until(lambda: exits == [70], 10)
            else:
                assert exits == []
        finally:
            w.stop()
