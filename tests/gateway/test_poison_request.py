"""A poison request (one every engine fails) must not take the decode workers out of a
gateway's rotation (issue 54). The worker marks a failure that is the request's own
(``x-pdserve-error-scope: request``): the gateway returns it to its client at once and keeps
the worker; an unmarked INTERNAL (an older worker) is tried on one more worker only; neither
makes the gateway avoid a worker, and other clients keep being served by all of them.

The failure is the engine's real one for a single request: its detokenizer raises, the
engine fails that request alone (engine/llm_engine.py `fail_request`) and goes on."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import httpx
import pytest

from pdserve.api import AsyncClient, grpc_service
from pdserve.api.ingress import ERROR_SCOPE_HEADER, REQUEST_SCOPE
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.decode.async_engine import EngineDeadError
from pdserve.decode.ingress import as_request_error
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import RequestDelta, StepError
from pdserve.gateway.server import GatewayConfig
from tests.harness import PERMISSIVE_POLICY, GatewayThread, WorkerThread, wait_until

CLUSTER = "gw-poison"
WORKERS = ("decode-0", "decode-1", "decode-2")
MARK = (31001, 31002, 31003, 31004)  # a prompt that starts with these is the poison


def prompt(n=24, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


def poison(seed=0):
    return list(MARK) + prompt(20, seed)


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwp")
    policy = tmp / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    with EmbeddedEtcd(tmp / "etcd") as etcd:
        workers, gw = [], None
        try:
            for wid in WORKERS:
                cfg = DecodeWorkerConfig(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER,
                                         lease_ttl_s=3, worker_id=wid, router_policy=str(policy),
                                         load_report_s=0.5)
                workers.append(WorkerThread(cfg).start())
            gw = GatewayThread(GatewayConfig([etcd.endpoint], CLUSTER, model=llama_dir, seed=0)).start()
            wait_until(lambda: len(gw.gateway.backends.workers) == len(WORKERS), 20)
            yield workers, gw
        finally:
            if gw is not None:
                gw.stop()
            for w in workers:
                w.stop()


@pytest.fixture
def poisoned(cluster, monkeypatch):
    """Every worker's engine fails a poison request after ``state["after"]`` tokens: the
    request's detokenizer raises then, as a detokenizer bug for one odd request would."""
    workers, _ = cluster
    state = {"after": 0}
    for w in workers:
        tok = w.worker.engine.tokenizer
        real = tok.stream

        def stream(ids, *args, _real=real, **kwargs):
            detok = _real(ids, *args, **kwargs)
            if tuple(ids[:len(MARK)]) == MARK:
                pushes = {"n": 0}
                push = detok.push

                def failing_push(token_id, stops_on=True):
                    pushes["n"] += 1
                    if pushes["n"] > state["after"]:
                        raise TypeError("injected: this request's detokenizer fails on every worker (poison)")
                    return push(token_id, stops_on)
                detok.push = failing_push
            return detok
        monkeypatch.setattr(tok, "stream", stream)
    return state


def failed_counts(workers) -> dict[str, int]:
    return {w.worker.worker_id: w.worker.engine.stats.num_failed for w in workers}


def metric(gw, name: str, **labels) -> float:
    with httpx.Client(base_url=f"http://{gw.gateway.http_address}", timeout=30) as h:
        text = h.get("/metrics").text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def assert_in_rotation(gw):
    """No worker is avoided: a pick now may choose any of them."""
    now = time.monotonic()
    avoided = {wid: w.avoid_until - now for wid, w in gw.gateway.backends.workers.items() if w.avoid_until > now}
    assert not avoided, f"workers taken out of rotation (s left): {avoided}"
    assert gw.gateway.backends.pick(prompt(seed=5)).excluded == {}


def no_leaks(workers):
    for w in workers:
        eng = w.worker.engine
        wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 15)


def run_mixed(gw, bad: list[int], others: int, seed: int):
    """The poison request and ``others`` ordinary ones at once through the gateway: (the
    poison's tokens and error, the others' completions)."""
    async def go():
        async with AsyncClient(gw.gateway.grpc_address) as c:
            async def bad_one():
                toks = []
                try:
                    async for msg in c.stream(bad, max_tokens=8, temperature=0.0, ignore_eos=True):
                        toks += msg.token_ids
                except grpc.aio.AioRpcError as exc:
                    return toks, exc
                return toks, None

            good = [c.generate(prompt(seed=seed + i), max_tokens=6, temperature=0.0, ignore_eos=True)
                    for i in range(others)]
            return await asyncio.wait_for(asyncio.gather(bad_one(), *good), 120)

    got = asyncio.run(go())
    return got[0], got[1:]


def serve_on_each(gw, seed: int) -> dict[str, str]:
    """One ordinary request forced onto each worker in turn (the others avoided for it):
    worker id -> the worker that served it."""
    served = {}
    workers = gw.gateway.backends.workers

    async def one(ids):
        async with AsyncClient(gw.gateway.grpc_address) as c:
            return await asyncio.wait_for(c.generate(ids, max_tokens=4, temperature=0.0), 60)

    for i, target in enumerate(WORKERS):
        for wid in WORKERS:
            if wid != target:
                workers[wid].avoid_until = float("inf")
        try:
            out = asyncio.run(one(prompt(seed=seed + i)))
        finally:
            for wid in WORKERS:
                if wid != target:
                    workers[wid].avoid_until = 0.0
        assert out.finish_reason == "length"
        served[target] = out.breakdown["worker_id"]
    return served


@pytest.mark.parametrize("after", [0, 3], ids=["before_first_token", "mid_stream"])
def test_a_request_scope_error_is_returned_and_every_worker_stays_in_rotation(cluster, poisoned, after):
    workers, gw = cluster
    poisoned["after"] = after
    before = failed_counts(workers)
    errors_before = metric(gw, "pdserve_gateway_request_errors_total", scope="request", action="returned")
    moved_before = metric(gw, "pdserve_gateway_migrations_total")
    retried_before = metric(gw, "pdserve_gateway_retries_total")

    (toks, err), others = run_mixed(gw, poison(seed=after), others=6, seed=100 + 10 * after)

    assert err is not None, "the poison request completed: the injected engine failure did not happen"
    assert err.code() == grpc.StatusCode.INTERNAL, f"{err.code()}: {err.details()}"
    assert "poison" in err.details() and "the worker is fine" in err.details()
    assert dict(err.trailing_metadata() or ()).get(ERROR_SCOPE_HEADER) == REQUEST_SCOPE
    assert len(toks) == after  # what it streamed before its failure, nothing resent
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in others)
    # Tried on one worker only: a marked failure is not sent on to the others...
    after_counts = failed_counts(workers)
    failed_on = [wid for wid in WORKERS if after_counts[wid] > before[wid]]
    assert len(failed_on) == 1 and sum(after_counts.values()) - sum(before.values()) == 1, after_counts
    # ... and takes no worker out of rotation: the one that failed it included.
    assert_in_rotation(gw)
    assert serve_on_each(gw, seed=200 + 10 * after) == {wid: wid for wid in WORKERS}
    assert metric(gw, "pdserve_gateway_request_errors_total", scope="request", action="returned") == errors_before + 1
    assert metric(gw, "pdserve_gateway_migrations_total") == moved_before
    assert metric(gw, "pdserve_gateway_retries_total") == retried_before
    no_leaks(workers)


def test_a_request_scope_error_reaches_an_http_client_as_500(cluster, poisoned):
    workers, gw = cluster
    with httpx.Client(base_url=f"http://{gw.gateway.http_address}", timeout=60) as h:
        r = h.post("/v1/completions", json={"prompt": poison(seed=7), "max_tokens": 4, "temperature": 0})
        assert r.status_code == 500 and "poison" in r.json()["error"]["message"], r.text
        ok = h.post("/v1/completions", json={"prompt": prompt(seed=8), "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200, ok.text
    assert_in_rotation(gw)
    no_leaks(workers)


def test_an_unmarked_internal_is_tried_on_one_more_worker_only(cluster, poisoned, monkeypatch):
    """Workers that do not mark their errors (an older version): the poison is tried on a
    second worker, then returned with its INTERNAL; still no worker leaves the rotation."""
    workers, gw = cluster
    monkeypatch.setattr(grpc_service, "ERROR_SCOPE_HEADER", "x-pdserve-not-known-to-this-gateway")
    before = failed_counts(workers)
    retried = metric(gw, "pdserve_gateway_request_errors_total", scope="unmarked", action="retried")
    returned = metric(gw, "pdserve_gateway_request_errors_total", scope="unmarked", action="returned")

    (toks, err), others = run_mixed(gw, poison(seed=9), others=6, seed=300)

    assert err is not None and err.code() == grpc.StatusCode.INTERNAL, err
    assert "poison" in err.details() and "2 decode workers" in err.details()
    assert toks == [] and all(o.finish_reason == "length" for o in others)
    after_counts = failed_counts(workers)
    assert sum(after_counts.values()) - sum(before.values()) == 2, after_counts
    assert_in_rotation(gw)
    assert serve_on_each(gw, seed=400) == {wid: wid for wid in WORKERS}
    assert metric(gw, "pdserve_gateway_request_errors_total", scope="unmarked", action="retried") == retried + 1
    assert metric(gw, "pdserve_gateway_request_errors_total", scope="unmarked", action="returned") == returned + 1
    no_leaks(workers)


def test_only_a_request_alone_failing_in_the_engine_is_request_scope():
    """What a worker marks (decode/ingress.py `as_request_error`): the engine failing one
    request and going on; not a failed step (its whole batch failed: maybe the device), nor
    an engine that stopped."""
    own = as_request_error(RequestDelta("r", [], "", "error", error="TypeError: bad detokenizer"))
    assert own.code == "internal" and own.scope == REQUEST_SCOPE
    step = as_request_error(RequestDelta("r", [], "", "error", error=str(StepError(RuntimeError("oom"), ["r"]))))
    assert step.code == "internal" and step.scope is None and "oom" in str(step)
    assert as_request_error(EngineDeadError("gone")).scope is None
    assert as_request_error(RuntimeError("loop died")).scope is None
