"""A decode worker whose engine dies leaves etcd, exits, and is restarted by Ray; the new
process registers again and serves token-exact. The actor is created as the launcher
creates it (restartable, max_restarts, exit_on_engine_death)."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import ray

from pdserve.api import AsyncClient
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.cluster.registry import Registry
from pdserve.decode.async_engine import MAX_CONSECUTIVE_STEP_FAILURES
from pdserve.decode.worker import DecodeWorker
from pdserve.engine import LLM, SamplingParams
from pdserve.launcher import restartable, worker_actor_options
from tests.harness import start_local_ray, wait_until

pytestmark = pytest.mark.timeout(600)

CLUSTER = "e2e-decode-restart"
NAMESPACE = "pdserve-e2e-decode-restart"


def registered(endpoint: str) -> dict:
    async def read():
        async with Registry([endpoint], CLUSTER) as reg:
            return await reg.members("decode")
    return asyncio.run(asyncio.wait_for(read(), 10))


def break_engine(worker) -> None:
    """Runs inside the actor: every forward pass fails from now on."""
    def broken(*args, **kwargs):
        raise RuntimeError("injected: device lost")
    worker.engine.runner.execute = broken


def test_a_decode_worker_whose_engine_dies_is_restarted_and_registers_again(llama_dir, tmp_path):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_local_ray(NAMESPACE)
    etcd = EmbeddedEtcd(tmp_path / "etcd").start()
    actor = None
    try:
        opts = worker_actor_options("restart-decode-0", NAMESPACE, num_cpus=0)
        opts.pop("lifetime")  # ends with this test's Ray
        actor = ray.remote(restartable(DecodeWorker)).options(**opts).remote(dict(
            model=llama_dir, worker_id="decode-0", etcd_endpoints=[etcd.endpoint], cluster=CLUSTER, lease_ttl_s=3,
            exit_on_engine_death=True))
        first = ray.get(actor.start.remote(), timeout=180)
        assert registered(etcd.endpoint)["decode-0"].endpoints["grpc"] == first["grpc"]
        ref = LLM(llama_dir).generate([[5, 17, 99, 1000]], SamplingParams(max_tokens=6, temperature=0.0,
                                                                           ignore_eos=True))[0].token_ids

        async def generate(target: str):
            async with AsyncClient(target) as c:
                return await c.generate([5, 17, 99, 1000], max_tokens=6, temperature=0.0, ignore_eos=True,
                                        timeout_s=60)

        assert asyncio.run(generate(first["grpc"])).token_ids == ref
        ray.get(actor.__ray_call__.remote(break_engine), timeout=30)
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                asyncio.run(generate(first["grpc"]))
            assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)

        def restarted() -> bool:
            try:
                pid = ray.get(actor.__ray_call__.remote(lambda w: os.getpid()), timeout=5)
                members = registered(etcd.endpoint)
            except Exception:  # noqa: BLE001  (restarting)
                return False
            return pid != first["pid"] and "decode-0" in members and \
                members["decode-0"].endpoints["grpc"] != first["grpc"]

        wait_until(restarted, 180, 0.5)
        target = registered(etcd.endpoint)["decode-0"].endpoints["grpc"]
        assert asyncio.run(generate(target)).token_ids == ref
        stats = ray.get(actor.stats.remote(), timeout=30)
        assert stats["engine_alive"] and stats["engine_failed_steps"] == 0
    finally:
        if actor is not None:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                pass
            ray.kill(actor)
        etcd.stop()
        ray.shutdown()
