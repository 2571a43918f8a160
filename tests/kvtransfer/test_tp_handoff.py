"""Remote prefill between workers of different TP sizes, token for token equal to the local path.

Both engines are real and tensor-parallel (rank processes, each rank with its own NIXL agent
over its own HND pool: kvtransfer/nixl/rank_service.py); the prefill side is the real batch
runner (prefill/batch.py) over `TPSender`, the decode side reads its ranks' notices through
`TPReceiver` and runs the requests from the first token on. Eight concurrent requests, the
decode pool fragmented (non-contiguous target blocks), prompts with a partial last block,
and one sharing a prefix the decode worker has cached.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer import PrefillDone, PrefillTask, decode_notification
from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV, KVLayout, KVTransferAgent
from pdserve.kvtransfer.nixl.ranks import ranks_record
from pdserve.kvtransfer.nixl.tp_receiver import TPReceiver
from pdserve.kvtransfer.nixl.tp_sender import TPSender
from pdserve.prefill.batch import PrefillBatch
from pdserve.prefill.values import PrefillStats

pytestmark = pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")

EXTENSION = "pdserve.kvtransfer.nixl.rank_service:RankTransfer"
MAX_TOKENS = 8


def start(model: str, worker_id: str, tp: int):
    eng = LLMEngine(EngineConfig.from_kwargs(model, tensor_parallel_size=tp, kv_layout="HND",
                                             tp_rank_extension=EXTENSION if tp > 1 else None,
                                             num_gpu_blocks_override=96, max_num_batched_tokens=512))
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


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 32000) for _ in range(48)]  # three whole blocks the decode side caches
    out = [shared + [rng.randrange(3, 32000) for _ in range(21)]]
    out += [[rng.randrange(3, 32000) for _ in range(n)] for n in (5, 16, 17, 40, 63, 100, 131)]
    return out


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_remote_prefill_across_tp_sizes_equals_local(model_dirs, p_tp, d_tp, layerwise):
    model = model_dirs("llama")  # 8 query heads, 2 KV heads: split at TP 2, replicated at TP 4
    ps = prompts(seed=p_tp * 10 + d_tp)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    want = [o.token_ids for o in LLM(model).generate(ps, params)]
    pe, p_agent, _ = start(model, f"pf{p_tp}{d_tp}{int(layerwise)}", p_tp)
    de, d_agent, d_infos = start(model, f"dc{p_tp}{d_tp}{int(layerwise)}", d_tp)
    try:
        heads = pe.model_config.num_kv_heads
        sender = TPSender(p_agent, heads, p_tp, pe.runner.group)
        peer = sender.add_peer(ranks_record(d_agent.name, d_infos))
        receiver = TPReceiver(d_agent, heads, d_tp, de.runner.group)
        # The decode worker caches the first prompt's shared prefix, and fragments its pool.
        de.add_request(ps[0][:48] + [7], SamplingParams(max_tokens=1), request_id="warm")
        while de.has_work():
            de.step()
        de.release("warm")
        hold = []
        while de.kv.num_free_blocks > 8:  # the pool's blocks in order (the cached prefix is freed last, kept)
            hold.append(de.make_request([3 + len(hold)] * 15, SamplingParams(max_tokens=1),
                                        request_id=f"hold{len(hold)}"))
            assert de.connector.reserve(hold[-1]) is not None
        for r in hold[::2]:
            de.connector.abort(r.request_id)  # every other block free: targets interleave with held ones
        tasks = []
        for i, p in enumerate(ps):
            req = de.make_request(p, params, request_id=f"r{i}")
            res = de.connector.reserve(req)
            assert res is not None
            tasks.append(PrefillTask(f"r{i}", 1, p, res.cached_len, peer, res.block_ids,
                                     {"max_tokens": MAX_TOKENS, "temperature": 0.0}))
        assert tasks[0].cached_len == 48
        assert any(b - a != 1 for t in tasks for a, b in zip(t.target_block_ids, t.target_block_ids[1:]))
        # The decode worker's loop polls its transport all the time (a NIXL target must, or
        # connection wire-up stalls); here a thread does, while the prefill batch runs.
        arrived: list = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                arrived.extend(decode_notification(n.payload) for n in receiver.poll().notifications)
                time.sleep(0.001)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            batch = PrefillBatch(p_agent.name, pe, sender, PrefillStats(), transfer_timeout_s=20.0,
                                 layerwise=layerwise)
            result = batch.run(tasks, {})
            assert result.failures == [] and result.done == len(tasks)
            assert pe.kv.num_free_blocks == pe.runner.num_blocks  # the prefill side keeps nothing
            deadline = time.monotonic() + 60
            while len(arrived) < len(tasks) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            stop.set()
            poller.join(10)
        assert all(isinstance(m, PrefillDone) for m in arrived)
        done: dict[str, PrefillDone] = {m.request_id: m for m in arrived}
        assert len(done) == len(arrived) == len(tasks)  # one notice per attempt, once all ranks wrote
        assert receiver.arrivals.unexpected == 0 and receiver.arrivals.waiting() == {}
        for rid, msg in done.items():
            de.connector.remote_ready(rid, msg.first_token_id, msg.first_token_logprob)
        while de.has_work():
            de.step()
        got = [de.release(f"r{i}").token_ids for i in range(len(ps))]
        assert got == want
        for r in hold[1::2]:
            de.connector.abort(r.request_id)
        assert de.kv.num_free_blocks == de.runner.num_blocks  # nothing leaked on the decode side
    finally:
        for agent in (p_agent, d_agent):
            agent.close()
        pe.close()
        de.close()
