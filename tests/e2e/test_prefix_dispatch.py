"""Prefix-aware prefill dispatch, end to end (real etcd, Ray, NIXL; two prefill workers that
publish KV events, one decode worker following them): after one prefill worker computed a
long shared prefix, every later request with that prefix is kept for it by the queue
(cluster/queue/core.py) on the hint the decode worker attached from the workers' KV events; the
output stays token-exact, and the queue recorded why."""

from __future__ import annotations

import random

import pytest
import ray

from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tp_comm import shm_available
from pdserve.prefill.worker import PrefillWorker
from tests.harness import WorkerThread, wait_until

from .test_disaggregated import MAX_TOKENS, etcd, ray_local, reference, run_all  # noqa: F401  (fixtures)

UCX = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
CLUSTER = "prefixd"


def stop_quietly(actor) -> None:
    """Stop a prefill worker actor, then kill it (a stuck or dead one is killed anyway)."""
    try:
        ray.get(actor.stop.remote(), timeout=30)
    except Exception:  # noqa: BLE001
        pass
    ray.kill(actor)


def references(model: str, prompts: list[list[int]]) -> list[list[int]]:
    """What `LLM.generate` makes of each prompt, all in one batch of an engine of their own with
    no prefix cache: every prompt computed whole, as by a fresh engine per prompt (the shared
    prefix is not reused between them), in one pass instead of one engine and pass each."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model, enable_prefix_caching=False) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def test_requests_sharing_a_prefix_go_to_the_prefill_worker_that_holds_it(ray_local, etcd, llama_dir):
    engine = {"kv_events": True, "device": "cpu"}
    d = WorkerThread(DecodeWorkerConfig(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER, lease_ttl_s=3, worker_id="decode-0",
        remote_prefill=True, ucx_env=UCX, remote_timeout_s=60, engine_args=engine)).start()
    actors = {}
    try:
        for wid in ("prefill-0", "prefill-1"):
            actors[wid] = ray.remote(PrefillWorker).options(num_cpus=0).remote(dict(
                model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER, lease_ttl_s=3, worker_id=wid,
                ucx_env=UCX, engine_args=engine))
        ray.get([a.start.remote() for a in actors.values()], timeout=180)
        view = d.worker.remote.prefix_view
        wait_until(lambda: d.worker.frontend.prefill_view.pool_size >= 2 and d.worker.remote.available(), 30)
        wait_until(lambda: all(w.get("synced") for w in view.status()["workers"].values())
                   and len(view.status()["workers"]) == 2, 30)
        rng = random.Random(5)
        shared = [rng.randrange(3, 32000) for _ in range(320)]
        first = shared + [rng.randrange(3, 32000) for _ in range(40)]
        follow = [shared + [rng.randrange(3, 32000) for _ in range(rng.randint(20, 60))] for _ in range(6)]
        want = references(llama_dir, [first] + follow)
        (out,) = run_all(d, [first], route="remote")
        assert out.token_ids == want[0]
        done = {w: ray.get(a.get_stats.remote())["tasks_done"] for w, a in actors.items()}
        (holder,) = [w for w, n in done.items() if n == 1]
        # The decode worker's view of the holder now covers the shared prefix.
        wait_until(lambda: view.cached_tokens(shared).get(holder, 0) >= 304, 20)
        for prompt, tokens in zip(follow, want[1:]):  # one at a time: each is pulled by whichever worker asks first
            (o,) = run_all(d, [prompt], route="remote")
            assert o.token_ids == tokens
            assert o.breakdown["route"] == "remote"
        after = {w: ray.get(a.get_stats.remote())["tasks_done"] for w, a in actors.items()}
        queue = ray.get_actor(d.worker.cfg.queue_name, namespace=d.worker.cfg.queue_namespace)
        decisions = ray.get(queue.prefix_decisions.remote())
        assert after[holder] == 1 + len(follow), f"the holder {holder} did not get them all: {after}, {decisions}"
        counters = d.call(d.worker.queue.stats).counters
        # Each follow-up went to the holder: pulled by it (routed) or kept from the other (kept).
        assert counters.get("prefix_routed", 0) + counters.get("prefix_kept", 0) >= len(follow), counters
        # What was kept from the other worker says so, with its figures.
        assert all(x["best"] == holder and x["kept"] and x["best_cached_tokens"] >= 304 for x in decisions), decisions
    finally:
        for a in actors.values():
            stop_quietly(a)
        d.stop()


def tp_engine(tp: int, **engine) -> dict:
    """Engine args at ``tp`` ranks (HND: loans between TP sizes read head ranges); skipped where
    a rank group cannot start."""
    if tp > 1 and shm_available() is not None:
        pytest.skip(f"TP needs shm: {shm_available()}")
    return {**engine, "kv_layout": "HND", "tensor_parallel_size": tp} if tp > 1 else engine


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_a_local_prefill_borrows_the_prefix_a_prefill_worker_holds(ray_local, etcd, llama_dir, prefill_tp):
    """Prefix reuse across workers (decode/borrow.py, kvtransfer/lending.py): a prefill worker
    computed a shared prefix for decode worker 0; decode worker 1, which never saw it, prefills
    requests with that prefix itself (route local) and reads those blocks from the prefill
    worker with NIXL instead of computing them: token-exact, every loan released, no block
    left taken on either side. Each side met the other as it joined, not inside the loan's
    wait (the lender never waited for its borrower's NIXL record). With a TP=2 prefill
    worker the decode worker reads each half of the heads from the rank that holds it."""
    engine = {"kv_events": True, "device": "cpu", **({"kv_layout": "HND"} if prefill_tp > 1 else {})}
    cluster = f"borrowd{prefill_tp}"
    decodes = [WorkerThread(DecodeWorkerConfig(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=cluster, lease_ttl_s=3, worker_id=f"decode-{i}",
        remote_prefill=True, ucx_env=UCX, remote_timeout_s=60, engine_args=engine)).start() for i in (0, 1)]
    d0, d1 = decodes
    actor = ray.remote(PrefillWorker).options(num_cpus=0).remote(dict(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=cluster, lease_ttl_s=3, worker_id="prefill-0",
        ucx_env=UCX, engine_args=tp_engine(prefill_tp, **engine)))
    try:
        ray.get(actor.start.remote(), timeout=180)
        for d in decodes:
            view = d.worker.remote.prefix_view
            wait_until(lambda: d.worker.remote.available()
                       and view.status()["workers"].get("prefill-0", {}).get("synced")
                       and "prefill-0" in d.worker.remote.peers.agent.peers, 30)
        wait_until(lambda: {"decode-0", "decode-1"} <= set(ray.get(actor.get_stats.remote())["peers"]), 30)
        rng = random.Random(11)
        shared = [rng.randrange(3, 32000) for _ in range(320)]
        (out,) = run_all(d0, [shared + [rng.randrange(3, 32000) for _ in range(30)]], route="remote")
        view = d1.worker.remote.prefix_view
        wait_until(lambda: view.cached_tokens(shared).get("prefill-0", 0) >= 304, 20)
        follow = [shared + [rng.randrange(3, 32000) for _ in range(rng.randint(10, 40))] for _ in range(3)]
        want = references(llama_dir, follow)
        for prompt, tokens in zip(follow, want):
            (o,) = run_all(d1, [prompt], route="local")
            assert o.token_ids == tokens
            assert o.breakdown["route"] == "local"
        peers = d1.worker.remote.peers
        # The first follow-up borrowed the shared blocks; the others found them in decode-1's pool.
        assert peers.counters["borrows"] == 1 and peers.counters["borrowed_tokens"] >= 304, peers.counters

        def lending():
            return ray.get(actor.get_stats.remote())["lending"]

        wait_until(lambda: lending()["lender"].get("released", 0) == lending()["lender"].get("granted", 0), 20)
        assert lending()["lender"]["granted"] == 1 and lending()["lent_blocks"] == 0, lending()
        assert lending()["lender"].get("awaiting_peer", 0) == 0, lending()  # decode-1 was met as it joined
        for d in decodes:
            eng = d.worker.engine
            wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30)
    finally:
        stop_quietly(actor)
        for d in decodes:
            d.stop()


@pytest.mark.parametrize("decode_tp,prefill_tp", [(1, 1), (2, 1), (1, 2)])
def test_a_prefill_worker_borrows_the_prefix_its_decode_worker_holds(ray_local, etcd, llama_dir, decode_tp,
                                                                      prefill_tp):
    """The other direction: a conversation whose first turn the decode worker prefilled itself
    goes remote for its next turn. The task's decode worker holds the first turn's blocks
    (the task's cached_len); the prefill worker, which never saw them, reads them from it
    (prefill/loans.py PrefixLoans.borrow) and computes only the new turn: token-exact, the
    loan released, every block back; the decode worker had met its borrower as it joined.
    Either side may be tensor-parallel: each borrower rank reads its heads from the holder
    rank that holds them."""
    engine = {"device": "cpu", **({"kv_layout": "HND"} if max(decode_tp, prefill_tp) > 1 else {})}
    cluster = f"borrowp{decode_tp}{prefill_tp}"
    d = WorkerThread(DecodeWorkerConfig(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=cluster, lease_ttl_s=3, worker_id="decode-0",
        remote_prefill=True, ucx_env=UCX, remote_timeout_s=60, engine_args=tp_engine(decode_tp, **engine))).start()
    actor = ray.remote(PrefillWorker).options(num_cpus=0).remote(dict(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=cluster, lease_ttl_s=3, worker_id="prefill-0",
        ucx_env=UCX, engine_args=tp_engine(prefill_tp, **engine)))
    try:
        ray.get(actor.start.remote(), timeout=180)
        wait_until(lambda: d.worker.remote.available() and "prefill-0" in d.worker.remote.peers.agent.peers, 30)
        rng = random.Random(12)
        first = [rng.randrange(3, 32000) for _ in range(320)]
        (o1,) = run_all(d, [first], route="local")
        second = first + o1.token_ids + [rng.randrange(3, 32000) for _ in range(40)]
        (o2,) = run_all(d, [second], route="remote")
        assert o2.token_ids == reference(llama_dir, [second])[0]
        assert o2.breakdown["route"] == "remote"
        stats = ray.get(actor.get_stats.remote())
        assert stats["borrows"] == {"read": 1}, stats
        assert stats["borrowed_tokens"] >= 320, stats  # the first turn was read, not computed
        assert stats["tokens_computed"] < len(second) - 300, stats
        lender = d.worker.remote.peers.lending.lender
        wait_until(lambda: lender.counters["released"] == lender.counters["granted"] == 1, 20)
        assert lender.counters.get("awaiting_peer", 0) == 0, lender.counters
        eng = d.worker.engine
        wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30)
    finally:
        stop_quietly(actor)
        d.stop()


def test_a_restarted_prefill_worker_borrows_again_from_the_decode_worker(ray_local, etcd, llama_dir):
    """A prefill worker SIGKILLed and restarted by Ray under the same id has a new NIXL agent.
    The decode worker, which met its first agent, loads the new one's record (its record's
    agent_incarnation changed) and lends to it: the next turn is borrowed and read, not timed
    out. (Before, the decode worker kept the dead agent's metadata: every grant went nowhere
    and every loan after a restart timed out; the chaos soak's loan_race found it.)"""
    import os
    import signal

    from pdserve.cluster.actors import restartable

    engine = {"device": "cpu"}
    cluster = "borrowrestart"
    d = WorkerThread(DecodeWorkerConfig(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=cluster, lease_ttl_s=3, worker_id="decode-0",
        remote_prefill=True, ucx_env=UCX, remote_timeout_s=60, engine_args=engine)).start()
    actor = ray.remote(restartable(PrefillWorker)).options(num_cpus=0, max_restarts=1).remote(dict(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=cluster, lease_ttl_s=3, worker_id="prefill-0",
        ucx_env=UCX, engine_args=engine, exit_on_loop_death=True))
    try:
        ray.get(actor.start.remote(), timeout=180)
        peers = d.worker.remote.peers
        wait_until(lambda: d.worker.remote.available() and "prefill-0" in peers.agent.peers, 30)
        from pdserve.kvtransfer.lend import AGENT_INCARNATION_KEY

        members = d.worker.prefill_watch.members  # the decode worker's view of the prefill records
        first = members["prefill-0"].capacity[AGENT_INCARNATION_KEY]
        old_pid = ray.get(actor.pid.remote(), timeout=30)
        os.kill(old_pid, signal.SIGKILL)
        # The decode worker has seen the restarted worker's record (a new agent) ...
        wait_until(lambda: "prefill-0" in members
                   and members["prefill-0"].capacity.get(AGENT_INCARNATION_KEY) != first, 120, 0.1)

        def restarted_and_met() -> bool:
            try:
                stats = ray.get(actor.get_stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001  (still restarting)
                return False
            return stats["pid"] != old_pid and stats["loop_alive"] and "decode-0" in stats["peers"]

        wait_until(restarted_and_met, 120, 0.2)  # ... and the new worker has met the decode worker
        wait_until(d.worker.remote.available, 30)
        rng = random.Random(13)
        turn1 = [rng.randrange(3, 32000) for _ in range(320)]
        (o1,) = run_all(d, [turn1], route="local")
        second = turn1 + o1.token_ids + [rng.randrange(3, 32000) for _ in range(40)]
        (o2,) = run_all(d, [second], route="remote")
        assert o2.token_ids == reference(llama_dir, [second])[0]
        assert o2.breakdown["route"] == "remote", o2.breakdown
        stats = ray.get(actor.get_stats.remote())
        assert stats["borrows"] == {"read": 1}, stats  # before the fix: {"timed_out": 1}
        eng = d.worker.engine
        wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30)
    finally:
        stop_quietly(actor)
        d.stop()
