"""The disaggregated path end to end: 1P1D on CPU with real etcd, NIXL and Ray.

The prefill worker is a Ray actor in its own process; the decode worker runs
in this process (its engine thread + its own event loop). Requests go in
through gRPC; outputs are compared with `LLM.generate` on the same model.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import pytest
import ray

from pdserve.api import AsyncClient, Client
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.cluster.records import WorkerInfo
from pdserve.cluster.registry import Registry
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.prefill.worker import PrefillWorker
from tests.harness import WorkerThread, start_local_ray, wait_until

UCX = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
TTL_S = 3
CLUSTER = "e2e"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def ray_local():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # address="local": a fresh Ray of our own even if a `ray start` head runs on this host.
    start_local_ray("pdserve-e2e")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EmbeddedEtcd(tmp_path_factory.mktemp("etcd") / "data") as server:
        yield server


def start_prefill(model: str, etcd, worker_id: str):
    actor = ray.remote(PrefillWorker).options(num_cpus=0).remote(dict(
        model=model, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER, lease_ttl_s=TTL_S,
        worker_id=worker_id, ucx_env=UCX))
    ray.get(actor.start.remote(), timeout=180)
    return actor


@pytest.fixture(scope="module")
def cluster(ray_local, etcd, llama_dir):
    """1P1D: the decode worker first (so an empty pool can be observed), then the prefill worker."""
    d = WorkerThread(DecodeWorkerConfig(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER, lease_ttl_s=TTL_S,
        worker_id="decode-0", remote_prefill=True, ucx_env=UCX, remote_timeout_s=60)).start()
    state = {"decode": d, "prefill": None}
    yield state
    if state["prefill"] is not None:
        try:
            ray.get(state["prefill"].stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001  (already killed by a test)
            pass
    d.stop()


def with_prefill(cluster, llama_dir, etcd, worker_id="prefill-0"):
    if cluster["prefill"] is None:
        cluster["prefill"] = start_prefill(llama_dir, etcd, worker_id)
    d = cluster["decode"]
    # Registered in etcd, and heard from by the queue (what remote routing needs: a prefill
    # worker that makes no progress gets no traffic, whatever its lease says).
    wait_until(lambda: d.worker.frontend.prefill_view.pool_size >= 1 and d.worker.remote.available(), 15)
    return cluster["prefill"]


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Short chats and long documents; the long ones share a 256-token prefix in pairs."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 32000) for _ in range(256)] for _ in range(n // 4 + 1)]
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append([rng.randrange(3, 32000) for _ in range(rng.randint(4, 40))])
        else:
            tail = [rng.randrange(3, 32000) for _ in range(rng.randint(100, 260))]
            out.append(shared[i // 4] + tail)
    return out


def reference(llama_dir, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in LLM(llama_dir).generate(prompts, params)]


def run_all(d, prompts, route="auto", **kw):
    """Send every prompt at once; a forced route goes in at high priority (those tests are about
    the route, not QoS admission). Every request runs to its end before the first error (if any)
    is raised, so that no cancelled stream leaves state behind for the next test."""
    if route != "auto":
        kw.setdefault("priority", "high")

    async def go():
        async with AsyncClient(d.grpc) as c:
            return await asyncio.gather(*(
                c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, route=route,
                           timeout_s=180, **kw) for p in prompts), return_exceptions=True)

    outs = asyncio.run(go())
    errors = [o for o in outs if isinstance(o, BaseException)]
    if errors:
        raise errors[0]
    return outs


def free_blocks(d):
    eng = d.worker.engine
    return eng.kv.num_free_blocks, eng.kv.pool.num_blocks


def assert_all_blocks_return(d):
    eng = d.worker.engine
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30)


def test_empty_pool_routes_local_not_error(cluster, llama_dir):
    d = cluster["decode"]
    assert d.worker.frontend.prefill_view.pool_size == 0
    prompt = mixed_prompts(2, seed=1)[1]
    with Client(d.grpc) as c:
        out = c.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, route="remote")
    assert out.breakdown["route"] == "local" and "empty_pool" in out.breakdown["reason"]
    assert out.token_ids == reference(llama_dir, [prompt])[0]


def test_24_concurrent_mixed_requests_are_token_exact_and_use_both_routes(cluster, llama_dir, etcd):
    p = with_prefill(cluster, llama_dir, etcd)
    d = cluster["decode"]
    prompts = mixed_prompts(24, seed=2)
    ref = reference(llama_dir, prompts)
    outs = run_all(d, prompts)
    assert [o.token_ids for o in outs] == ref
    routes = {o.breakdown["route"] for o in outs}
    assert routes == {"local", "remote"}, [(len(pr), o.breakdown["reason"]) for pr, o in zip(prompts, outs)]
    assert ray.get(p.get_stats.remote())["tasks_done"] >= 1
    assert_all_blocks_return(d)


def test_forced_remote_and_forced_local_give_the_same_tokens(cluster, llama_dir, etcd):
    p = with_prefill(cluster, llama_dir, etcd)
    d = cluster["decode"]
    prompts = mixed_prompts(12, seed=3)
    ref = reference(llama_dir, prompts)
    eng, remote = d.worker.engine, d.worker.remote
    computed0, bytes_d0 = eng.stats.num_prompt_tokens_computed, remote.counters["bytes_received"]
    notes0, stats0 = remote.counters["ready"], ray.get(p.get_stats.remote())
    outs_remote = run_all(d, prompts, route="remote")
    stats1 = ray.get(p.get_stats.remote())
    assert [o.token_ids for o in outs_remote] == ref
    assert all(o.breakdown["route"] == "remote" for o in outs_remote)
    # The KV really moved: the decode worker computed no prompt token, received one
    # notification per request, and the bytes it counted equal the bytes written.
    assert eng.stats.num_prompt_tokens_computed == computed0
    assert remote.counters["ready"] - notes0 == len(prompts) == stats1["tasks_done"] - stats0["tasks_done"]
    assert remote.counters["bytes_received"] - bytes_d0 == stats1["bytes_written"] - stats0["bytes_written"] > 0
    assert all(o.breakdown["transfer_bytes"] > 0 and o.breakdown["prefill_worker"] == "prefill-0"
               for o in outs_remote)
    outs_local = run_all(d, prompts, route="local")
    assert [o.token_ids for o in outs_local] == ref
    assert all(o.breakdown["route"] == "local" for o in outs_local)
    assert_all_blocks_return(d)


def test_remote_first_token_logprobs_equal_the_local_paths(cluster, llama_dir, etcd):
    """With logprobs asked, the first token's logprob and its top alternatives come from the
    prefill worker: the same entries (ids, and values to float tolerance) as a local prefill."""
    with_prefill(cluster, llama_dir, etcd)
    d = cluster["decode"]
    prompts = mixed_prompts(4, seed=9)
    remote = run_all(d, prompts, route="remote", logprobs=3)
    local = run_all(d, prompts, route="local", logprobs=3)
    assert all(o.breakdown["route"] == "remote" for o in remote)
    for r, lo in zip(remote, local):
        assert r.token_ids == lo.token_ids
        first_r, first_l = r.logprobs[0], lo.logprobs[0]
        assert first_r["token_id"] == first_l["token_id"] and len(first_r["top_logprobs"]) == 3
        assert set(first_r["top_logprobs"]) == set(first_l["top_logprobs"])
        assert first_r["logprob"] == pytest.approx(first_l["logprob"], abs=1e-4)
        for tok, lp in first_l["top_logprobs"].items():
            assert first_r["top_logprobs"][tok] == pytest.approx(lp, abs=1e-4)
    assert_all_blocks_return(d)


GRAMMARS = [
    {"json": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}}, "required": ["k"]},
     "disable_any_whitespace": True},
    {"regex": r"[a-z]{3,6}-[0-9]{2}"},
    {"choice": ["red", "green", "blue"]},
    {"grammar": 'root ::= "<" [xyz]{1,4} ">"'},
]


def test_structured_outputs_are_token_exact_on_both_routes(cluster, llama_dir, etcd):
    """A grammar crosses the hop in the task's sampling parameters: the prefill worker samples
    the first token under it, the decode worker's matcher continues from it (docs/structured.md)."""
    with_prefill(cluster, llama_dir, etcd)
    d = cluster["decode"]
    prompts = mixed_prompts(8, seed=21)
    specs = [GRAMMARS[i % len(GRAMMARS)] for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=s) for s in specs]
    want = LLM(llama_dir).generate(prompts, params)
    assert all(o.finish_reason == "stop" for o in want)  # every grammar here ends within 24 tokens

    async def go(route):
        async with AsyncClient(d.grpc) as c:
            return await asyncio.gather(*(
                c.generate(p, max_tokens=24, temperature=0.0, route=route, priority="high", timeout_s=180,
                           structured_outputs=s) for p, s in zip(prompts, specs)))

    for route in ("remote", "local"):
        outs = asyncio.run(go(route))
        assert [o.token_ids for o in outs] == [o.token_ids for o in want], route
        assert all(o.breakdown["route"] == route for o in outs)
    assert_all_blocks_return(d)


def test_queue_full_routes_local_not_error(cluster, llama_dir, etcd):
    """A second decode worker on a tiny queue that no prefill worker serves."""
    from pdserve.cluster.queue import get_or_create_queue

    # Created before the worker, and the handle kept: Ray ends a non-detached
    # actor when its last handle goes away.
    tiny = get_or_create_queue("tiny-queue", "pdserve", capacity=1)
    assert ray.get(tiny.stats.remote()).capacity == 1
    d2 = WorkerThread(DecodeWorkerConfig(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster="e2e-full", lease_ttl_s=TTL_S,
        worker_id="decode-full", remote_prefill=True, ucx_env=UCX, remote_timeout_s=3,
        queue_name="tiny-queue")).start()
    reg = None
    try:
        async def fake_prefill_member():
            r = Registry([etcd.endpoint], "e2e-full", ttl_s=TTL_S)
            await r.register(WorkerInfo(worker_id="idle-prefill", role="prefill"))
            return r

        # A registered prefill member that never pulls, but tells the queue it is alive (as a
        # worker busy with a long batch does): its keep-alive needs a running loop.
        loop = asyncio.new_event_loop()
        loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
        loop_thread.start()
        reg = asyncio.run_coroutine_threadsafe(fake_prefill_member(), loop).result(30)
        beating = threading.Event()

        def heartbeat():
            while not beating.is_set():
                ray.get(tiny.alive.remote("idle-prefill"), timeout=10)
                beating.wait(0.5)

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        wait_until(lambda: d2.worker.frontend.prefill_view.pool_size == 1 and d2.worker.remote.available(), 10)
        prompts = mixed_prompts(4, seed=4)[1::2]  # two long prompts: the first fills the queue
        ref = reference(llama_dir, prompts)
        t0 = time.monotonic()
        outs = run_all(d2, prompts, route="remote")
        assert [o.token_ids for o in outs] == ref
        reasons = sorted(o.breakdown["reason"] for o in outs)
        assert any("queue_full" in r for r in reasons), reasons  # refused at put: local at once
        assert any("deadline" in r for r in reasons), reasons  # queued, never taken: local after 3 s
        assert time.monotonic() - t0 < 30
        assert_all_blocks_return(d2)
    finally:
        if reg is not None:
            beating.set()
            beat.join(15)
            asyncio.run_coroutine_threadsafe(reg.close(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            loop_thread.join(10)
        d2.stop()


def test_prefill_worker_killed_mid_flight_all_requests_complete_locally(cluster, llama_dir, etcd):
    p = with_prefill(cluster, llama_dir, etcd)
    d = cluster["decode"]
    baseline = free_blocks(d)
    prompts = [pr for pr in mixed_prompts(40, seed=5) if len(pr) > 300][:16]
    assert len(prompts) == 16
    ref = reference(llama_dir, prompts)
    pid = ray.get(p.pid.remote())
    results = {}
    # A worker that leaves etcd may only be partitioned: its taken attempts' blocks are
    # quarantined (kvtransfer/decode_side.py), here for 3 s instead of 60.
    d.worker.remote.handoffs.quarantine_s = 3.0

    async def go():
        async with AsyncClient(d.grpc) as c:
            # High priority: this test is about fault tolerance, not QoS admission.
            tasks = [asyncio.create_task(c.generate(pr, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                    route="remote", priority="high", timeout_s=180))
                     for pr in prompts]
            # Kill the prefill worker once it holds work (or has just finished some).
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not d.worker.engine.scheduler.remote:
                await asyncio.sleep(0.005)
            os.kill(pid, signal.SIGKILL)
            results["killed_at"] = time.monotonic()
            results["outs"] = await asyncio.gather(*tasks)

    asyncio.run(go())
    outs = results["outs"]
    assert [o.token_ids for o in outs] == ref
    assert any(o.breakdown["fell_back_to_local"] for o in outs)
    # The registry dropped the dead worker within TTL + 2 s of the kill.
    wait_until(lambda: d.worker.frontend.prefill_view.pool_size == 0, TTL_S + 2)
    # The empty pool's clean-up (cancel, fall back, quarantine what a worker took) runs just
    # after the pool size drops; the quarantines end 3 s later.
    try:
        wait_until(lambda: free_blocks(d) == baseline, 10)
    except TimeoutError:
        pass
    d.worker.remote.handoffs.quarantine_s = 60.0
    assert free_blocks(d) == baseline
    assert_all_blocks_return(d)
    cluster["prefill"] = None

    # A restarted prefill worker is used again without restarting the decode worker.
    p2 = with_prefill(cluster, llama_dir, etcd, worker_id="prefill-1")
    prompt = prompts[0]
    with Client(d.grpc) as c:
        out = c.generate(prompt + [7, 8, 9], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                         route="remote", priority="high", timeout_s=60)
    assert out.breakdown["route"] == "remote" and out.breakdown["prefill_worker"] == "prefill-1"
    assert out.token_ids == reference(llama_dir, [prompt + [7, 8, 9]])[0]
    assert ray.get(p2.get_stats.remote())["tasks_done"] == 1


def test_drained_prefill_worker_finishes_in_flight_work_and_takes_no_more(cluster, llama_dir, etcd):
    p = with_prefill(cluster, llama_dir, etcd, worker_id="prefill-1")
    d = cluster["decode"]
    prompts = [pr for pr in mixed_prompts(20, seed=6) if len(pr) > 300][:4]
    ref = reference(llama_dir, prompts)
    results = {}

    async def go():
        async with AsyncClient(d.grpc) as c:
            tasks = [asyncio.create_task(c.generate(pr, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                    route="remote", priority="high", timeout_s=120))
                     for pr in prompts]
            await asyncio.sleep(0.05)
            async with Registry([etcd.endpoint], CLUSTER) as reg:
                assert await reg.request_drain("prefill-1")
            results["outs"] = await asyncio.gather(*tasks)

    asyncio.run(go())
    assert [o.token_ids for o in results["outs"]] == ref  # in-flight work finished (or fell back)
    wait_until(lambda: d.worker.frontend.prefill_view.pool_size == 0, 10)
    wait_until(lambda: ray.get(p.get_stats.remote())["draining"], 10)
    time.sleep(TTL_S + 1)  # a drained worker does not re-register after its lease is gone
    assert d.worker.frontend.prefill_view.pool_size == 0
    with Client(d.grpc) as c:
        out = c.generate(prompts[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, route="remote")
    assert out.breakdown["route"] == "local" and "empty_pool" in out.breakdown["reason"]

