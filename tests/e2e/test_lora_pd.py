"""LoRA adapters across the prefill/decode hop (docs/lora.md, "Across prefill and decode"), end
to end on CPU with real etcd, Ray (the queue) and NIXL, at prefill/decode TP (1,1) and (2,1).

A decode worker serving two PEFT adapters (``lora_modules``) and a prefill worker started with
``enable_lora`` that holds none of them: requests under each adapter and under the base, forced
remote, come back token for token as the offline engine makes them with that adapter (greedy),
the prefill worker loads each adapter from the path in the signed task, its etcd record lists
them (``load["lora_adapters"]``) and the decode worker's cost model learns the load time. A
`PrefillDone` saying its pages were computed under another adapter (or the base) is refused
(reason ``wrong_adapter``) and the request prefills locally, token-exact.

The prefill worker runs in this process on its own event loop (a test replaces the notice it
sends, as tests/e2e/test_remote_failures.py does), its TP=2 ranks as its child processes.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.api import AsyncClient
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import LLM, LoRARequest, SamplingParams
from pdserve.engine.tp_comm import shm_available
from tests.decode.test_lora_api import sql_and_chat
from tests.e2e.test_disaggregated import etcd, ray_local  # noqa: F401  (module fixtures)
from tests.e2e.test_remote_failures import PrefillThread
from tests.harness import PERMISSIVE_POLICY, WorkerThread, wait_until

pytestmark = pytest.mark.timeout(600)

UCX = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
MAX_TOKENS = 8
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
ENGINE = {"max_model_len": 512, "kv_layout": "HND", "device": "cpu", **LORA}
IDS = {"sql": 1, "chat": 2}


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(n)] for n in (9, 33, 70)]


@pytest.fixture(scope="module")
def paths(llama_dir, tmp_path_factory) -> dict[str, str]:
    return sql_and_chat(llama_dir, tmp_path_factory.mktemp("lora-pd"))


@pytest.fixture(scope="module")
def offline(llama_dir, paths):
    """want(adapter or None, prompt) -> the offline engine's greedy tokens (one engine, TP=1)."""
    llm = LLM(llama_dir, **{k: v for k, v in ENGINE.items() if k != "kv_layout"})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    memo: dict = {}

    def want(name: str | None, prompt: list[int]) -> list[int]:
        key = (name, tuple(prompt))
        if key not in memo:
            lora = LoRARequest(name, IDS[name], paths[name]) if name else None
            memo[key] = llm.generate([prompt], params, lora_request=lora)[0].token_ids
        return memo[key]

    yield want
    llm.close()


@pytest.fixture(scope="module", params=[(1, 1), (2, 1)], ids=["tp1-1", "tp2-1"])
def pd(request, ray_local, etcd, llama_dir, paths, tmp_path_factory):  # noqa: F811  (the fixtures imported above)
    p_tp, d_tp = request.param
    if p_tp > 1 and shm_available() is not None:
        pytest.skip(f"TP needs shm: {shm_available()}")
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    common = dict(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=f"lora-pd-{p_tp}{d_tp}", lease_ttl_s=3,
                  ucx_env=UCX, queue_name=f"lora-pd-queue-{p_tp}{d_tp}", queue_namespace="pdserve-e2e")
    d = WorkerThread(DecodeWorkerConfig(
        **common, worker_id="decode-0", remote_prefill=True, remote_timeout_s=120, router_policy=str(policy),
        served_model_name="base", lora_modules=[f"{n}={paths[n]}" for n in ("sql", "chat")],
        engine_args={**ENGINE, "tensor_parallel_size": d_tp})).start()
    p = None
    try:
        p = PrefillThread(dict(**common, worker_id="prefill-0", load_report_s=0.2,
                               engine_args={**ENGINE, "tensor_parallel_size": p_tp})).start()
        view = d.worker.frontend.prefill_view
        wait_until(lambda: view.pool_size == 1 and view.lora_workers == 1 and d.worker.remote.available(), 30)
        yield d, p, p_tp
    finally:
        if p is not None:
            p.stop()
            p.worker.engine.close()  # (its TP ranks: a stopped worker keeps its engine for a role change)
        d.stop()


def generate(d, jobs: list[tuple[str | None, list[int]]], route: str = "remote"):
    async def go():
        async with AsyncClient(d.grpc) as c:
            return await asyncio.gather(*(
                c.generate(prompt, model=name or "base", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                           route=route, priority="high", timeout_s=90) for name, prompt in jobs))

    return asyncio.run(go())


def test_remote_prefill_under_adapters_equals_the_local_engine(pd, offline):
    d, p, p_tp = pd
    assert len(p.worker.tp_rank_pids()) == p_tp - 1
    assert p.worker.batch.admission.held == ()  # it starts holding none: each is loaded from its task's path
    view = d.worker.frontend.prefill_view
    assert view.lora_adapters == frozenset()
    costs = d.worker.remote.arrival.costs
    loads0 = costs.samples("lora_load_ms")
    ps = prompts(seed=10 + p_tp)
    jobs = [(name, prompt) for name in ("sql", "chat", None) for prompt in ps]
    eng = d.worker.engine
    computed = eng.stats.num_prompt_tokens_computed
    outs = generate(d, jobs)
    for (name, prompt), out in zip(jobs, outs):
        assert out.token_ids == offline(name, prompt), (name, len(prompt))
        assert out.breakdown["route"] == "remote" and not out.breakdown.get("fell_back_to_local"), out.breakdown
    # Not vacuous: each adapter changes the greedy output of every prompt.
    for prompt in ps:
        assert len({tuple(offline(n, prompt)) for n in ("sql", "chat", None)}) == 3
    assert eng.stats.num_prompt_tokens_computed == computed  # every prompt's KV came from the prefill worker
    # The prefill worker loaded both adapters from the tasks' paths; its record lists them, and the
    # decode worker sees it (its router now counts no load for them).
    assert p.worker.batch.admission.held == ("chat", "sql")
    wait_until(lambda: view.lora_adapters == {"chat", "sql"}, 15)
    rec = d.call(lambda: d.worker.registry.member("prefill", "prefill-0"))
    assert rec.capacity["enable_lora"] is True and rec.load["lora_adapters"] == ["chat", "sql"]
    assert costs.samples("lora_load_ms") >= loads0 + 2 and costs.snapshot().lora_load_ms > 0
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30)


def test_pages_computed_under_another_adapter_are_refused_and_prefilled_locally(pd, offline, monkeypatch):
    """A buggy prefill worker says its pages were computed under another adapter (then under the
    base model) than the task asked for: the decode worker refuses them (wrong_adapter) and
    prefills the request locally, token-exact, at once."""
    import pdserve.prefill.batch as batch

    d, _, p_tp = pd
    real = batch.PrefillDone
    claim = {"lora_name": "chat", "lora_int_id": 2}

    def mislabelled(*args, **kwargs):
        return real(*args, **{**kwargs, **claim})

    monkeypatch.setattr(batch, "PrefillDone", mislabelled)
    arrival = d.worker.remote.arrival
    refused0 = arrival.refused_causes.get("wrong_adapter", 0)
    fell0 = arrival.fallback_causes.get("wrong_adapter", 0)
    prompt = prompts(seed=40 + p_tp)[1]
    for n, label in enumerate(({"lora_name": "chat", "lora_int_id": 2}, {"lora_name": "", "lora_int_id": 0}), 1):
        claim.update(label)
        (out,) = generate(d, [("sql", prompt + [n])])
        assert out.token_ids == offline("sql", prompt + [n])
        assert out.breakdown["fell_back_to_local"] and "wrong_adapter" in out.breakdown["reason"], out.breakdown
        assert arrival.refused_causes.get("wrong_adapter", 0) == refused0 + n
        assert arrival.fallback_causes.get("wrong_adapter", 0) == fell0 + n
    text = d.worker.metrics.render().decode()
    assert 'pdserve_remote_notifications_refused_total{reason="wrong_adapter"' in text
    eng = d.worker.engine
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30)
