"""A gateway in front of a decode worker that serves TLS and checks API keys: the gateway
checks its clients' keys itself (the same keys file, the same interceptor), refuses
privileged fields to a plain key, and calls the worker over TLS with an operator key."""

from __future__ import annotations

import grpc
import pytest

from pdserve.api import Client
from pdserve.certs import append_key, make_certs, new_key
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.cluster.security import hash_key
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.gateway.server import GatewayConfig
from tests.harness import PERMISSIVE_POLICY, GatewayThread, WorkerThread, wait_until


@pytest.fixture(scope="module")
def secured(llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gwsec")
    pki = {k: str(v) for k, v in make_certs(d / "pki").items()}
    keys = {"user": new_key(), "operator": new_key(), "wrong": new_key()}
    for name in ("user", "operator"):
        append_key(d / "keys.txt", keys[name], operator=name == "operator")
    (d / "router.yaml").write_text(PERMISSIVE_POLICY)
    tls = dict(tls_cert=pki["decode"], tls_key=pki["decode-key"], api_keys_file=str(d / "keys.txt"))
    with EmbeddedEtcd(d / "etcd") as etcd:
        w = gw = None
        try:
            w = WorkerThread(DecodeWorkerConfig(
                model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster="gwsec", lease_ttl_s=3, worker_id="decode-0",
                router_policy=str(d / "router.yaml"), host="127.0.0.1", **tls)).start()
            gw = GatewayThread(GatewayConfig(
                [etcd.endpoint], "gwsec", model=llama_dir, worker_api_key=keys["operator"],
                worker_ca_file=pki["ca"], **tls)).start()
            wait_until(lambda: len(gw.gateway.backends.workers) == 1, 20)
            yield w, gw, keys, pki
        finally:
            if gw is not None:
                gw.stop()
            if w is not None:
                w.stop()


def test_a_client_key_is_checked_at_the_gateway_and_the_worker_is_called_over_tls(secured):
    w, gw, keys, pki = secured
    target = gw.gateway.grpc_address
    with Client(target, api_key=keys["user"], ca_file=pki["ca"]) as c:
        out = c.generate("hello there", max_tokens=5, temperature=0.0)
    with Client(w.grpc, api_key=keys["user"], ca_file=pki["ca"]) as direct:
        assert direct.generate("hello there", max_tokens=5, temperature=0.0).token_ids == out.token_ids
    for key in (None, keys["wrong"]):
        with Client(target, api_key=key, ca_file=pki["ca"]) as c:
            with pytest.raises(grpc.RpcError) as ei:
                c.generate("hello there", max_tokens=2)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_privileged_fields_need_an_operator_key_at_the_gateway(secured):
    _, gw, keys, pki = secured
    with Client(gw.gateway.grpc_address, api_key=keys["user"], ca_file=pki["ca"]) as c:
        with pytest.raises(grpc.RpcError) as ei:
            c.generate("hello", max_tokens=2, route="local")
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED and "route" in ei.value.details()
    with Client(gw.gateway.grpc_address, api_key=keys["operator"], ca_file=pki["ca"]) as c:
        assert c.generate("hello", max_tokens=2, route="local", priority="high").finish_reason == "length"


def test_the_worker_sees_each_client_of_the_gateway_as_its_own_tenant(secured):
    """The gateway calls the worker with its operator key and the client's key identity
    (x-pdserve-tenant): the worker's per-key fairness and sequence share count the client,
    not the gateway's one key; the client still aborts its request at the gateway."""
    w, gw, keys, pki = secured
    user = f"key:{hash_key(keys['user'])[:12]}"
    with Client(gw.gateway.grpc_address, api_key=keys["user"], ca_file=pki["ca"]) as c:
        stream = c.stream("A long story begins", max_tokens=400, temperature=0.0, ignore_eos=True,
                          request_id="through-the-gateway")
        assert next(stream).token_ids
        assert set(w.worker.frontend.sequences_per_key) == {user}, w.worker.frontend.sequences_per_key
        assert [r.tenant for r in list(w.worker.engine.requests.values())] == [user]
        assert c.abort("through-the-gateway") is True
        assert list(stream)[-1].finish_reason == "abort"
    wait_until(lambda: not w.worker.engine.requests, 10)


SERVICE_NAME = "pd-decode.llm.svc"  # what a Kubernetes decode Service is called; no worker dials it here


def test_the_gateway_checks_the_workers_certificate_for_their_service_name(llama_dir, tmp_path):
    """On Kubernetes workers register their pod IPs, which no certificate names: the gateway
    checks the workers' certificate for `security.tls.server_name` (the decode Service's name)
    instead of the address it dials. The worker's certificate here names only that Service."""
    pki = {k: str(v) for k, v in make_certs(tmp_path / "pki", [SERVICE_NAME]).items()}
    (tmp_path / "router.yaml").write_text(PERMISSIVE_POLICY)
    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        w = gw = None
        try:
            w = WorkerThread(DecodeWorkerConfig(
                model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster="svcname", lease_ttl_s=3,
                worker_id="decode-0", router_policy=str(tmp_path / "router.yaml"), host="127.0.0.1",
                tls_cert=pki["decode"], tls_key=pki["decode-key"])).start()
            with Client(w.grpc, ca_file=pki["ca"], timeout_s=10) as by_address:
                with pytest.raises(grpc.RpcError) as ei:  # the certificate does not name 127.0.0.1
                    by_address.generate("hello there", max_tokens=2)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            with Client(w.grpc, ca_file=pki["ca"], server_name=SERVICE_NAME) as direct:
                want = direct.generate("hello there", max_tokens=5, temperature=0.0).token_ids
            gw = GatewayThread(GatewayConfig([etcd.endpoint], "svcname", model=llama_dir, worker_ca_file=pki["ca"],
                                             worker_server_name=SERVICE_NAME)).start()
            wait_until(lambda: len(gw.gateway.backends.workers) == 1, 20)
            with Client(gw.gateway.grpc_address) as c:
                assert c.generate("hello there", max_tokens=5, temperature=0.0).token_ids == want
        finally:
            if gw is not None:
                gw.stop()
            if w is not None:
                w.stop()


def test_a_gateway_takes_the_topologys_security_and_a_read_only_etcd_identity(tmp_path):
    """`pdserve gateway --topology` and `pdserve up`'s gateways: the workers' TLS and keys for
    its own clients, their CA, service name and (mutual TLS) certificate to call them with, the
    operator key from gateway.worker_api_key_file, and etcd as `reader` when the topology lists it."""
    from pdserve.cluster.topology import load_topology
    from pdserve.gateway.actor import security_config

    pki = {k: str(v) for k, v in make_certs(tmp_path / "pki").items()}
    append_key(tmp_path / "keys.txt", new_key())
    operator = new_key()
    (tmp_path / "worker.key").write_text(operator + "\n")
    (tmp_path / "router.yaml").write_text(PERMISSIVE_POLICY)
    (tmp_path / "model").mkdir()
    ident = lambda n: f"{{cert: {pki[f'etcd-{n}']}, key: {pki[f'etcd-{n}-key']}}}"  # noqa: E731
    base = f"""
cluster: t
model: {{path: model}}
router_policy: router.yaml
roles: {{prefill: {{replicas: 0}}, decode: {{replicas: 1}}}}
etcd:
  endpoints: ["127.0.0.1:2379"]
  tls: {{ca: {pki['ca']}, operator: {ident('operator')}, reader: {ident('reader')}}}
security:
  tls: {{cert: {pki['decode']}, key: {pki['decode-key']}, client_ca: {pki['ca']}, server_name: {SERVICE_NAME}}}
  api_keys: {{file: keys.txt}}
"""
    path = tmp_path / "t.yaml"
    path.write_text(base)
    with pytest.raises(ValueError, match="gateway.worker_api_key_file"):
        security_config(load_topology(path))
    path.write_text(base + "gateway: {worker_api_key_file: worker.key}\n")
    sec = security_config(load_topology(path))
    assert sec["worker_api_key"] == operator
    assert (sec["tls_cert"], sec["tls_client_ca"], sec["api_keys_file"]) == \
        (pki["decode"], pki["ca"], str(tmp_path / "keys.txt"))
    assert (sec["worker_ca_file"], sec["worker_client_cert"], sec["worker_server_name"]) == \
        (pki["ca"], pki["decode"], SERVICE_NAME)
    assert sec["etcd_tls"]["identity"] == "reader" and sec["etcd_tls"]["cert_file"] == pki["etcd-reader"]
