"""Speculative decoding behind the gateway (docs/speculative.md): streams on a worker that
speculates, its gRPC server stopped once each has streamed a few tokens, resume on the other
(speculating) worker token-exact: the tokens of an undisturbed run, greedy ones equal to the
engine without speculation, seeded ones reproduced; proposals accepted on both workers. With
each proposer: n-gram, a draft model (the target as its own draft: the survivor's draft computes
the prompt and the resumed tokens itself) and an EAGLE-3 head (a "copy" head,
tests/engine/test_spec_eagle.py: it reads the survivor's own hidden states of the resumed
tokens).

Two decode workers with ``speculative_config`` and a gateway over real etcd (the set-up of
test_gateway_structured.py's migration test)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from pdserve.api import AsyncClient
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.gateway.server import GatewayConfig
from tests.harness import PERMISSIVE_POLICY, GatewayThread, WorkerThread, wait_until

CLUSTER = "gw-spec"
WORKERS = ("decode-0", "decode-1")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 400  # long enough that every stream still runs when its worker dies
SAMPLED = [dict(temperature=0.0), dict(temperature=1.0, seed=7)]


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 900) for _ in range(rng.randrange(3, 8))] * 4 for _ in range(3)]


CASES = [(p, s) for p in prompts() for s in SAMPLED]


def speculative_config(method: str, llama_dir: str, tmp) -> dict:
    if method == "ngram":
        return NGRAM
    if method == "draft_model":
        # (the target as its own draft never pays: the measured-cost rule would keep steps plain)
        return {"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 3, "disable_by_cost": False}
    from tests.engine.test_spec_eagle import eagle_cfg, make_eagle3

    with open(f"{llama_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    return eagle_cfg("eagle3", make_eagle3(str(tmp / "head"), llama_dir, list(range(vocab)), copy=True), k=4)


@pytest.fixture(scope="module", params=["ngram", "draft_model", "eagle3"])
def cluster(request, llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwspec")
    policy = tmp / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    spec = speculative_config(request.param, llama_dir, tmp)
    with EmbeddedEtcd(tmp / "etcd") as etcd:
        workers, gw = [], None
        try:
            for wid in WORKERS:
                cfg = DecodeWorkerConfig(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER,
                                         engine_args={"max_model_len": 2048, "speculative_config": spec},
                                         lease_ttl_s=3, worker_id=wid, router_policy=str(policy), load_report_s=0.5)
                workers.append(WorkerThread(cfg).start())
            gw = GatewayThread(GatewayConfig([etcd.endpoint], CLUSTER, model=llama_dir, seed=0)).start()
            wait_until(lambda: len(gw.gateway.backends.workers) == len(WORKERS), 20)
            yield workers, gw
        finally:
            if gw is not None:
                gw.stop()
            for w in workers:
                w.stop()


async def run_all(gw, kill=None):
    """Every case streamed at once through the gateway; ``kill`` runs once each has 3 tokens."""
    started = [asyncio.Event() for _ in CASES]

    async def one(c, i):
        prompt, sampling = CASES[i]
        toks, b = [], None
        async for msg in c.stream(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling):
            toks += msg.token_ids
            if len(toks) >= 3:
                started[i].set()
            if msg.HasField("breakdown"):
                b = msg.breakdown
        started[i].set()
        return toks, b

    async with AsyncClient(gw.gateway.grpc_address) as c:
        tasks = [asyncio.ensure_future(one(c, i)) for i in range(len(CASES))]
        if kill is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            kill()
        return await asyncio.wait_for(asyncio.gather(*tasks), 180)


def test_a_speculating_stream_whose_worker_dies_resumes_token_exact(cluster, llama_dir):
    workers, gw = cluster
    survivor_w, doomed = workers
    survivor = gw.gateway.backends.workers["decode-0"]
    survivor.avoid_until = float("inf")  # every stream on the doomed worker, both runs
    try:
        undisturbed = asyncio.run(run_all(gw))
    finally:
        survivor.avoid_until = 0.0
    with LLM(llama_dir) as plain:  # greedy with speculation = greedy without it
        greedy = [o.token_ids for o in plain.generate(
            [p for p, s in CASES if s["temperature"] == 0.0],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))]
    assert [t for (t, _), (_, s) in zip(undisturbed, CASES) if s["temperature"] == 0.0] == greedy
    for toks, b in undisturbed:
        assert len(toks) == MAX_TOKENS and b.migrations == 0 and b.worker_id == "decode-1"
        assert b.HasField("spec_accepted_tokens") and b.spec_draft_tokens >= b.spec_accepted_tokens
    assert sum(b.spec_accepted_tokens for _, b in undisturbed) > 0

    accepted0 = survivor_w.worker.engine.stats.num_spec_accepted_tokens

    def kill():
        survivor.avoid_until = 0.0
        asyncio.run_coroutine_threadsafe(doomed.worker.grpc.server.stop(0), doomed.loop).result(10)

    survivor.avoid_until = float("inf")
    try:
        moved = asyncio.run(run_all(gw, kill))
    finally:
        survivor.avoid_until = 0.0
    for (want, _), (toks, b) in zip(undisturbed, moved):
        assert toks == want
        assert b.migrations == 1 and b.worker_id == "decode-0" and b.completion_tokens == len(toks)
    # The resumed streams speculated on the survivor too; their breakdowns are the survivor's.
    eng = survivor_w.worker.engine
    assert sum(b.spec_accepted_tokens for _, b in moved) == eng.stats.num_spec_accepted_tokens - accepted0 > 0
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 15)
