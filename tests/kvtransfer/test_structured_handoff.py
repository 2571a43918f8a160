"""Structured outputs across the prefill/decode hop, token for token equal to the local path.

The prefill worker samples the first token under the request's grammar (its task carries the
grammar in its sampling parameters; prefill/batch.py), the decode worker's matcher starts from
the prompt plus that token (`LLMEngine.append_token`) and constrains the rest. Real engines on
both sides, tensor-parallel where asked, KV written by real NIXL agents (the set-up of
test_tp_handoff.py); every grammar kind in one batch of eight concurrent requests.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer import PrefillDone, PrefillTask, decode_notification
from pdserve.kvtransfer.nixl.ranks import ranks_record
from pdserve.kvtransfer.nixl.tp_receiver import TPReceiver
from pdserve.kvtransfer.nixl.tp_sender import TPSender
from pdserve.prefill.batch import PrefillBatch
from pdserve.prefill.values import PrefillStats
from tests.kvtransfer.test_tp_handoff import prompts, start

pytestmark = pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")

MAX_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
# One spec per request, each grammar kind twice (greedy). Bounded grammars (and JSON without free
# whitespace): a random-weight model must close them within MAX_TOKENS.
SPECS = [
    {"json": SCHEMA, "disable_any_whitespace": True}, {"json": json.dumps(SCHEMA), "disable_any_whitespace": True},
    {"regex": r"[a-z]{2,8}-[0-9]{1,3}"}, {"regex": r"(yes|no|maybe)!"},
    {"choice": ["alpha", "beta", "gamma delta"]}, {"choice": ["0", "1"]},
    {"grammar": 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c]{1,3}'}, {"json_object": True},
]


def holds(spec: dict, text: str) -> bool:
    """The text is a complete sentence of the grammar (what a stop on its end must give)."""
    if "json" in spec:
        v = json.loads(text)
        return set(v) == {"name", "n"} and len(v["name"]) <= 6 and 0 <= v["n"] <= 99
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    if "choice" in spec:
        return text in spec["choice"]
    if "grammar" in spec:
        return re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3}){0,3}\)", text) is not None
    return isinstance(json.loads(text), dict)


def prefill(pe, p_agent, sender, receiver, tasks) -> tuple:
    """Run the prefill batch over ``tasks`` while a thread polls the decode side's transport
    (a NIXL target must poll, or wire-up stalls); the batch's result and the notices."""
    arrived: list = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            arrived.extend(decode_notification(n.payload) for n in receiver.poll().notifications)
            time.sleep(0.001)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        result = PrefillBatch(p_agent.name, pe, sender, PrefillStats(), transfer_timeout_s=20.0,
                              layerwise=False).run(tasks, {})
        deadline = time.monotonic() + 60
        while len(arrived) < len(tasks) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        poller.join(10)
    return result, arrived

@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1)])
def test_every_grammar_kind_is_token_exact_across_the_hop(model_dirs, p_tp, d_tp):
    model = model_dirs("llama")
    ps = prompts(seed=70 + p_tp)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=s) for s in SPECS]
    local = LLM(model).generate(ps, params)
    want = [o.token_ids for o in local]
    # json_object may run out of room on a random model; every other kind must end by its grammar
    for spec, o in zip(SPECS, local):
        if "json_object" not in spec:
            assert o.finish_reason == "stop" and holds(spec, o.text), (spec, o.text, o.finish_reason)
    pe, p_agent, _ = start(model, f"sgp{p_tp}{d_tp}", p_tp)
    de, d_agent, d_infos = start(model, f"sgd{p_tp}{d_tp}", d_tp)
    try:
        heads = pe.model_config.num_kv_heads
        sender = TPSender(p_agent, heads, p_tp, pe.runner.group)
        peer = sender.add_peer(ranks_record(d_agent.name, d_infos))
        receiver = TPReceiver(d_agent, heads, d_tp, de.runner.group)
        tasks = []
        for i, (p, sp) in enumerate(zip(ps, params)):
            req = de.make_request(p, sp, request_id=f"g{i}")
            res = de.connector.reserve(req)
            assert res is not None
            tasks.append(PrefillTask(f"g{i}", 1, p, res.cached_len, peer, res.block_ids, sp.to_dict()))
        result, arrived = prefill(pe, p_agent, sender, receiver, tasks)
        assert result.failures == [] and result.done == len(tasks)
        done = {m.request_id: m for m in arrived}
        assert all(isinstance(m, PrefillDone) for m in arrived) and len(done) == len(tasks)
        # The first token of each came from the prefill worker, sampled under the grammar.
        assert [done[f"g{i}"].first_token_id for i in range(len(ps))] == [w[0] for w in want]
        for rid, msg in done.items():
            de.connector.remote_ready(rid, msg.first_token_id, msg.first_token_logprob)
        while de.has_work():
            de.step()
        got = [de.release(f"g{i}") for i in range(len(ps))]
        assert [o.token_ids for o in got] == want
        assert [o.finish_reason for o in got] == [o.finish_reason for o in local]
        assert de.kv.num_free_blocks == de.runner.num_blocks
        assert pe.kv.num_free_blocks == pe.runner.num_blocks
    finally:
        for agent in (p_agent, d_agent):
            agent.close()
        pe.close()
        de.close()


def test_a_grammar_the_prefill_worker_cannot_compile_fails_its_task_alone_and_decodes_locally(model_dirs):
    """The prefill worker's compile fails (a compiler error there; the decode worker compiled it
    fine): that one task fails with the compiler's reason, the others are written, the
    decode worker prefills it locally (`fall_back`) with the same tokens, and nothing leaks."""
    from pdserve.kvtransfer import BAD_TASK, REQUEST_FAILED, PrefillFailed

    model = model_dirs("llama")
    ps = prompts(seed=77)[:3]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=s) for s in SPECS[2:5]]
    want = [o.token_ids for o in LLM(model).generate(ps, params)]
    pe, p_agent, _ = start(model, "sgfp", 1)
    de, d_agent, d_infos = start(model, "sgfd", 1)
    doomed = params[1].structured_outputs

    def refuse(spec) -> None:
        if spec.kind == "regex" and spec.source == doomed["regex"]:
            raise RuntimeError("injected: this worker's compiler fails")

    pe.grammars.before_compile = refuse
    try:
        sender = TPSender(p_agent, pe.model_config.num_kv_heads, 1, None)
        peer = sender.add_peer(ranks_record(d_agent.name, d_infos))
        receiver = TPReceiver(d_agent, de.model_config.num_kv_heads, 1, None)
        tasks = []
        for i, (p, sp) in enumerate(zip(ps, params)):
            res = de.connector.reserve(de.make_request(p, sp, request_id=f"f{i}"))
            assert res is not None
            tasks.append(PrefillTask(f"f{i}", 1, p, res.cached_len, peer, res.block_ids, sp.to_dict()))
        result, arrived = prefill(pe, p_agent, sender, receiver, tasks)
        # BAD_TASK when the compile fails as the task is admitted, REQUEST_FAILED when it fails later
        assert result.done == 2 and [f.task.request_id for f in result.failures] == ["f1"]
        assert result.failures[0].kind in (BAD_TASK, REQUEST_FAILED)
        assert "injected: this worker's compiler fails" in result.failures[0].detail
        assert pe.kv.num_free_blocks == pe.runner.num_blocks and not pe.requests
        by_id = {m.request_id: m for m in arrived}
        assert isinstance(by_id["f1"], PrefillFailed) and by_id["f1"].writes_settled
        for rid, msg in by_id.items():
            if isinstance(msg, PrefillDone):
                de.connector.remote_ready(rid, msg.first_token_id, msg.first_token_logprob)
            else:
                de.connector.fall_back(rid)
        while de.has_work():
            de.step()
        assert [de.release(f"f{i}").token_ids for i in range(len(ps))] == want
        assert de.kv.num_free_blocks == de.runner.num_blocks
    finally:
        for agent in (p_agent, d_agent):
            agent.close()
        pe.close()
        de.close()
