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

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer import PrefillDone
from tests.kvtransfer.handoff_pair import paired

pytestmark = pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")

MAX_TOKENS = 8


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
    with paired(model, f"{p_tp}{d_tp}{int(layerwise)}", p_tp, d_tp, kv_layout="HND") as pair:
        de = pair.de
        # The decode worker caches the first prompt's shared prefix, and fragments its pool.
        pair.warm_prefix(ps[0])
        hold = []
        while de.kv.num_free_blocks > 8:  # the pool's blocks in order (the cached prefix is freed last, kept)
            hold.append(de.make_request([3 + len(hold)] * 15, SamplingParams(max_tokens=1),
                                        request_id=f"hold{len(hold)}"))
            assert de.connector.reserve(hold[-1]) is not None
        for r in hold[::2]:
            de.connector.abort(r.request_id)  # every other block free: targets interleave with held ones
        tasks = pair.tasks(ps, params)
        assert tasks[0].cached_len == 48
        assert any(b - a != 1 for t in tasks for a, b in zip(t.target_block_ids, t.target_block_ids[1:]))
        # The decode worker's loop polls its transport all the time (a NIXL target must, or
        # connection wire-up stalls); here a thread does, while the prefill batch runs.
        result, arrived = pair.prefill(tasks, layerwise=layerwise)
        assert result.failures == [] and result.done == len(tasks)
        assert pair.pe.kv.num_free_blocks == pair.pe.runner.num_blocks  # the prefill side keeps nothing
        assert all(isinstance(m, PrefillDone) for m in arrived)
        done = pair.hand_over(arrived)
        assert len(done) == len(arrived) == len(tasks)  # one notice per attempt, once all ranks wrote
        assert pair.receiver.arrivals.unexpected == 0 and pair.receiver.arrivals.waiting() == {}
        pair.decode()
        assert [o.token_ids for o in pair.outputs(len(ps))] == want
        for r in hold[1::2]:
            de.connector.abort(r.request_id)
        pair.assert_nothing_held()
