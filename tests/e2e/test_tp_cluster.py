"""Workers of different TP sizes in one cluster, end to end: real etcd, Ray and NIXL on CPU.

A TP=2 prefill worker (a Ray actor whose engine runs two rank processes, each with its own
NIXL agent) serves a TP=1 decode worker (this process), and a TP=1 prefill worker serves a
TP=2 decode worker; both decode workers use HND pools, as a topology with different TP
sizes sets them. Requests forced remote come back token for token as `LLM.generate` makes
them, and the decode worker ends with every block free. Then one rank of the TP=2 prefill
worker is killed: the requests in flight or sent next complete locally, token-exact, and
the worker leaves etcd and is restarted whole by Ray. The same when the rank dies in the
middle of a request's write (after posting its first layer; tests/e2e/tp_fault_extension.py).
"""

from __future__ import annotations

import os
import signal

import pytest
import ray

from pdserve.cluster.actors import restartable
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tp_comm import shm_available
from pdserve.prefill.worker import PrefillWorker
from tests.harness import WorkerThread, wait_until

from .test_disaggregated import etcd, mixed_prompts, ray_local, run_all  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")

UCX = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
TTL_S = 3
MAX_TOKENS = 10


def reference(model, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in LLM(model).generate(prompts, params)]


def start(model, etcd, cluster: str, prefill_tp: int, decode_tp: int, restarts: int = 0,
          prefill_args: dict | None = None, prefill_env: dict | None = None, quarantine_s: float = 60.0):
    engine = {"kv_layout": "HND", "device": "cpu"}
    d = WorkerThread(DecodeWorkerConfig(
        model=model, etcd_endpoints=[etcd.endpoint], cluster=cluster, lease_ttl_s=TTL_S, worker_id="decode-0",
        remote_prefill=True, ucx_env=UCX, remote_timeout_s=60, remote_quarantine_s=quarantine_s,
        engine_args={**engine, "tensor_parallel_size": decode_tp})).start()
    # As `pdserve up` starts it (cluster/actors.py): Ray restarts the process, `restartable` starts it again.
    options = {"runtime_env": {"env_vars": prefill_env}} if prefill_env else {}
    actor = ray.remote(restartable(PrefillWorker)).options(num_cpus=0, max_restarts=restarts, **options).remote(dict(
        model=model, etcd_endpoints=[etcd.endpoint], cluster=cluster, lease_ttl_s=TTL_S, worker_id="prefill-0",
        ucx_env=UCX, engine_args={**engine, "tensor_parallel_size": prefill_tp, **(prefill_args or {})},
        exit_on_loop_death=True))
    ray.get(actor.start.remote(), timeout=180)
    wait_until(lambda: d.worker.frontend.prefill_view.pool_size >= 1 and d.worker.remote.available(), 30)
    return d, actor


def stop(d, actor) -> None:
    try:
        ray.get(actor.stop.remote(), timeout=30)
    except Exception:  # noqa: BLE001  (killed by the test)
        pass
    ray.kill(actor)
    d.stop()


def assert_all_blocks_return(d):
    eng = d.worker.engine
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_remote_prefill_between_tp_sizes_is_token_exact(ray_local, etcd, llama_dir, prefill_tp, decode_tp):
    d, actor = start(llama_dir, etcd, f"tp{prefill_tp}{decode_tp}", prefill_tp, decode_tp)
    try:
        assert len(ray.get(actor.get_stats.remote())["tp_ranks"]) == prefill_tp - 1
        prompts = mixed_prompts(8, seed=prefill_tp)
        outs = run_all(d, prompts, route="remote")
        assert [o.token_ids for o in outs] == reference(llama_dir, prompts)
        assert {o.breakdown["route"] for o in outs} == {"remote"}
        assert_all_blocks_return(d)
    finally:
        stop(d, actor)


def test_a_killed_prefill_rank_fails_over_to_local_and_the_worker_restarts(ray_local, etcd, llama_dir):
    d, actor = start(llama_dir, etcd, "tpkill", 2, 1, restarts=1)
    try:
        stats = ray.get(actor.get_stats.remote())
        (rank_pid,) = stats["tp_ranks"]
        os.kill(rank_pid, signal.SIGKILL)
        prompts = mixed_prompts(6, seed=7)
        outs = run_all(d, prompts, route="remote")
        # Token-exact whatever path each took; the ones the broken worker took fell back locally.
        assert [o.token_ids for o in outs] == reference(llama_dir, prompts)
        assert any(o.breakdown["route"] == "local" for o in outs)
        assert_all_blocks_return(d)
        assert_restarted(d, actor, stats, rank_pid)
    finally:
        stop(d, actor)


def test_a_prefill_rank_killed_during_its_write_fails_over_to_local(ray_local, etcd, llama_dir, tmp_path):
    """Rank 1 of the TP=2 prefill worker SIGKILLs itself right after posting the first layer of
    a request's pages (tests/e2e/tp_fault_extension.py): part of the KV is in the decode pool,
    the rest never comes. Every request completes, token-exact. The blocks that request had
    reserved are quarantined, not reused at once (rank 0 cannot vouch that nothing of the
    dead rank's is still in flight: over TCP its sent bytes can land after it died), and come
    back when the quarantine ends: the decode pool ends whole. Ray brings the worker back."""
    kill_file = tmp_path / "kill-mid-stream"
    d, actor = start(llama_dir, etcd, "tpkillw", 2, 1, restarts=1, quarantine_s=10.0,
                     prefill_args={"tp_rank_extension": "tests.e2e.tp_fault_extension:KillMidStream"},
                     prefill_env={"PDSERVE_TEST_KILL_FILE": str(kill_file)})
    try:
        stats = ray.get(actor.get_stats.remote())
        (rank_pid,) = stats["tp_ranks"]
        kill_file.touch()
        prompts = mixed_prompts(6, seed=11)
        outs = run_all(d, prompts, route="remote")
        assert not kill_file.exists(), "no rank reached a streamed layer: the fault never fired"
        assert d.worker.remote.handoffs.quarantined(), "the half-written attempt's blocks were not held back"
        assert [o.token_ids for o in outs] == reference(llama_dir, prompts)
        assert any(o.breakdown["route"] == "local" for o in outs)
        assert_all_blocks_return(d)
        assert not d.worker.remote.handoffs.quarantined()
        assert_restarted(d, actor, stats, rank_pid)
    finally:
        stop(d, actor)


def assert_restarted(d, actor, stats, rank_pid) -> None:
    """The worker left etcd and Ray restarted it with fresh ranks, back in the pool, serving remote."""
    new_pid = None

    def restarted():
        nonlocal new_pid
        try:
            st = ray.get(actor.get_stats.remote(), timeout=5)
        except Exception:  # noqa: BLE001  (restarting)
            return False
        new_pid = st["tp_ranks"][0] if st.get("tp_ranks") else None
        return st["pid"] != stats["pid"] and new_pid is not None and st["loop_alive"]

    wait_until(restarted, 120, interval_s=0.5)
    assert new_pid != rank_pid
    wait_until(lambda: d.worker.frontend.prefill_view.pool_size >= 1 and d.worker.remote.available(), 60)
    again = mixed_prompts(4, seed=8)
    outs = run_all(d, again, route="remote")
    assert [o.token_ids for o in outs] == reference(d.worker.cfg.model, again)
    assert {o.breakdown["route"] for o in outs} == {"remote"}
