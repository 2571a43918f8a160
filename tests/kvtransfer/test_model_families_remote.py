"""Remote prefill of Qwen3, Qwen3-MoE and Mixtral, token for token equal to the local path.

The set-up of test_tp_handoff.py: real engines on both sides (tensor-parallel where asked), the
prefill side the real batch runner (prefill/batch.py) over `TPSender`, pages written by real NIXL
agents, the decode side running the requests from the prefill worker's first token; one prompt
shares a prefix the decode worker has cached.
"""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_maker import make_model
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer import PrefillDone, PrefillTask
from pdserve.kvtransfer.nixl.ranks import ranks_record
from pdserve.kvtransfer.nixl.tp_receiver import TPReceiver
from pdserve.kvtransfer.nixl.tp_sender import TPSender
from tests.engine.test_model_families import SPECS
from tests.kvtransfer.test_structured_handoff import prefill
from tests.kvtransfer.test_tp_handoff import prompts, start

pytestmark = pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = make_model(str(tmp_path_factory.mktemp("remote") / name), SPECS[name])
        return made[name]

    return get


@pytest.mark.parametrize("name,p_tp", [("qwen3", 1), ("qwen3_moe", 1), ("mixtral", 1), ("qwen3_moe", 2)])
def test_remote_prefill_equals_local(family_dir, name, p_tp):
    model = family_dir(name)
    ps = prompts(seed=len(name) + p_tp)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    want = [o.token_ids for o in LLM(model).generate(ps, params)]
    pe, p_agent, _ = start(model, f"fp{name}{p_tp}", p_tp)
    de, d_agent, d_infos = start(model, f"fd{name}{p_tp}", 1)
    try:
        heads = pe.model_config.num_kv_heads
        sender = TPSender(p_agent, heads, p_tp, pe.runner.group)
        peer = sender.add_peer(ranks_record(d_agent.name, d_infos))
        receiver = TPReceiver(d_agent, heads, 1, de.runner.group)
        de.add_request(ps[0][:48] + [7], SamplingParams(max_tokens=1), request_id="warm")  # caches the prefix
        while de.has_work():
            de.step()
        de.release("warm")
        tasks = []
        for i, p in enumerate(ps):
            res = de.connector.reserve(de.make_request(p, params, request_id=f"r{i}"))
            assert res is not None
            tasks.append(PrefillTask(f"r{i}", 1, p, res.cached_len, peer, res.block_ids,
                                     {"max_tokens": MAX_TOKENS, "temperature": 0.0}))
        assert tasks[0].cached_len == 48
        result, arrived = prefill(pe, p_agent, sender, receiver, tasks)
        assert result.failures == [] and result.done == len(tasks)
        done = {m.request_id: m for m in arrived}
        assert all(isinstance(m, PrefillDone) for m in arrived) and len(done) == len(tasks)
        assert [done[f"r{i}"].first_token_id for i in range(len(ps))] == [w[0] for w in want]
        for rid, msg in done.items():
            de.connector.remote_ready(rid, msg.first_token_id, msg.first_token_logprob)
        while de.has_work():
            de.step()
        assert [de.release(f"r{i}").token_ids for i in range(len(ps))] == want
        assert de.kv.num_free_blocks == de.runner.num_blocks
        assert pe.kv.num_free_blocks == pe.runner.num_blocks
    finally:
        for agent in (p_agent, d_agent):
            agent.close()
        pe.close()
        de.close()
