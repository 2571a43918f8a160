"""A TP=2 decode worker loses a rank (kill -9): its streams fail with a typed gRPC error, it
leaves etcd within the lease TTL + 2 s, and Ray restarts it whole (fresh ranks), serving
token-exact again. The actor is created as the launcher creates it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
import ray

from pdserve.api import AsyncClient
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.cluster.registry import Registry
from pdserve.decode.worker import DecodeWorker
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tp_comm import shm_available
from pdserve.launcher import restartable, worker_actor_options
from tests.harness import start_local_ray, wait_until

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")]

CLUSTER = "e2e-tp-decode"
NAMESPACE = "pdserve-e2e-tp-decode"
TTL_S = 3
PROMPT = [5, 17, 99, 1000]


def registered(endpoint: str) -> dict:
    async def read():
        async with Registry([endpoint], CLUSTER) as reg:
            return await reg.members("decode")
    return asyncio.run(asyncio.wait_for(read(), 10))


async def generate(target: str, max_tokens: int):
    async with AsyncClient(target) as c:
        return await c.generate(PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout_s=120)


def test_a_killed_decode_rank_fails_streams_typed_and_the_worker_leaves_and_comes_back(llama_dir, tmp_path):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_local_ray(NAMESPACE)
    etcd = EmbeddedEtcd(tmp_path / "etcd").start()
    actor = None
    try:
        opts = worker_actor_options("tp-decode-0", NAMESPACE, num_cpus=0)
        opts.pop("lifetime")  # ends with this test's Ray
        actor = ray.remote(restartable(DecodeWorker)).options(**opts).remote(dict(
            model=llama_dir, worker_id="decode-0", etcd_endpoints=[etcd.endpoint], cluster=CLUSTER,
            lease_ttl_s=TTL_S, exit_on_engine_death=True, engine_args={"tensor_parallel_size": 2}))
        first = ray.get(actor.start.remote(), timeout=180)
        ref = LLM(llama_dir).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0,
                                                                ignore_eos=True))[0].token_ids
        assert asyncio.run(generate(first["grpc"], 6)).token_ids == ref
        (rank_pid,) = ray.get(actor.__ray_call__.remote(lambda w: w.engine.connector.tp_rank_pids()), timeout=30)

        async def killed_mid_stream():
            task = asyncio.ensure_future(generate(first["grpc"], 3000))  # streams for many seconds
            await asyncio.sleep(1.0)
            os.kill(rank_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await task
            return info.value, killed_at

        err, killed_at = asyncio.run(killed_mid_stream())
        assert err.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        assert "rank 1" in err.details()  # the error says which rank went
        def left_or_replaced() -> bool:  # one read: the record may go between two
            rec = registered(etcd.endpoint).get("decode-0")
            return rec is None or rec.endpoints["grpc"] != first["grpc"]

        wait_until(left_or_replaced, TTL_S + 2, 0.1)
        assert time.monotonic() - killed_at <= TTL_S + 2 + 1  # (+1: the poll's own reads)

        def restarted() -> bool:
            try:
                pids = ray.get(actor.__ray_call__.remote(lambda w: (os.getpid(), w.engine.connector.tp_rank_pids())),
                               timeout=5)
                members = registered(etcd.endpoint)
            except Exception:  # noqa: BLE001  (restarting)
                return False
            return pids[0] != first["pid"] and len(pids[1]) == 1 and "decode-0" in members and \
                members["decode-0"].endpoints["grpc"] != first["grpc"]

        wait_until(restarted, 180, 0.5)
        target = registered(etcd.endpoint)["decode-0"].endpoints["grpc"]
        assert asyncio.run(generate(target, 6)).token_ids == ref
    finally:
        if actor is not None:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                pass
            ray.kill(actor)
        etcd.stop()
        ray.shutdown()
