"""Speculative decoding across the prefill/decode hop (docs/speculative.md): the decode side
speculates (n-gram proposals need no draft KV) on requests whose prompt KV a prefill worker
wrote, and its greedy output equals the local path's with speculation and without it, token for
token, while proposals do get accepted.

First at the engines (the set-up of tests/kvtransfer/test_structured_handoff.py): the prefill
side's real batch runner (prefill/batch.py, tensor-parallel where asked) writing KV through real
NIXL agents, the decode side's engine reading its notices and running the requests from the first
token on. Then a 1P1D cluster (the set-up of tests/e2e/test_disaggregated.py: real etcd, the
prefill worker a Ray actor, the decode worker in this process with ``speculative_config``),
requests forced remote through gRPC, their breakdowns carrying the proposals accepted.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import ray

from pdserve.api import AsyncClient
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer import PrefillDone, PrefillTask
from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV, KVLayout, KVTransferAgent
from pdserve.kvtransfer.nixl.ranks import ranks_record
from pdserve.kvtransfer.nixl.tp_receiver import TPReceiver
from pdserve.kvtransfer.nixl.tp_sender import TPSender
from pdserve.prefill.worker import PrefillWorker
from tests.e2e.test_disaggregated import UCX, etcd, ray_local  # noqa: F401  (module fixtures)
from tests.harness import WorkerThread, wait_until
from tests.kvtransfer.test_structured_handoff import prefill
from tests.kvtransfer.test_tp_handoff import EXTENSION

pytestmark = pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 32


def start(model: str, worker_id: str, tp: int, **engine_args):
    """An engine over an HND pool with its NIXL agent(s) (one per rank when tensor-parallel)."""
    eng = LLMEngine(EngineConfig.from_kwargs(model, tensor_parallel_size=tp, kv_layout="HND",
                                             tp_rank_extension=EXTENSION if tp > 1 else None,
                                             num_gpu_blocks_override=96, max_num_batched_tokens=512, **engine_args))
    m = eng.model_config
    layout = KVLayout.from_tensor(eng.connector.kv_tensor, m.model_id, kv_layout="HND",
                                  total_kv_heads=m.num_kv_heads, tp_size=tp, tp_rank=0)
    agent = KVTransferAgent(worker_id, eng.connector.kv_tensor, layout, ucx_env=LOOPBACK_UCX_ENV)
    infos = [agent.local_info()]
    if tp > 1:
        infos += [r["info"] for r in eng.runner.group.call("open", worker_id=worker_id, model_id=m.model_id,
                                                             total_kv_heads=m.num_kv_heads,
                                                             ucx_env=dict(LOOPBACK_UCX_ENV))]
    return eng, agent, infos


def repetitive(seed: int) -> list[list[int]]:
    """Phrases said again and again (proposals get accepted), and two random prompts."""
    rng = random.Random(seed)
    out = [[rng.randrange(3, 900) for _ in range(rng.randrange(3, 9))] * rng.randrange(3, 7) for _ in range(6)]
    return out + [[rng.randrange(3, 32000) for _ in range(n)] for n in (17, 40)]


@pytest.mark.parametrize("p_tp", [1, 2])
def test_remote_prompt_kv_then_speculation_equals_local_with_and_without_it(model_dirs, p_tp):
    model = model_dirs("llama")
    ps = repetitive(seed=90 + p_tp)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model) as plain:
        want = [o.token_ids for o in plain.generate(ps, params)]
    with LLM(model, speculative_config=NGRAM) as local_spec:
        assert [o.token_ids for o in local_spec.generate(ps, params)] == want
    pe, p_agent, _ = start(model, f"spp{p_tp}", p_tp)
    de, d_agent, d_infos = start(model, f"spd{p_tp}", 1, speculative_config=NGRAM)
    try:
        heads = pe.model_config.num_kv_heads
        sender = TPSender(p_agent, heads, p_tp, pe.runner.group)
        peer = sender.add_peer(ranks_record(d_agent.name, d_infos))
        receiver = TPReceiver(d_agent, heads, 1, None)
        tasks = []
        for i, p in enumerate(ps):
            res = de.connector.reserve(de.make_request(p, params, request_id=f"s{i}"))
            assert res is not None
            tasks.append(PrefillTask(f"s{i}", 1, p, res.cached_len, peer, res.block_ids, params.to_dict()))
        result, arrived = prefill(pe, p_agent, sender, receiver, tasks)
        assert result.failures == [] and result.done == len(tasks)
        assert all(isinstance(m, PrefillDone) for m in arrived) and len(arrived) == len(tasks)
        for msg in arrived:
            de.connector.remote_ready(msg.request_id, msg.first_token_id, msg.first_token_logprob)
        computed = de.stats.num_prompt_tokens_computed
        while de.has_work():
            de.step()
        got = [de.release(f"s{i}") for i in range(len(ps))]
        assert [o.token_ids for o in got] == want
        assert de.stats.num_prompt_tokens_computed == computed  # the prompts' KV came from the prefill side
        # Not vacuous: the decode side verified proposals and accepted many of them.
        assert de.stats.num_spec_accepted_tokens > 40
        accepted = [o.times.spec_tokens[1] for o in got]
        assert sum(accepted) == de.stats.num_spec_accepted_tokens and all(a > 0 for a in accepted[:6])
        assert de.kv.num_free_blocks == de.runner.num_blocks
        assert pe.kv.num_free_blocks == pe.runner.num_blocks
    finally:
        for agent in (p_agent, d_agent):
            agent.close()
        pe.close()
        de.close()


@pytest.fixture(scope="module")
def cluster(ray_local, etcd, llama_dir):  # noqa: F811  (the fixtures imported above)
    """1P1D: a decode worker that speculates and routes remote, and a prefill worker (a Ray actor)."""
    common = dict(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster="e2e-spec", lease_ttl_s=3, ucx_env=UCX)
    d = WorkerThread(DecodeWorkerConfig(**common, worker_id="decode-0", remote_prefill=True, remote_timeout_s=60,
                                        engine_args={"speculative_config": NGRAM})).start()
    p = None
    try:
        p = ray.remote(PrefillWorker).options(num_cpus=0).remote(dict(**common, worker_id="prefill-0"))
        ray.get(p.start.remote(), timeout=180)
        wait_until(lambda: d.worker.frontend.prefill_view.pool_size >= 1 and d.worker.remote.available(), 30)
        yield d
    finally:
        if p is not None:
            ray.get(p.stop.remote(), timeout=30)
        d.stop()


def test_a_speculating_decode_worker_serves_remote_prefills_token_exact(cluster, llama_dir):
    d = cluster
    ps = repetitive(seed=95)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir) as plain:
        want = [o.token_ids for o in plain.generate(ps, params)]
    eng = d.worker.engine
    computed, accepted0 = eng.stats.num_prompt_tokens_computed, eng.stats.num_spec_accepted_tokens

    async def go():
        async with AsyncClient(d.grpc) as c:
            return await asyncio.gather(*(c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                     route="remote", priority="high", timeout_s=180) for p in ps))

    outs = asyncio.run(go())
    assert [o.token_ids for o in outs] == want
    assert all(o.breakdown["route"] == "remote" and o.breakdown["transfer_bytes"] > 0 for o in outs)
    assert eng.stats.num_prompt_tokens_computed == computed  # every prompt's KV came from the prefill worker
    accepted = [o.breakdown["spec_accepted_tokens"] for o in outs]
    assert sum(accepted) == eng.stats.num_spec_accepted_tokens - accepted0 > 40 and all(a > 0 for a in accepted[:6])
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30)
