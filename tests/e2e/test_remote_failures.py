"""The remote path under failure: a failed push falls back at once, the prefill loop
survives its tasks, the queue survives its own death, no request hangs; and under attack:
a task its decode worker did not sign writes nothing, a notice it did not ask for is refused.

1P1D on CPU with real etcd, NIXL and Ray. The prefill worker runs in this process
on its own event loop (so a test can inject a fault into its engine or its NIXL
agent); the decode worker too. The decode worker's remote deadline is 120 s: a
fallback by deadline would show up as a client timeout or as the wrong cause, so
every test asserts on the recorded cause and counters, never on wall-clock time.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import ray
import torch

from pdserve.api import AsyncClient
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.kvtransfer import PrefillDone, PrefillTask
from pdserve.prefill.worker import PrefillWorker
from pdserve.cluster.queue import QueueClient, TaskSigner, get_or_create_queue
from tests.harness import WorkerThread, start_local_ray, wait_until

pytestmark = pytest.mark.timeout(600)

UCX = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
TTL_S = 3
CLUSTER = "e2e-failures"
NAMESPACE = "pdserve-e2e-failures"
QUEUE = "failures-queue"
MAX_TOKENS = 6
CLIENT_TIMEOUT_S = 90  # below the 120 s remote deadline: a deadline fallback fails the test
# A stalled worker's tasks come back within its progress bound (3 s here) and are prefilled
# locally: well within this, on a loaded 2-core box too; far below the remote deadline.
STALL_CLIENT_TIMEOUT_S = 45


class PrefillThread:
    """A PrefillWorker on a private event loop in this process (faults can be injected)."""

    def __init__(self, cfg: dict):
        self.worker = PrefillWorker(cfg)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="prefill-worker-loop", daemon=True)

    def start(self) -> "PrefillThread":
        self._thread.start()
        self.call(self.worker.start, 180)
        return self

    def call(self, fn, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout_s)

    def stop(self) -> None:
        try:
            self.call(self.worker.stop, 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_local_ray(NAMESPACE)
    etcd = EmbeddedEtcd(tmp_path_factory.mktemp("etcd") / "data").start()
    common = dict(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER, lease_ttl_s=TTL_S,
                  ucx_env=UCX, queue_name=QUEUE, queue_namespace=NAMESPACE)
    d = WorkerThread(DecodeWorkerConfig(worker_id="decode-0", remote_prefill=True, remote_timeout_s=120,
                                        **common)).start()
    p = PrefillThread(dict(worker_id="prefill-0", **common)).start()
    wait_until(lambda: d.worker.frontend.prefill_view.pool_size == 1 and d.worker.remote.available(), 15)
    state = SimpleNamespace(decode=d, prefill=p, etcd=etcd, common=common, llm=LLM(llama_dir))
    yield state
    if state.prefill is not None:
        state.prefill.stop()
    d.stop()
    etcd.stop()
    ray.shutdown()


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 31000 + 3 for i in range(n)]


def reference(cluster, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in cluster.llm.generate(prompts, params)]


def run_remote(cluster, prompts, timeout_s: float = CLIENT_TIMEOUT_S):
    async def go():
        async with AsyncClient(cluster.decode.grpc) as c:
            return await asyncio.gather(*(
                c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, route="remote",
                           priority="high", timeout_s=timeout_s) for p in prompts), return_exceptions=True)

    outs = asyncio.run(go())
    errors = [o for o in outs if isinstance(o, BaseException)]
    if errors:
        raise errors[0]
    return outs


def remote_state(cluster):
    r = cluster.decode.worker.remote
    return dict(r.counters), dict(r.fallback_causes)


def assert_clean(cluster):
    """No request left and every block back, on both sides."""
    for eng in (cluster.decode.worker.engine, cluster.prefill.worker.engine):
        wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 15)


def fails_one_request_with(cluster, kind: str, prompt: list[int]):
    """Send one remote request; it must complete token-exact after a fallback caused by `kind`.
    Returns how many PrefillFailed notices the prefill worker sent over NIXL (the queue's
    failed-task path carries the failure too, whichever arrives first)."""
    counters0, causes0 = remote_state(cluster)
    failed0 = cluster.prefill.worker.stats.failed_by_kind[kind]
    sent0 = cluster.prefill.worker.stats.failure_notices_sent
    (out,) = run_remote(cluster, [prompt])
    counters1, causes1 = remote_state(cluster)
    assert out.token_ids == reference(cluster, [prompt])[0]
    assert out.breakdown["route"] == "local" and out.breakdown["fell_back_to_local"]
    assert kind in out.breakdown["reason"], out.breakdown["reason"]
    assert causes1.get(kind, 0) - causes0.get(kind, 0) == 1, causes1
    assert causes1.get("deadline", 0) == causes0.get("deadline", 0)
    assert cluster.prefill.worker.stats.failed_by_kind[kind] - failed0 == 1
    assert_clean(cluster)
    return cluster.prefill.worker.stats.failure_notices_sent - sent0


def test_missing_peer_metadata_fails_the_task_back_through_the_queue(cluster):
    d, p = cluster.decode, cluster.prefill
    reg = d.worker.registry
    key = reg.keys.nixl("decode-0")
    value = d.call(lambda: reg.get_nixl_metadata("decode-0"))
    # The prefill worker finds no record now and forgets the decode worker (as when it left).
    d.call(lambda: reg.client().delete(key))
    p.worker._peer_gone(SimpleNamespace(worker_id="decode-0", role="decode"))
    try:
        notices = fails_one_request_with(cluster, "peer_missing", prompt_of(200, 1))
    finally:
        d.call(lambda: reg.client().put(key, value, lease=reg.lease_id))
    assert notices == 0  # no NIXL channel: it came through the queue's failed-task list


def test_a_task_with_a_nan_temperature_fails_alone_and_the_loop_goes_on(cluster, monkeypatch):
    remote = cluster.decode.worker.remote
    bad, good = prompt_of(180, 2), prompt_of(190, 3)
    put = remote.queue.put

    async def poisoned_put(task):
        if len(task.token_ids) == len(bad):  # what a buggy decode worker could sign and enqueue
            task.sampling_params = {**task.sampling_params, "temperature": math.nan}
            remote.signer.sign(task)
        return await put(task)

    monkeypatch.setattr(remote.queue, "put", poisoned_put)
    notices = fails_one_request_with(cluster, "bad_task", bad)
    assert notices == 1  # the peer is known: PrefillFailed over NIXL
    # Both at once: the bad one falls back, the good one is prefilled remotely as usual.
    outs = run_remote(cluster, [bad, good])
    assert [o.token_ids for o in outs] == reference(cluster, [bad, good])
    assert [o.breakdown["route"] for o in outs] == ["local", "remote"]
    assert cluster.prefill.worker.get_stats()["loop_alive"]
    assert_clean(cluster)


def test_extreme_sampling_values_on_the_remote_route(cluster):
    """NaN / Infinity are refused at the edge before routing (the prefill worker never sees
    them); tiny temperature and penalties pass validation and are prefilled remotely,
    without a fallback, token-exact with the local route."""
    import grpc

    p = cluster.prefill.worker
    tasks0 = p.stats.tasks_done + sum(p.stats.failed_by_kind.values())
    prompt = prompt_of(210, 8)

    async def go(route: str, **sampling):
        async with AsyncClient(cluster.decode.grpc) as c:
            return await c.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, route=route,
                                    priority="high", timeout_s=CLIENT_TIMEOUT_S, **sampling)

    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                asyncio.run(go("remote", **{name: value}))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in info.value.details()
    assert p.stats.tasks_done + sum(p.stats.failed_by_kind.values()) == tasks0
    counters0, causes0 = remote_state(cluster)
    out = asyncio.run(go("remote", temperature=1e-40))
    assert out.breakdown["route"] == "remote" and not out.breakdown["fell_back_to_local"]
    assert out.token_ids == reference(cluster, [prompt])[0]  # tiny temperature = greedy
    seeded = dict(temperature=1.0, repetition_penalty=1e-40, top_p=0.9, seed=7)
    remote, local = asyncio.run(go("remote", **seeded)), asyncio.run(go("local", **seeded))
    assert remote.breakdown["route"] == "remote" and not remote.breakdown["fell_back_to_local"]
    assert remote.token_ids == local.token_ids and len(remote.token_ids) == MAX_TOKENS
    assert remote_state(cluster)[1] == causes0
    assert p.get_stats()["loop_alive"] and cluster.decode.worker.async_engine.alive
    assert_clean(cluster)


def test_a_failed_page_write_falls_back_at_once(cluster, monkeypatch):
    agent = cluster.prefill.worker.agent.agent  # rank 0's NIXL agent, under the worker's sender
    nixl_error = agent._errors[0]

    def broken_transfer(xfer):  # what NIXL raises when UCX loses the endpoint
        raise nixl_error("injected: UCX endpoint closed")

    monkeypatch.setattr(agent._nixl, "transfer", broken_transfer)
    failures0 = cluster.prefill.worker.stats.transfer_failures
    metric0 = cluster.decode.worker.metrics.transfer_failures._value.get()
    notices = fails_one_request_with(cluster, "transfer_error", prompt_of(220, 4))
    assert notices == 1
    assert cluster.prefill.worker.stats.transfer_failures > failures0
    assert cluster.decode.worker.metrics.transfer_failures._value.get() == metric0 + 1


def test_a_failed_forward_pass_fails_its_batch_and_the_next_batch_runs(cluster, monkeypatch):
    runner = cluster.prefill.worker.engine.runner
    execute = runner.execute
    calls = {"n": 0}

    def out_of_memory_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected: CUDA out of memory")
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", out_of_memory_once)
    fails_one_request_with(cluster, "batch_failed", prompt_of(210, 5))
    assert cluster.prefill.worker.stats.batches_failed == 1
    (out,) = run_remote(cluster, [prompt_of(230, 6)])
    assert out.breakdown["route"] == "remote" and out.token_ids == reference(cluster, [prompt_of(230, 6)])[0]
    assert_clean(cluster)


def test_prefill_metrics_count_failures_by_kind(cluster):
    import urllib.request

    address = cluster.prefill.worker.get_stats()["metrics"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    for kind, n in {"peer_missing": 1, "bad_task": 2, "transfer_error": 1, "batch_failed": 1}.items():
        assert f'pdserve_prefill_tasks_failed_total{{kind="{kind}",worker_id="prefill-0"}} {n}.0' in text, kind
    assert 'pdserve_kv_transfer_failures_total{worker_id="prefill-0"}' in text
    assert "pdserve_prefill_batch_tasks_bucket" in text


def test_a_task_its_decode_worker_did_not_sign_writes_nothing(cluster):
    """The attack of issue #20: a process that can read the queue's token puts tasks naming
    blocks of decode-0 that no request of decode-0 reserved. The prefill worker refuses each
    before computing or writing anything: decode-0's KV pool is unchanged, byte for byte."""
    d, p = cluster.decode.worker, cluster.prefill.worker
    kv = d.engine.connector.kv_tensor
    before = kv.clone()
    num_blocks = d.engine.kv.pool.num_blocks
    theirs = list(range(num_blocks - 4, num_blocks))  # 4 blocks x 16 tokens of decode-0's pool
    rejected0, reasons0 = p.stats.tasks_rejected, dict(p.stats.rejected_by_reason)
    counters0 = dict(d.remote.counters)

    def crafted(rid: str, signer: TaskSigner | None, blocks: list[int]) -> PrefillTask:
        t = PrefillTask(request_id=rid, epoch=1, token_ids=prompt_of(64, 90), cached_len=0,
                        target_worker_id="decode-0", target_block_ids=blocks, deadline=time.time() + 60)
        return signer.sign(t) if signer is not None else t

    tampered = crafted("attack-tampered", d.remote.signer, [0, 1, 2, 3])  # decode-0 signed other blocks
    tampered.target_block_ids = theirs
    tasks = [crafted("attack-unsigned", None, theirs), crafted("attack-forged", TaskSigner(), theirs), tampered]

    queue = get_or_create_queue(QUEUE, NAMESPACE)
    completed0 = ray.get(queue.stats.remote(), timeout=30).counters.get("completed", 0)

    async def put_all():
        client = QueueClient(queue, "wire")  # with the token, as any local process can
        try:
            return [(await client.put(t)).ok for t in tasks]
        finally:
            await client.close()

    assert asyncio.run(put_all()) == [True, True, True]
    # The prefill worker took all three and is done with them (it completes a batch after its writes).
    wait_until(lambda: ray.get(queue.stats.remote(), timeout=30).counters.get("completed", 0) == completed0 + 3, 30)
    assert torch.equal(kv, before)
    assert p.stats.tasks_rejected == rejected0 + 3
    reasons = {k: v - reasons0.get(k, 0) for k, v in p.stats.rejected_by_reason.items()}
    assert {k: v for k, v in reasons.items() if v} == {"unsigned": 1, "bad_signature": 2}
    assert dict(d.remote.counters) == counters0  # decode-0 heard nothing (no notice, no fallback)
    stats = ray.get(queue.stats.remote(), timeout=30)
    assert stats.depth == 0 and stats.in_flight == {}  # taken, refused and completed
    text = p.metrics.render().decode()
    assert 'pdserve_prefill_tasks_rejected_total{reason="bad_signature",worker_id="prefill-0"} 2.0' in text
    # The same worker still prefills decode-0's own (signed) tasks.
    (out,) = run_remote(cluster, [prompt_of(120, 91)])
    assert out.breakdown["route"] == "remote" and out.token_ids == reference(cluster, [prompt_of(120, 91)])[0]
    assert_clean(cluster)


def test_decode_refuses_and_counts_a_prefill_done_it_did_not_ask_for(cluster):
    """A PrefillDone for an attempt decode-0 never started changes nothing there and is counted."""
    d, p = cluster.decode.worker, cluster.prefill.worker
    if "decode-0" not in p.agent.peers:  # run alone: one request connects the two agents
        run_remote(cluster, [prompt_of(100, 92)])
    arrival = d.remote.arrival
    refused0 = arrival.refused_causes.get("unknown_attempt", 0)
    counters0 = {k: v for k, v in d.remote.counters.items() if k not in ("notifications", "refused_done")}
    kv = d.engine.connector.kv_tensor
    before = kv.clone()
    p.agent.send_notification("decode-0", PrefillDone("nobody-asked", 1, 5, None, 16, prefill_worker="x").encode())
    wait_until(lambda: arrival.refused_causes.get("unknown_attempt", 0) == refused0 + 1, 10)
    assert {k: v for k, v in d.remote.counters.items() if k not in ("notifications", "refused_done")} == counters0
    assert not d.engine.requests and torch.equal(kv, before)
    text = d.metrics.render().decode()
    assert 'pdserve_remote_notifications_refused_total{reason="unknown_attempt",role="decode",worker_id="decode-0"}' \
        in text


def test_a_first_token_outside_the_vocabulary_falls_back_not_fails(cluster, monkeypatch):
    """A PrefillDone naming a token the model does not have (a buggy prefill worker) is
    refused and the request prefills locally, token-exact; no engine step fails."""
    import pdserve.prefill.batch as batch

    real = batch.PrefillDone

    def bad_token(rid, epoch, tok, *args, **kwargs):
        return real(rid, epoch, 10**6 + tok, *args, **kwargs)

    monkeypatch.setattr(batch, "PrefillDone", bad_token)
    d = cluster.decode.worker
    failed_steps0 = d.async_engine.counters["failed_steps"]
    _, causes0 = remote_state(cluster)
    prompt = prompt_of(130, 93)
    (out,) = run_remote(cluster, [prompt])
    assert out.token_ids == reference(cluster, [prompt])[0]
    assert out.breakdown["fell_back_to_local"] and "bad_first_token" in out.breakdown["reason"]
    _, causes1 = remote_state(cluster)
    assert causes1.get("bad_first_token", 0) - causes0.get("bad_first_token", 0) == 1
    assert d.async_engine.counters["failed_steps"] == failed_steps0
    assert_clean(cluster)


def test_a_hung_prefill_worker_is_failed_back_within_the_stall_bound(cluster, monkeypatch):
    """The prefill worker takes a task and its compute thread then hangs inside an engine step
    (a forward pass stuck in a kernel or a collective), while everything else goes on: its
    event loop, its heartbeat to the queue and its etcd lease. The heartbeat carries the
    compute thread's progress, which stands still, so the queue fails the task back as
    worker_stalled once the progress bound passes (max(stall bound 3 s, 4 x this worker's
    predicted slowest step): 3 s here) and no longer counts the worker live, though it beats.
    The request prefills locally, token-exact, instead of waiting for the remote deadline
    (120 s here: the client's timeout below would fail the test). When the step resumes, its
    late write lands in the quarantined blocks, and its PrefillDone frees them."""
    p = cluster.prefill.worker
    # Its steps are timed (the allowance is its own prediction, not the untimed one) and it is
    # live: this remote request is served by it.
    (warm,) = run_remote(cluster, [prompt_of(120, 96)])
    assert warm.breakdown["route"] == "remote" and not warm.breakdown.get("fell_back_to_local"), warm.breakdown
    in_step, release = threading.Event(), threading.Event()
    real_step = p.engine.step

    def hung_step(*args, **kwargs):  # only the engine step, on the compute thread, hangs
        in_step.set()
        release.wait(120)  # set by this test however it ends
        return real_step(*args, **kwargs)

    beats = []  # the heartbeat as the queue receives it: it must go on through the hang
    real_beat = p.queue.beat

    async def counted_beat(*args):
        beats.append(args)
        return await real_beat(*args)

    monkeypatch.setattr(p.engine, "step", hung_step)
    monkeypatch.setattr(p.queue, "beat", counted_beat)
    queue = get_or_create_queue(QUEUE, NAMESPACE)
    stalled0 = ray.get(queue.stats.remote(), timeout=30).counters
    _, causes0 = remote_state(cluster)
    prompt, later = prompt_of(140, 94), prompt_of(90, 95)
    try:
        (out,) = run_remote(cluster, [prompt], timeout_s=STALL_CLIENT_TIMEOUT_S)
        assert in_step.is_set()  # it hung where the test put the hang: in the step
        # It beats on, stuck: the queue does not count it live, so a request asking for remote
        # prefill is served locally at once, not queued. Still registered (its lease is alive).
        seen = len(beats)
        wait_until(lambda: len(beats) >= seen + 4, 10)
        assert all(len(b) == 2 and b[1] is not None and b[1]["steps"] == beats[-1][1]["steps"]
                   for b in beats[seen:]), beats[seen:]  # its progress stands still
        wait_until(lambda: not cluster.decode.worker.remote.available(), 10)
        (second,) = run_remote(cluster, [later], timeout_s=STALL_CLIENT_TIMEOUT_S)
        assert cluster.decode.worker.frontend.prefill_view.pool_size == 1
        stalled1 = ray.get(queue.stats.remote(), timeout=30).counters
    finally:
        release.set()
    assert second.token_ids == reference(cluster, [later])[0]
    assert second.breakdown["route"] == "local" and "no live prefill worker" in second.breakdown["reason"]
    assert out.token_ids == reference(cluster, [prompt])[0]
    assert out.breakdown["fell_back_to_local"] and "worker_stalled" in out.breakdown["reason"]
    _, causes1 = remote_state(cluster)
    assert causes1.get("worker_stalled", 0) - causes0.get("worker_stalled", 0) == 1
    assert causes1.get("deadline", 0) == causes0.get("deadline", 0)
    # The queue tells a compute stall from silence.
    assert stalled1.get("stalled_compute", 0) - stalled0.get("stalled_compute", 0) == 1, stalled1
    assert stalled1.get("stalled_silent", 0) == stalled0.get("stalled_silent", 0)
    assert_clean(cluster)
    # Its step over, it serves remotely again.
    monkeypatch.undo()
    wait_until(lambda: cluster.decode.worker.remote.available(), 15)
    (again,) = run_remote(cluster, [prompt_of(110, 97)])
    assert again.breakdown["route"] == "remote" and again.token_ids == reference(cluster, [prompt_of(110, 97)])[0]


def _gate_prefill(cluster) -> threading.Event:
    """Pause the prefill worker's pulls (it stays registered, and tells the queue it is alive,
    as a worker busy with a long batch does: a silent one would be failed back as stalled);
    set the event to resume."""
    gate = threading.Event()
    worker = cluster.prefill.worker
    pull = worker._next_batch

    async def gated():
        while not gate.is_set():
            try:
                await asyncio.wait_for(worker.queue.alive(worker.worker_id), 1.0)
            except Exception:  # noqa: BLE001  (a stopped or restarting queue: try again)
                pass
            await asyncio.sleep(0.2)
        return await pull()

    worker._next_batch = gated
    time.sleep(worker.cfg.poll_timeout_ms / 1000 + 0.5)  # the poll under way ends first
    return gate


def test_queue_actor_killed_with_16_queued_tasks_all_complete_remotely(cluster):
    """The queue restarts empty with 16 tasks queued: each is put again as a new attempt (epoch
    2) into fresh blocks, and all 16 complete remotely, token-exact. The first attempts' blocks
    wait in quarantine (nobody can say the lost queue's copies were never taken) and come back
    when it ends."""
    d = cluster.decode
    remote = d.worker.remote
    prompts = [prompt_of(150 + 7 * i, 10 + i) for i in range(16)]
    ref = reference(cluster, prompts)
    counters0, causes0 = remote_state(cluster)
    gate = _gate_prefill(cluster)
    queue = get_or_create_queue(QUEUE, NAMESPACE)
    instance0 = ray.get(queue.stats.remote(), timeout=30).instance_id
    results = {}
    saved = remote.handoffs.quarantine_s
    remote.handoffs.quarantine_s = 5.0  # the old attempts' blocks: back within the test

    def send():
        results["outs"] = run_remote(cluster, prompts)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        wait_until(lambda: ray.get(queue.stats.remote(), timeout=30).depth == 16, 30, 0.1)
        ray.kill(queue, no_restart=False)
        wait_until(lambda: remote.counters["queue_restarts"] == counters0["queue_restarts"] + 1, 30, 0.1)
        wait_until(lambda: remote.counters["reput"] - counters0["reput"] == 16, 10, 0.1)
        stats = ray.get(queue.stats.remote(), timeout=30)
        assert stats.instance_id != instance0 and stats.depth == 16
        # every awaited request is on its second attempt, and its first one's blocks wait apart
        assert sorted(h.epoch for h in remote.handoffs.awaiting()) == [2] * 16
        assert len(remote.handoffs.quarantined()) == 16
    finally:
        gate.set()
        sender.join(CLIENT_TIMEOUT_S + 10)
        remote.handoffs.quarantine_s = saved
    outs = results["outs"]
    assert [o.token_ids for o in outs] == ref
    assert all(o.breakdown["route"] == "remote" for o in outs), [o.breakdown.get("reason") for o in outs]
    assert all(o.breakdown["attempts"] == 2 for o in outs), [o.breakdown for o in outs]
    counters1, causes1 = remote_state(cluster)
    assert causes1 == causes0  # no fallback at all, by deadline or otherwise
    assert counters1["ready"] - counters0["ready"] == 16
    assert_clean(cluster)
    # The restarted queue serves its metrics: the 16 re-put tasks waited and were dispatched.
    import urllib.request

    address = ray.get(queue.stats.remote(), timeout=30).metrics
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    assert "pdserve_queue_depth 0.0" in text and "pdserve_queue_wait_seconds_count 16.0" in text


def _pid_listening_on(port: int) -> int:
    import psutil

    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return conn.pid
    raise LookupError(f"nobody listens on port {port}")


def test_a_wedged_queue_holds_no_request_past_its_deadline(cluster):
    """The queue actor stops answering (SIGSTOP) with requests queued and the prefill worker
    paused: each request falls back by its deadline (plus a bounded cancel), not after the
    queue call's 30 s slack or never."""
    d = cluster.decode
    remote = d.worker.remote
    prompts = [prompt_of(160 + 5 * i, 40 + i) for i in range(4)]
    ref = reference(cluster, prompts)
    gate = _gate_prefill(cluster)
    queue = get_or_create_queue(QUEUE, NAMESPACE)
    pid = _pid_listening_on(ray.get(queue.wire_endpoint.remote(), timeout=30)["port"])
    saved = (remote.cfg.timeout_s, remote.handoffs.quarantine_s)
    remote.cfg.timeout_s, remote.handoffs.quarantine_s = 4.0, 3.0  # the deadline; the handoff table's quarantine
    counters0, causes0 = remote_state(cluster)
    results = {}

    async def go():
        async with AsyncClient(d.grpc) as c:
            results["outs"] = await asyncio.gather(*(
                c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, route="remote",
                           priority="high", timeout_s=20) for p in prompts))

    try:
        def stop_queue_when_queued():
            wait_until(lambda: d.worker.frontend.prefill_view.queue_depth == len(prompts), 20, 0.05)
            os.kill(pid, signal.SIGSTOP)

        stopper = threading.Thread(target=stop_queue_when_queued, daemon=True)
        stopper.start()
        asyncio.run(go())
        stopper.join(5)
    finally:
        os.kill(pid, signal.SIGCONT)
        remote.cfg.timeout_s, remote.handoffs.quarantine_s = saved
        gate.set()
    outs = results["outs"]
    assert [o.token_ids for o in outs] == ref
    assert all(o.breakdown["fell_back_to_local"] for o in outs)
    counters1, causes1 = remote_state(cluster)
    by_cause = {k: causes1.get(k, 0) - causes0.get(k, 0) for k in causes1}
    assert by_cause.get("deadline", 0) + by_cause.get("queue_lost", 0) == len(prompts), by_cause
    assert_clean(cluster)


def _queued_then_dropped(cluster, n: int, send_one) -> None:
    """Start `n` remote requests with `send_one(i)` while the prefill worker is paused, drop
    every client once all n tasks are queued, then require (prefill still paused) that the
    queue is empty, no attempt is quarantined and every decode block is back: each task was
    withdrawn and its blocks freed at once, not quarantined for quarantine_s (60 s here). The
    prefill worker never computes any of them."""
    d = cluster.decode
    remote, eng = d.worker.remote, d.worker.engine
    counters0 = dict(remote.counters)
    computed0 = cluster.prefill.worker.engine.stats.num_prompt_tokens_computed
    gate = _gate_prefill(cluster)
    try:
        async def go():
            calls = [asyncio.ensure_future(send_one(i)) for i in range(n)]
            await asyncio.to_thread(wait_until, lambda: d.worker.frontend.prefill_view.queue_depth == n, 30, 0.05)
            for call in calls:
                call.cancel()  # the client goes away (the connection or the RPC is closed)
            await asyncio.gather(*calls, return_exceptions=True)

        asyncio.run(go())
        wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 5)
        wait_until(lambda: d.worker.frontend.prefill_view.queue_depth == 0, 5)
        assert not remote.handoffs.quarantined()
        assert remote.counters["withdrawn_queued"] - counters0["withdrawn_queued"] == n
    finally:
        gate.set()
    assert_clean(cluster)
    assert cluster.prefill.worker.engine.stats.num_prompt_tokens_computed == computed0


def test_cancelled_grpc_requests_still_queued_free_their_blocks_at_once(cluster):
    prompts = [prompt_of(40 + i, 300 + i) for i in range(50)]

    async def send_one(i):
        async with AsyncClient(cluster.decode.grpc) as c:
            await c.generate(prompts[i], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, route="remote",
                             priority="high", timeout_s=60)

    _queued_then_dropped(cluster, len(prompts), send_one)


def test_http_streams_dropped_before_the_first_token_free_their_queue_entries(cluster):
    import httpx

    prompts = [prompt_of(40 + i, 400 + i) for i in range(50)]

    async def send_one(i):
        async with httpx.AsyncClient(base_url=cluster.decode.http, timeout=60) as h:
            async with h.stream("POST", "/v1/completions", json={
                    "prompt": prompts[i], "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
                    "route": "remote", "priority": "high"}) as r:
                async for _ in r.aiter_lines():
                    pass

    _queued_then_dropped(cluster, len(prompts), send_one)


def test_a_task_being_computed_stops_when_its_request_is_cancelled(cluster, monkeypatch):
    """The client drops a remote request while the prefill worker is computing its task (a
    960-token prompt in 32-token steps of >= 0.1 s: 3 s of compute): the queue tells the worker
    at its next heartbeat, the worker aborts the task at its next step and sends a
    PrefillFailed("cancelled") once no write of it can land, and that notice frees the decode
    worker's quarantined blocks at once instead of after quarantine_s (60 s). On a worker
    that is never told, the whole prompt is computed (and written into quarantined blocks)."""
    p, d = cluster.prefill.worker, cluster.decode
    remote = d.worker.remote
    steps = []
    real_step = p.engine.step

    def slow_step(*args, **kwargs):
        steps.append(time.monotonic())
        time.sleep(0.1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(p.engine, "step", slow_step)
    monkeypatch.setattr(p.engine.scheduler, "max_num_batched_tokens", 32)
    prompt = prompt_of(960, 97)
    computed0 = p.engine.stats.num_prompt_tokens_computed
    cancelled0 = p.stats.failed_by_kind["cancelled"]
    counters0 = dict(remote.counters)

    async def go():
        async with AsyncClient(d.grpc) as c:
            call = asyncio.ensure_future(c.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                    route="remote", priority="high", timeout_s=60))
            await asyncio.to_thread(wait_until, lambda: len(steps) >= 3, 30, 0.01)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)

    asyncio.run(go())
    wait_until(lambda: p.stats.failed_by_kind["cancelled"] - cancelled0 == 1, 10, 0.02)
    computed = p.engine.stats.num_prompt_tokens_computed - computed0
    assert computed <= len(prompt) // 2, f"computed {computed} of {len(prompt)} tokens after the cancel"
    # Nothing of it is left quarantined on the decode side: its notice freed the blocks.
    wait_until(lambda: not remote.handoffs.quarantined(), 5, 0.02)
    assert remote.counters["ready"] == counters0["ready"]
    monkeypatch.undo()
    assert_clean(cluster)
    # The worker goes on: the next remote request is served remotely, token-exact.
    later = prompt_of(150, 98)
    (out,) = run_remote(cluster, [later])
    assert out.token_ids == reference(cluster, [later])[0] and out.breakdown["route"] == "remote"


def test_a_dead_pull_loop_leaves_the_registry(cluster, monkeypatch, caplog):
    d, p = cluster.decode, cluster.prefill
    worker = p.worker

    async def bug(tasks):
        raise AssertionError("injected bug in the pull loop")

    monkeypatch.setattr(worker, "_serve", bug)
    with caplog.at_level("ERROR", logger="pdserve.prefill.worker"):
        (out,) = run_remote(cluster, [prompt_of(200, 60)])
        assert out.token_ids == reference(cluster, [prompt_of(200, 60)])[0]
        wait_until(lambda: not worker.get_stats()["loop_alive"], 10)
        wait_until(lambda: d.worker.frontend.prefill_view.pool_size == 0, TTL_S + 5)
    assert "pull loop died" in caplog.text and "injected bug" in worker.get_stats()["loop_error"]
    p.stop()
    cluster.prefill = None


def test_a_killed_prefill_worker_actor_is_restarted_and_serves_again(cluster):
    """Created as the launcher creates it: Ray restarts it and it starts and registers again."""
    from pdserve.cluster.registry import Registry
    from pdserve.launcher import restartable, worker_actor_options

    d = cluster.decode
    opts = worker_actor_options("failures-prefill-1", NAMESPACE, num_cpus=0)
    opts.pop("lifetime")  # ends with this test's Ray
    actor = ray.remote(restartable(PrefillWorker)).options(**opts).remote(
        dict(worker_id="prefill-1", exit_on_loop_death=True, **cluster.common))
    ray.get(actor.start.remote(), timeout=180)
    wait_until(lambda: d.worker.frontend.prefill_view.pool_size == 1 and d.worker.remote.available(), 15)
    pid0 = ray.get(actor.pid.remote(), timeout=30)
    os.kill(pid0, signal.SIGKILL)

    def restarted_and_registered():
        try:
            pid = ray.get(actor.pid.remote(), timeout=5)
            stats = ray.get(actor.get_stats.remote(), timeout=5)
        except Exception:  # noqa: BLE001  (restarting)
            return False
        if pid == pid0 or not stats["loop_alive"]:
            return False

        async def members():
            async with Registry(cluster.common["etcd_endpoints"], CLUSTER) as reg:
                return await reg.members("prefill")

        return "prefill-1" in asyncio.run(members())

    wait_until(restarted_and_registered, 180, 0.5)
    wait_until(lambda: d.worker.frontend.prefill_view.pool_size == 1 and d.worker.remote.available(), 15)
    prompt = prompt_of(240, 70)
    (out,) = run_remote(cluster, [prompt])
    assert out.breakdown["route"] == "remote" and out.breakdown["prefill_worker"] == "prefill-1"
    assert out.token_ids == reference(cluster, [prompt])[0]
    ray.get(actor.stop.remote(), timeout=30)
    ray.kill(actor)
