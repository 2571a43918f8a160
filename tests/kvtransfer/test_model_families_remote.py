"""Remote prefill of Qwen3, Qwen3-MoE, Mixtral and DeepSeek-V3 (its pool's one latent KV head,
engine/mla.py), token for token equal to the local path.

The set-up of tests/kvtransfer/handoff_pair.py: real engines on both sides (tensor-parallel where asked), the
prefill side the real batch runner (prefill/batch.py) over `TPSender`, pages written by real NIXL
agents, the decode side running the requests from the prefill worker's first token; one prompt
shares a prefix the decode worker has cached.
"""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_maker import make_model
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer import PrefillDone
from tests.engine.test_model_families import SPECS
from tests.kvtransfer.handoff_pair import paired
from tests.kvtransfer.test_tp_handoff import prompts

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


@pytest.mark.parametrize("name,p_tp,d_tp", [
    ("qwen3", 1, 1), ("qwen3_moe", 1, 1), ("mixtral", 1, 1), ("qwen3_moe", 2, 1), ("deepseek_v3", 1, 1),
    ("deepseek_v3", 2, 1), ("qwen3", 2, 1), ("qwen3", 1, 2), ("qwen3_moe", 1, 2), ("mixtral", 2, 1),
    ("mixtral", 1, 2), ("deepseek_v3", 1, 2),
    ("deepseek_v3", 4, 1), ("deepseek_v3", 1, 4)])
def test_remote_prefill_equals_local(family_dir, name, p_tp, d_tp):
    """Every family at TP pairs (1,1), (2,1) and (1,2); the MLA model also at (4,1) and (1,4),
    where its one latent head is not split: every decode rank gets the whole latent, written by
    exactly one prefill rank."""
    model = family_dir(name)
    ps = prompts(seed=len(name) + p_tp + 10 * d_tp)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    want = [o.token_ids for o in LLM(model).generate(ps, params)]
    with paired(model, f"f{name}{p_tp}{d_tp}", p_tp, d_tp, kv_layout="HND") as pair:
        pair.warm_prefix(ps[0])  # the decode side caches the first prompt's prefix
        tasks = pair.tasks(ps, params)
        assert tasks[0].cached_len == 48
        result, arrived = pair.prefill(tasks)
        assert result.failures == [] and result.done == len(tasks)
        assert all(isinstance(m, PrefillDone) for m in arrived)
        done = pair.hand_over(arrived)
        assert len(done) == len(tasks)
        assert [done[f"r{i}"].first_token_id for i in range(len(ps))] == [w[0] for w in want]
        pair.decode()
        assert [o.token_ids for o in pair.outputs(len(ps))] == want
        pair.assert_nothing_held()
