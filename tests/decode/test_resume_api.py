"""`resume_token_ids` over the gRPC API: a decode worker continues a stream another worker
started, token-exact, charges the whole completion once, and refuses what cannot resume."""

from __future__ import annotations

import random

import grpc
import pytest

from pdserve.api import Client
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import PERMISSIVE_POLICY, WorkerThread


@pytest.fixture(scope="module")
def worker(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "router.yaml"
    path.write_text(PERMISSIVE_POLICY)
    w = WorkerThread(DecodeWorkerConfig(model=llama_dir, router_policy=str(path))).start()
    yield w
    w.stop()


def prompt(n=30, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=99, top_p=0.95)],
                         ids=["greedy", "seeded"])
def test_a_resumed_stream_continues_token_exact(worker, sampling):
    ids = prompt(seed=3)
    with Client(worker.grpc) as c:
        whole = c.generate(ids, max_tokens=20, ignore_eos=True, **sampling)
        cut = 7
        rest = c.generate(ids, max_tokens=20, ignore_eos=True, resume_token_ids=whole.token_ids[:cut], **sampling)
    assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids
    assert rest.finish_reason == "length"
    b = rest.breakdown
    assert b["completion_tokens"] == 20 and b["prompt_tokens"] == len(ids)  # charged once, whole
    assert b["route"] == "local" and b["reason"].startswith("resumed")
    eng = worker.worker.engine
    assert not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks


@pytest.mark.parametrize("resume,match", [
    ([5] * 20, "nothing would be left"),
    ([5, 10 ** 9], "not a token id"),
])
def test_a_stream_that_cannot_resume_is_invalid_argument_naming_the_field(worker, resume, match):
    with Client(worker.grpc) as c:
        with pytest.raises(grpc.RpcError) as ei:
            c.generate(prompt(), max_tokens=20, resume_token_ids=resume)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("resume_token_ids:") and match in ei.value.details()
