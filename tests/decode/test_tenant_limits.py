"""Per-client limits on a decode worker without API keys (issue 54), through the official
`openai` SDK and the project's gRPC client, on loopback: each client address is a tenant of its
own (api/security.py `Client`), so one client holding its share of sequences does not stop
another; and a tenant's calls are bounded by the tokens they claim (prompt + max_tokens of
each sequence, qos.max_tokens_per_tenant), so a call of many sequences with a large max_tokens
is refused naming max_tokens while the same call with a small max_tokens is served. Nothing
leaks: every share is given back and the KV pool is whole after each test.

Two clients on one host: the worker listens on 127.0.0.1, and the second client connects
from 127.0.0.2 (the whole of 127/8 is loopback on Linux), so the worker sees two addresses."""

from __future__ import annotations

import dataclasses

import grpc
import openai
import pytest

from pdserve.api import Client
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import PERMISSIVE_POLICY, WorkerThread, wait_until

try:  # the HTTP library this openai release is built on (httpx2 in recent ones), for its transport
    import httpx2 as sdk_http
except ImportError:  # pragma: no cover  (older releases: httpx)
    import httpx as sdk_http

TOKEN_LIMIT = 2000  # qos.max_tokens_per_tenant here: 4 x max_model_len
MAX_MODEL_LEN = 512
POLICY = PERMISSIVE_POLICY + f"  max_tokens_per_tenant: {TOKEN_LIMIT}\n"
FIRST, SECOND = "127.0.0.1", "127.0.0.2"


@pytest.fixture(scope="module")
def open_worker(llama_dir, tmp_path_factory):
    """A worker without API keys (the default); QoS admits everything."""
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    cfg = DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": MAX_MODEL_LEN},
                             router_policy=str(policy), host=FIRST)
    w = WorkerThread(cfg).start()
    yield w
    w.stop()


@pytest.fixture
def token_bound(open_worker):
    """qos.max_tokens_per_tenant = TOKEN_LIMIT, swapped in the way a reload does (file or etcd),
    and the permissive policy back after."""
    state = open_worker.worker.frontend.policy
    state.apply_text(POLICY, "test")
    yield state
    state.apply_text(PERMISSIVE_POLICY, "test")


def sdk(worker, source: str = FIRST) -> openai.OpenAI:
    """An OpenAI client whose connections come from `source` (no retries: a 429 is the answer)."""
    http = openai.DefaultHttpxClient(transport=sdk_http.HTTPTransport(local_address=source))
    return openai.OpenAI(base_url=f"{worker.http}/v1", api_key="not-used", max_retries=0, timeout=120,
                         http_client=http)


def settled(worker) -> bool:
    """No share held, no request in the engine, every KV block free."""
    f, eng = worker.worker.frontend, worker.worker.engine
    return (not f.sequences_per_key and not f.tokens_per_tenant and not f._holds and not f._checked
            and not f.inflight and not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks)


def test_one_client_at_its_sequence_cap_does_not_stop_another(open_worker, monkeypatch):
    """limits.max_sequences_per_key (3 here) binds per client address when keys are off:
    with one of its streams in flight, the first client's call of 3 more is 429 naming the
    limit and its address, while a client on another address is served the same call; once
    the stream ends the first client is served again."""
    frontend = open_worker.worker.frontend
    monkeypatch.setattr(frontend, "limits", dataclasses.replace(frontend.limits, max_sequences_per_key=3))
    three = dict(model="llama", prompt=["One", "Two", "Three"], max_tokens=2, temperature=0)
    with sdk(open_worker) as a, sdk(open_worker, SECOND) as b:
        stream = a.completions.create(model="llama", prompt="A long story begins", max_tokens=450, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices  # its sequence is admitted and running
        with pytest.raises(openai.RateLimitError) as ei:
            a.completions.create(**three)
        assert frontend.sequences_per_key == {f"addr:{FIRST}": 1}
        assert "limits.max_sequences_per_key" in ei.value.message and f"addr:{FIRST}" in ei.value.message
        assert ei.value.response.headers.get("retry-after")
        served = b.completions.create(**three)
        assert len(served.choices) == 3 and all(c.finish_reason == "length" for c in served.choices)
        stream.close()  # the client leaves: the worker ends its sequence
    wait_until(lambda: settled(open_worker), 15)
    with sdk(open_worker) as a:
        assert len(a.completions.create(**three).choices) == 3
    wait_until(lambda: settled(open_worker), 15)


def test_max_tokens_counts_in_the_tenant_bound(open_worker, token_bound):
    """8 sequences x max_tokens 400 claim 3200+ tokens, over the 2000 one tenant may claim:
    429 with param max_tokens, naming qos.max_tokens_per_tenant, no Retry-After (waiting
    cannot help); the same call with max_tokens 4 is served. A chat request without
    max_tokens claims the rest of its context, so 5 of them (5 x 512 > 2000) are refused too."""
    with sdk(open_worker) as a:
        call = dict(model="llama", prompt="Count every token", n=8, temperature=1.0, seed=3)
        with pytest.raises(openai.RateLimitError) as ei:
            a.completions.create(**call, max_tokens=400)
        err = ei.value
        assert err.param == "max_tokens" and "qos.max_tokens_per_tenant 2000" in err.message, err.message
        assert "8 sequences x max_tokens 400" in err.message and "lower max_tokens" in err.message
        assert err.response.headers.get("retry-after") is None
        assert len(a.completions.create(**call, max_tokens=4).choices) == 8
        chat = [{"role": "user", "content": "Say hello"}]
        with pytest.raises(openai.RateLimitError) as ei:
            a.chat.completions.create(model="llama", messages=chat, n=5)
        assert ei.value.param == "max_tokens" and "x max_tokens" in ei.value.message
    wait_until(lambda: settled(open_worker), 15)


def test_a_tenants_calls_in_flight_count_and_another_tenant_is_not_bound_by_them(open_worker, token_bound):
    """A chat stream without max_tokens claims its whole context (512 tokens) for the first
    client; its call of 4 x 375 (1500 + its prompt, within 2000 alone) would take it past 2000:
    429 with a Retry-After. The second client's same call is served beside it."""
    frontend = open_worker.worker.frontend
    call = dict(model="llama", prompt="Four samples of this", n=4, max_tokens=375, temperature=1.0, seed=5)
    with sdk(open_worker) as a, sdk(open_worker, SECOND) as b:
        stream = a.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Tell a story"}],
                                           stream=True, extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices
        with pytest.raises(openai.RateLimitError) as ei:
            a.completions.create(**call)
        assert frontend.tokens_per_tenant == {f"addr:{FIRST}": MAX_MODEL_LEN}  # the rest of the context
        err = ei.value
        assert err.param == "max_tokens" and f"beside the {MAX_MODEL_LEN} its tenant's calls in flight" in err.message
        assert err.response.headers.get("retry-after") == "1"
        assert len(b.completions.create(**call).choices) == 4
        stream.close()
    wait_until(lambda: settled(open_worker), 15)


def test_grpc_clients_are_tenants_by_address_and_refused_as_resource_exhausted(open_worker, token_bound):
    """The project's gRPC client without keys: its request is the tenant addr:127.0.0.1 in the
    engine (the scheduler's turns) and in the token share; one call over the policy's bound
    (reloaded to 300 here) is RESOURCE_EXHAUSTED naming max_tokens."""
    state, eng = token_bound, open_worker.worker.engine
    with Client(open_worker.grpc) as c:
        stream = c.stream("A long story begins", max_tokens=450, temperature=0.0, ignore_eos=True,
                          request_id="held-by-grpc")
        assert next(stream).token_ids
        assert [r.tenant for r in list(eng.requests.values())] == [f"addr:{FIRST}"]
        assert c.abort("held-by-grpc") is True
        assert list(stream)[-1].finish_reason == "abort"
        wait_until(lambda: settled(open_worker), 15)
        state.apply_text(PERMISSIVE_POLICY + "  max_tokens_per_tenant: 300\n", "test")
        with pytest.raises(grpc.RpcError) as ei:
            c.generate("Too long for the bound", max_tokens=400)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ei.value.details().startswith("max_tokens:") and "qos.max_tokens_per_tenant 300" in ei.value.details()
        assert c.generate("Short", max_tokens=3).finish_reason == "length"
    wait_until(lambda: settled(open_worker), 15)
