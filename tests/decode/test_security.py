"""A decode worker with TLS and API keys (api/security.py), attacked and used the way
clients do, on loopback with real certificates (`pdserve certs make`): no key or a wrong
key is refused (401 / UNAUTHENTICATED) without echoing it, a valid key works over HTTP,
gRPC, the OpenAI SDK and `pdserve.api.Client`; plaintext clients and clients that do not
trust the CA fail; only operator keys override routing or raise priority; only the key
that sent a request may abort it; no key ever reaches the logs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.api import AsyncClient, Client
from pdserve.api.v1 import inference_pb2 as pb
from pdserve.api.v1 import inference_pb2_grpc as pb_grpc
from pdserve.certs import append_key, make_certs, new_key
from pdserve.cluster.security import ClientTLS, grpc_channel, hash_key
from pdserve.api.security import TENANT_HEADER
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import PERMISSIVE_POLICY, WorkerThread, wait_until


class _Records(logging.Handler):
    """Every log record of the module's workers, formatted with its arguments and traceback."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def logs():
    handler, root = _Records(), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    paths = {k: str(v) for k, v in make_certs(d).items()}
    keys = {"user": new_key(), "other": new_key(), "operator": new_key(), "wrong": new_key()}
    for name in ("user", "other", "operator"):
        append_key(d / "keys.txt", keys[name], operator=name == "operator")
    return paths | {"keys_file": str(d / "keys.txt"), "keys": keys}


def _start(llama_dir, tmp_path_factory, pki, **security) -> WorkerThread:
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    cfg = DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 512}, router_policy=str(policy),
                             host="127.0.0.1", tls_cert=pki["decode"], tls_key=pki["decode-key"],
                             api_keys_file=pki["keys_file"], **security)
    return WorkerThread(cfg).start()


@pytest.fixture(scope="module")
def secure(llama_dir, tmp_path_factory, pki, logs):
    """TLS (server certificate only) and API keys."""
    w = _start(llama_dir, tmp_path_factory, pki)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def https(secure, pki):
    ctx = ssl.create_default_context(cafile=pki["ca"])
    with httpx.Client(base_url=f"https://{secure.worker.http_address}", verify=ctx, timeout=60) as h:
        yield h


def bearer(pki, who: str) -> dict:
    return {"Authorization": f"Bearer {pki['keys'][who]}"}


def md(pki, who: str) -> tuple:
    return (("authorization", f"Bearer {pki['keys'][who]}"),)


COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}


# -- HTTP -------------------------------------------------------------------------------
def test_http_without_a_key_is_401_naming_the_header(https):
    r = https.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["message"].startswith("Authorization: missing") and err["code"] == 401
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert https.get("/v1/models").status_code == 401


@pytest.mark.parametrize("value", ["Bearer {wrong}", "Basic {wrong}", "{wrong}", "Bearer"])
def test_http_wrong_key_is_401_and_never_echoed(https, pki, value):
    sent = value.format(wrong=pki["keys"]["wrong"])
    r = https.post("/v1/completions", json=COMPLETION, headers={"Authorization": sent})
    assert r.status_code == 401, r.text
    assert pki["keys"]["wrong"] not in r.text and "Authorization:" in r.json()["error"]["message"]


def test_http_valid_key_is_served(https, pki):
    r = https.post("/v1/completions", json=COMPLETION, headers=bearer(pki, "user"))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_open_paths_need_no_key(https):
    assert https.get("/health").status_code == 200
    assert https.get("/metrics").status_code == 200


def test_plaintext_http_client_fails_against_tls(secure):
    with httpx.Client(base_url=f"http://{secure.worker.http_address}", timeout=10) as h:
        with pytest.raises(httpx.TransportError):
            h.get("/health")


def test_client_that_does_not_trust_the_ca_fails(secure):
    with httpx.Client(base_url=f"https://{secure.worker.http_address}", timeout=10) as h:  # system trust store
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            h.get("/health")


@pytest.mark.parametrize("field, body", [("route", {"route": "remote"}), ("route", {"route": "local"}),
                                         ("priority", {"priority": "high"})])
def test_http_privileged_fields_need_an_operator_key(https, pki, field, body):
    r = https.post("/v1/completions", json={**COMPLETION, **body}, headers=bearer(pki, "user"))
    assert r.status_code == 403, r.text
    assert r.json()["error"]["param"] == field and "operator" in r.json()["error"]["message"]
    r = https.post("/v1/completions", json={**COMPLETION, **body}, headers=bearer(pki, "operator"))
    assert r.status_code == 200, r.text


def test_low_priority_needs_no_privilege(https, pki):
    r = https.post("/v1/completions", json={**COMPLETION, "priority": "low"}, headers=bearer(pki, "user"))
    assert r.status_code == 200, r.text


def test_openapi_declares_the_bearer_scheme(https, pki):
    assert https.get("/openapi.json").status_code == 401  # not an open path by default
    doc = https.get("/openapi.json", headers=bearer(pki, "user")).json()
    assert doc["components"]["securitySchemes"]["bearer"] == {**doc["components"]["securitySchemes"]["bearer"],
                                                               "type": "http", "scheme": "bearer"}
    op = doc["paths"]["/v1/completions"]["post"]
    assert op["security"] == [{"bearer": []}] and {"401", "403"} <= set(op["responses"])
    assert "security" not in doc["paths"]["/health"]["get"] and "401" not in doc["paths"]["/health"]["get"]["responses"]


# -- OpenAI SDK -------------------------------------------------------------------------
def _sdk(secure, pki, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"https://{secure.worker.http_address}/v1", api_key=key, max_retries=0,
                         timeout=60, http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(
                             cafile=pki["ca"])))


def test_openai_sdk_with_key_and_ca(secure, pki):
    with _sdk(secure, pki, pki["keys"]["user"]) as sdk:
        out = sdk.completions.create(model="llama", prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        with pytest.raises(openai.PermissionDeniedError) as exc:
            sdk.completions.create(model="llama", prompt="Hello", max_tokens=3, extra_body={"route": "remote"})
        assert exc.value.body["param"] == "route"
    with _sdk(secure, pki, pki["keys"]["wrong"]) as sdk:
        with pytest.raises(openai.AuthenticationError) as exc:
            sdk.models.list()
        assert exc.value.status_code == 401 and pki["keys"]["wrong"] not in str(exc.value)


# -- gRPC -------------------------------------------------------------------------------
def _stub(secure, pki, ca=True):
    creds = grpc.ssl_channel_credentials(root_certificates=open(pki["ca"], "rb").read() if ca else None)
    channel = grpc.secure_channel(secure.grpc, creds)
    return channel, pb_grpc.InferenceStub(channel)


@pytest.mark.parametrize("who", [None, "wrong"])
def test_grpc_without_a_valid_key_is_unauthenticated(secure, pki, who):
    channel, stub = _stub(secure, pki)
    metadata = md(pki, who) if who else None
    with channel:
        for call in (lambda: stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=metadata),
                     lambda: list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=30, metadata=metadata)),
                     lambda: stub.Abort(pb.AbortRequest(request_id="x"), timeout=30, metadata=metadata)):
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization" in exc.value.details().lower() and pki["keys"]["wrong"] not in exc.value.details()


def test_grpc_health_stays_open_over_tls(secure, pki):
    with grpc_channel(secure.grpc, ClientTLS(ca_file=pki["ca"])) as ch:  # what the launcher's check uses
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_pdserve_client_with_key_and_ca(secure, pki, monkeypatch):
    with Client(secure.grpc, api_key=pki["keys"]["user"], ca_file=pki["ca"]) as c:
        assert c.list_models()[0]["id"] == "llama"
        assert len(c.generate("Hello", max_tokens=3, temperature=0.0).token_ids) == 3
    monkeypatch.setenv("PDSERVE_API_KEY", pki["keys"]["user"])
    monkeypatch.setenv("PDSERVE_CA_FILE", pki["ca"])
    with Client(secure.grpc) as c:  # the same from the environment
        assert c.list_models()[0]["id"] == "llama"


async def test_pdserve_async_client_with_key_and_ca(secure, pki):
    async with AsyncClient(secure.grpc, api_key=pki["keys"]["user"], ca_file=pki["ca"]) as c:
        out = await c.generate("Hello", max_tokens=2, temperature=0.0)
    assert len(out.token_ids) == 2


def test_plaintext_grpc_client_fails_against_tls(secure, pki):
    with Client(secure.grpc, api_key=pki["keys"]["user"], timeout_s=5) as c:
        with pytest.raises(grpc.RpcError) as exc:
            c.list_models()
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_privileged_fields_need_an_operator_key(secure, pki):
    with Client(secure.grpc, api_key=pki["keys"]["user"], ca_file=pki["ca"]) as c:
        for kwargs, field in (({"route": "remote"}, "route"), ({"priority": "high"}, "priority")):
            with pytest.raises(grpc.RpcError) as exc:
                c.generate("Hello", max_tokens=2, **kwargs)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert exc.value.details().startswith(f"{field}:")
    with Client(secure.grpc, api_key=pki["keys"]["operator"], ca_file=pki["ca"]) as c:
        assert c.generate("Hello", max_tokens=2, route="local", priority="high").breakdown["route"] == "local"


def test_abort_only_by_the_key_that_sent_it(secure, pki):
    tls = {"ca_file": pki["ca"]}
    with Client(secure.grpc, api_key=pki["keys"]["user"], **tls) as owner, \
            Client(secure.grpc, api_key=pki["keys"]["other"], **tls) as other:
        stream = owner.stream("A long story begins", max_tokens=400, temperature=0.0, ignore_eos=True,
                              request_id="owned-by-user")
        assert next(stream).token_ids
        assert other.abort("owned-by-user") is False  # as if unknown: another key's request
        assert owner.abort("owned-by-user") is True
        rest = list(stream)
        assert rest and rest[-1].finish_reason == "abort"


def test_an_operator_key_acts_for_a_tenant_and_a_plain_key_may_not(secure, pki, https):
    """x-pdserve-tenant (what a gateway sends): from an operator key the request becomes the
    tenant's (its request-id namespace and per-key share), so the tenant's own key may abort
    it; from a plain key it is refused (403 / PERMISSION_DENIED) naming the header, and a
    malformed tenant is 400 / INVALID_ARGUMENT."""
    user = f"key:{hash_key(pki['keys']['user'])[:12]}"
    r = https.post("/v1/completions", json=COMPLETION, headers=bearer(pki, "user") | {TENANT_HEADER: "key:abc"})
    assert r.status_code == 403 and r.json()["error"]["param"] == TENANT_HEADER, r.text
    r = https.post("/v1/completions", json=COMPLETION, headers=bearer(pki, "operator") | {TENANT_HEADER: "a b"})
    assert r.status_code == 400 and TENANT_HEADER in r.json()["error"]["message"], r.text
    channel, stub = _stub(secure, pki)
    with channel:
        for who, tenant, code in (("user", user, grpc.StatusCode.PERMISSION_DENIED),
                                  ("operator", "bad tenant!", grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as exc:
                list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=30,
                                   metadata=md(pki, who) + ((TENANT_HEADER, tenant),)))
            assert exc.value.code() == code and exc.value.details().startswith(TENANT_HEADER), exc.value
        req = pb.GenerateRequest(text="A long story begins", request_id="for-user",
                                 sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0))
        call = stub.Generate(req, timeout=60, metadata=md(pki, "operator") + ((TENANT_HEADER, user),))
        assert next(call).token_ids
        frontend = secure.worker.frontend
        assert set(frontend.sequences_per_key) == {user}, frontend.sequences_per_key
        assert [r.tenant for r in list(secure.worker.engine.requests.values())] == [user]
        with Client(secure.grpc, api_key=pki["keys"]["other"], ca_file=pki["ca"]) as other, \
                Client(secure.grpc, api_key=pki["keys"]["user"], ca_file=pki["ca"]) as owner:
            assert other.abort("for-user") is False
            assert owner.abort("for-user") is True  # the tenant's own namespace
        assert list(call)[-1].finish_reason == "abort"
    r = https.post("/v1/completions", json=COMPLETION, headers=bearer(pki, "operator") | {TENANT_HEADER: user})
    assert r.status_code == 200, r.text


def test_the_same_request_id_from_two_keys_never_crosses(secure, pki):
    """Request ids are scoped to the API key: two tenants may use the same id at once, each
    gets its own prompt's tokens, and neither learns the other's id is in use."""
    tls = {"ca_file": pki["ca"]}
    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    with Client(secure.grpc, api_key=pki["keys"]["user"], **tls) as a, \
            Client(secure.grpc, api_key=pki["keys"]["other"], **tls) as b:
        alone = [a.generate(p, **kw).token_ids for p in ("Tenant A asks", "Tenant B asks something else")]
        sa = a.stream("Tenant A asks", request_id="shared-id", **kw)
        first_a = next(sa)
        sb = b.stream("Tenant B asks something else", request_id="shared-id", **kw)
        got_b = [t for m in sb for t in m.token_ids]
        got_a = list(first_a.token_ids) + [t for m in sa for t in m.token_ids]
    assert [list(x) for x in alone] == [got_a, got_b]


def test_operator_key_may_abort_any_request(secure, pki):
    tls = {"ca_file": pki["ca"]}
    with Client(secure.grpc, api_key=pki["keys"]["user"], **tls) as owner, \
            Client(secure.grpc, api_key=pki["keys"]["operator"], **tls) as op:
        stream = owner.stream("Another long story", max_tokens=400, temperature=0.0, ignore_eos=True,
                              request_id="ended-by-operator")
        assert next(stream).token_ids
        assert op.abort("ended-by-operator") is True
        assert list(stream)[-1].finish_reason == "abort"


# -- one key's share -------------------------------------------------------------------
def test_one_keys_calls_together_are_bounded_and_other_keys_are_not(secure, pki, https, monkeypatch):
    """limits.max_sequences_per_key (3 here) bounds every call of one key together, before any
    work: with one of its streams in flight, a call of 3 more is 429 naming the limit, while
    another key's call of 3 is served; once the stream ends, the first key's call is served."""
    frontend = secure.worker.frontend
    monkeypatch.setattr(frontend, "limits", dataclasses.replace(frontend.limits, max_sequences_per_key=3))
    three = {"prompt": ["One", "Two", "Three"], "max_tokens": 2, "temperature": 0}
    with Client(secure.grpc, api_key=pki["keys"]["user"], ca_file=pki["ca"]) as owner:
        stream = owner.stream("A long story begins", max_tokens=400, temperature=0.0, ignore_eos=True,
                              request_id="holds-one")
        assert next(stream).token_ids
        r = https.post("/v1/completions", json=three, headers=bearer(pki, "user"))
        assert r.status_code == 429, r.text
        assert "limits.max_sequences_per_key" in r.json()["error"]["message"] and r.headers.get("retry-after")
        other = https.post("/v1/completions", json=three, headers=bearer(pki, "other"))
        assert other.status_code == 200 and len(other.json()["choices"]) == 3
        assert owner.abort("holds-one") is True
        assert list(stream)[-1].finish_reason == "abort"
    wait_until(lambda: not frontend.sequences_per_key, 10)
    again = https.post("/v1/completions", json=three, headers=bearer(pki, "user"))
    assert again.status_code == 200 and len(again.json()["choices"]) == 3


def test_another_keys_request_is_not_queued_behind_one_keys_burst(secure, pki, monkeypatch):
    """With 4 sequence slots, key A's call of 12 prompts (3 waves of 4) and then key B's single
    request: B gets the next free slot (the engine admits waiting sequences in turns per key),
    so its stream ends before A's call is answered; in arrival order it would start 13th,
    after A's last wave."""
    eng = secure.worker.engine
    monkeypatch.setattr(eng.scheduler, "max_num_seqs", 4)
    ctx = ssl.create_default_context(cafile=pki["ca"])
    base = f"https://{secure.worker.http_address}"
    burst = {"prompt": [f"Burst prompt number {i}" for i in range(12)], "max_tokens": 24, "temperature": 0,
             "ignore_eos": True}
    ended: dict[str, float] = {}

    async def go():
        async with httpx.AsyncClient(base_url=base, verify=ctx, timeout=120) as h:
            async def call_a():
                r = await h.post("/v1/completions", json=burst, headers=bearer(pki, "user"))
                ended["A"] = time.monotonic()
                return r

            a = asyncio.ensure_future(call_a())
            await asyncio.to_thread(wait_until, lambda: len(eng.scheduler.waiting) >= 8, 30, 0.002)
            b = await h.post("/v1/completions", json={"prompt": "Just one question", "max_tokens": 4,
                                                      "temperature": 0}, headers=bearer(pki, "other"))
            ended["B"] = time.monotonic()
            return await a, b

    a, b = asyncio.run(go())
    assert a.status_code == 200 and b.status_code == 200
    assert len(a.json()["choices"]) == 12
    assert ended["B"] < ended["A"]


# -- mutual TLS -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mutual(llama_dir, tmp_path_factory, pki, logs):
    w = _start(llama_dir, tmp_path_factory, pki, tls_client_ca=pki["ca"])
    yield w
    w.stop()


def test_mtls_refuses_a_client_without_a_certificate(mutual, pki):
    ctx = ssl.create_default_context(cafile=pki["ca"])
    with httpx.Client(base_url=f"https://{mutual.worker.http_address}", verify=ctx, timeout=10) as h:
        with pytest.raises(httpx.TransportError):
            h.get("/health")
    with Client(mutual.grpc, api_key=pki["keys"]["user"], ca_file=pki["ca"], timeout_s=5) as c:
        with pytest.raises(grpc.RpcError) as exc:
            c.list_models()
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_serves_a_client_with_a_certificate(mutual, pki):
    ctx = ssl.create_default_context(cafile=pki["ca"])
    ctx.load_cert_chain(pki["client"], pki["client-key"])
    with httpx.Client(base_url=f"https://{mutual.worker.http_address}", verify=ctx, timeout=60) as h:
        assert h.get("/health").status_code == 200
        assert h.post("/v1/completions", json=COMPLETION).status_code == 401  # a certificate is not a key
        assert h.post("/v1/completions", json=COMPLETION, headers=bearer(pki, "user")).status_code == 200
    with Client(mutual.grpc, api_key=pki["keys"]["user"], ca_file=pki["ca"], client_cert=pki["client"],
                client_key=pki["client-key"]) as c:
        assert c.list_models()[0]["id"] == "llama"
    # The launcher's health check under mutual TLS presents the worker's own certificate.
    tls = ClientTLS(ca_file=pki["ca"], cert_file=pki["decode"], key_file=pki["decode-key"])
    with grpc_channel(mutual.grpc, tls) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_pdserve_demo_reaches_a_mutual_tls_worker_from_the_topology(mutual, pki, tmp_path, monkeypatch, capsys):
    from pdserve.cli import main
    from pdserve.state import ClusterState

    topology = tmp_path / "t.yaml"
    topology.write_text(f"""\
cluster: demo-sec
model: {{path: auto}}
roles: {{prefill: {{replicas: 0}}, decode: {{replicas: 1}}}}
security:
  tls: {{cert: {pki['decode']}, key: {pki['decode-key']}, client_ca: {pki['ca']}}}
  api_keys: {{file: {pki['keys_file']}}}
run_dir: {tmp_path}
""")
    ClusterState(cluster="demo-sec", topology=str(topology), namespace="n", ray_address="", ray_head_pid=None,
                 etcd_endpoints=[], etcd_pid=None, queue_name="q", model="m",
                 actors=[{"role": "decode", "worker_id": "decode-0", "grpc": mutual.grpc}]).save(
                     tmp_path / "demo-sec.state.json")
    for name in ("PDSERVE_CA_FILE", "PDSERVE_CLIENT_CERT", "PDSERVE_CLIENT_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PDSERVE_API_KEY", pki["keys"]["user"])
    assert main(["demo", "--topology", str(topology), "--max-tokens", "2", "--long-tokens", "60"]) == 0
    assert "routes used: local" in capsys.readouterr().out


# -- logs (last: every test above has run against these workers) ------------------------
def test_no_key_reaches_the_logs(logs, pki, secure):
    text = "\n".join(logs.lines)
    assert "serving gRPC" in text  # the capture saw the workers' own records
    for key in pki["keys"].values():
        assert key not in text
