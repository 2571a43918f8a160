"""Structured outputs across the prefill/decode hop, token for token equal to the local path.

The prefill worker samples the first token under the request's grammar (its task carries the
grammar in its sampling parameters; prefill/batch.py), the decode worker's matcher starts from
the prompt plus that token (`LLMEngine.append_token`) and constrains the rest. Real engines on
both sides, tensor-parallel where asked, KV written by real NIXL agents (tests/kvtransfer/
handoff_pair.py); every grammar kind in one batch of eight concurrent requests.
"""

from __future__ import annotations

import json
import re

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer import PrefillDone
from tests.kvtransfer.handoff_pair import paired
from tests.kvtransfer.test_tp_handoff import prompts

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
    with paired(model, f"sg{p_tp}{d_tp}", p_tp, d_tp, kv_layout="HND") as pair:
        tasks = pair.tasks(ps, params, prefix="g")
        result, arrived = pair.prefill(tasks)
        assert result.failures == [] and result.done == len(tasks)
        assert all(isinstance(m, PrefillDone) for m in arrived)
        done = pair.hand_over(arrived)
        assert len(done) == len(tasks)
        # The first token of each came from the prefill worker, sampled under the grammar.
        assert [done[f"g{i}"].first_token_id for i in range(len(ps))] == [w[0] for w in want]
        pair.decode()
        got = pair.outputs(len(ps), prefix="g")
        assert [o.token_ids for o in got] == want
        assert [o.finish_reason for o in got] == [o.finish_reason for o in local]
        pair.assert_nothing_held()


def test_a_grammar_the_prefill_worker_cannot_compile_fails_its_task_alone_and_decodes_locally(model_dirs):
    """The prefill worker's compile fails (a compiler error there; the decode worker compiled it
    fine): that one task fails with the compiler's reason, the others are written, the
    decode worker prefills it locally (`fall_back`) with the same tokens, and nothing leaks."""
    from pdserve.kvtransfer import BAD_TASK, REQUEST_FAILED, PrefillFailed

    model = model_dirs("llama")
    ps = prompts(seed=77)[:3]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=s) for s in SPECS[2:5]]
    want = [o.token_ids for o in LLM(model).generate(ps, params)]
    doomed = params[1].structured_outputs

    def refuse(spec) -> None:
        if spec.kind == "regex" and spec.source == doomed["regex"]:
            raise RuntimeError("injected: this worker's compiler fails")

    with paired(model, "sgf", kv_layout="HND") as pair:
        pe = pair.pe
        pe.grammars.before_compile = refuse
        result, arrived = pair.prefill(pair.tasks(ps, params, prefix="f"))
        # BAD_TASK when the compile fails as the task is admitted, REQUEST_FAILED when it fails later
        assert result.done == 2 and [f.task.request_id for f in result.failures] == ["f1"]
        assert result.failures[0].kind in (BAD_TASK, REQUEST_FAILED)
        assert "injected: this worker's compiler fails" in result.failures[0].detail
        assert pe.kv.num_free_blocks == pe.runner.num_blocks and not pe.requests
        by_id = pair.hand_over(arrived)  # the failed one prefilled locally (fall_back)
        assert isinstance(by_id["f1"], PrefillFailed) and by_id["f1"].writes_settled
        pair.decode()
        assert [o.token_ids for o in pair.outputs(len(ps), prefix="f")] == want
        assert pair.de.kv.num_free_blocks == pair.de.runner.num_blocks
