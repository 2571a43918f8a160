"""QoS admission under load, and live policy reload from a file and from etcd."""

from __future__ import annotations

import asyncio
import random

import grpc
import httpx
import pytest

from pdserve.api import AsyncClient, Client
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.cluster.registry import Registry
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import WorkerThread, wait_until

# Seeds make local prefill look slow (2 ms/token) and calibrate slowly, so a
# burst of 50-token prompts piles up a predicted backlog quickly.
TIGHT = """
router:
  cost_model: {prefill_local_ms_per_token: 2.0, ema_alpha: 0.01}
qos:
  ttft_slo_ms: 100000
  max_queue_wait_ms: 100000
  low_priority_threshold_ms: 300
  reject_on_slo_violation: false
"""
OPEN = """
qos:
  enable_early_rejection: false
"""
REFUSE_LOW = """
qos:
  low_priority_threshold_ms: 0.001
"""


def prompt(n=50, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


@pytest.fixture
def tight_worker(llama_dir, tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(TIGHT)
    # the seeds above shape the predictions: no boot calibration to replace them
    w = WorkerThread(DecodeWorkerConfig(model=llama_dir, router_policy=str(path), calibrate=False)).start()
    yield w
    w.stop()


def test_low_priority_burst_is_partly_refused_high_priority_all_admitted(tight_worker):
    async def one(c, i, priority):
        try:
            out = await c.generate(prompt(seed=i), max_tokens=4, temperature=0.0, priority=priority, timeout_s=120)
            return ("ok", out)
        except grpc.aio.AioRpcError as e:
            return (e.code(), e.details())

    eng = tight_worker.worker.engine

    async def run():
        async with AsyncClient(tight_worker.grpc) as c:
            # The server admits concurrent calls in no fixed order: the first low
            # request goes alone, so it meets an idle worker, and the burst follows
            # once the engine holds it.
            first = asyncio.ensure_future(one(c, 0, "low"))
            for _ in range(1200):
                if eng.requests or first.done():
                    break
                await asyncio.sleep(0.01)
            lows = [one(c, i, "low") for i in range(1, 24)]
            highs = [one(c, 100 + i, "high") for i in range(6)]
            return await asyncio.wait_for(asyncio.gather(first, *lows, *highs), 120)

    results = asyncio.run(run())
    low, high = results[:24], results[24:]
    refused = [r for r in low if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused, "a saturating low-priority burst must see refusals"
    assert len(refused) < 24, "the first low-priority requests fit the threshold"
    assert all("predicted TTFT" in msg for _, msg in refused)
    assert all(r[0] == "ok" and r[1].finish_reason for r in low if r not in refused)
    assert low[0][0] == "ok", "a low-priority request that meets an idle worker fits the threshold"
    assert all(r[0] == "ok" for r in high), high
    wait_until(lambda: eng.kv.num_free_blocks == eng.kv.pool.num_blocks and not eng.requests, 15)


def test_http_refusal_is_429_with_retry_after(llama_dir, tmp_path, caplog):
    path = tmp_path / "router.yaml"
    path.write_text(REFUSE_LOW)
    w = WorkerThread(DecodeWorkerConfig(model=llama_dir, router_policy=str(path))).start()
    try:
        with httpx.Client(base_url=w.http, timeout=60) as h, caplog.at_level("WARNING", "pdserve.decode.frontend"):
            r = h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "priority": "low"})
            assert r.status_code == 429
            assert "predicted TTFT" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1 and float(r.headers["x-predicted-ttft-ms"]) > 0
            again = h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "priority": "low"})
            assert again.status_code == 429
            ok = h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "priority": "high"})
            assert ok.status_code == 200
            metrics = h.get("/metrics").text
        # every refusal is counted; the log names the reason and figures, once a second at most
        assert 'pdserve_admissions_refused_total{reason="low_priority_ttft"' in metrics
        counted = [ln for ln in metrics.splitlines() if ln.startswith("pdserve_admissions_refused_total{")]
        assert float(counted[0].rsplit(" ", 1)[1]) == 2.0, counted
        lines = [rec.getMessage() for rec in caplog.records if "refused (low_priority_ttft)" in rec.getMessage()]
        assert 1 <= len(lines) <= 2 and "predicted TTFT" in lines[0], lines
    finally:
        w.stop()


def test_policy_file_change_applies_and_invalid_one_is_refused(llama_dir, tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(OPEN)
    cfg = DecodeWorkerConfig(model=llama_dir, router_policy=str(path), policy_poll_s=0.1)
    w = WorkerThread(cfg).start()
    state = w.worker.frontend.policy
    try:
        with Client(w.grpc) as c:
            assert c.generate("hi", max_tokens=2, priority="low").finish_reason
            v = state.version
            path.write_text(REFUSE_LOW)
            wait_until(lambda: state.version > v, 10)
            with pytest.raises(grpc.RpcError) as ei:
                c.generate("hi", max_tokens=2, priority="low")
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            v = state.version
            path.write_text("qos:\n  ttft_slo_ms: fast\n")
            wait_until(lambda: state.last_error is not None, 10)
            assert "qos.ttft_slo_ms" in state.last_error and ":2:" in state.last_error
            assert state.version == v
            with pytest.raises(grpc.RpcError):  # the old (refusing) policy is still active
                c.generate("hi", max_tokens=2, priority="low")
    finally:
        w.stop()


def test_etcd_policy_put_applies_and_invalid_is_refused(llama_dir, tmp_path):
    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        cfg = DecodeWorkerConfig(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster="qos-test",
                                 lease_ttl_s=3, worker_id="decode-a")
        w = WorkerThread(cfg).start()
        state = w.worker.frontend.policy

        async def put(text):
            async with Registry([etcd.endpoint], "qos-test") as reg:
                await reg.put_policy("router", text)
                return await reg.members(role="decode")

        try:
            members = asyncio.run(put(REFUSE_LOW))
            assert "decode-a" in members and members["decode-a"].endpoints["grpc"] == w.grpc
            wait_until(lambda: state.source == "etcd", 10)
            with Client(w.grpc) as c:
                with pytest.raises(grpc.RpcError) as ei:
                    c.generate("hi", max_tokens=2, priority="low")
                assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                v = state.version
                asyncio.run(put("router:\n  mode: sometimes\n"))
                wait_until(lambda: state.last_error is not None, 10)
                assert "router.mode" in state.last_error
                assert state.version == v
                asyncio.run(put(OPEN))
                wait_until(lambda: state.version > v, 10)
                assert c.generate("hi", max_tokens=2, priority="low").finish_reason
        finally:
            w.stop()
