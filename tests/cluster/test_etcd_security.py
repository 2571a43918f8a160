"""etcd with TLS, client certificates and RBAC (cluster/etcd_auth.py, docs/security.md),
against a real etcd started as `pdserve up` starts it. Each attack of issue #20 on etcd
(drain a worker, rewrite the policy, register a fake worker) is tried without credentials
and with the worker identity, and refused; the operator and the workers still do their jobs."""

from __future__ import annotations

import asyncio
import textwrap

import aetcd
import grpc
import pytest
from aetcd import rpc

from pdserve.cluster.etcd_auth import EtcdAccessDenied
from pdserve.cluster.join import join_cluster
from pdserve.cluster.registry import Registry, WorkerInfo
from pdserve.cluster.worker_config import WorkerConfig

pytestmark = pytest.mark.timeout(60)
TTL_S = 2.0
FAST = dict(backoff_initial_s=0.05, backoff_max_s=0.5, request_timeout_s=2.0)
POLICY = "offload:\n  threshold_tokens: 1\n"


def worker(worker_id: str, role: str = "prefill") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, endpoints={"grpc": "127.0.0.1:1"}, model="tiny",
                      kv_layout={"dtype": "float32", "block_size": 16, "num_kv_heads": 2, "head_dim": 16})


def worker_key(cluster: str, worker_id: str) -> bytes:
    return f"/pdserve/{cluster}/workers/prefill/{worker_id}".encode()


@pytest.fixture
async def secure(secure_etcd, cluster_name):
    """The TLS etcd, RBAC set up for this test's cluster."""
    await secure_etcd.grant(cluster_name)
    return secure_etcd


def registry(secure, cluster: str, identity: str | None, **kw) -> Registry:
    return Registry(secure.endpoint, cluster, ttl_s=TTL_S, tls=secure.identity(identity) if identity else None,
                    **FAST, **kw)


async def test_a_client_without_a_certificate_cannot_register_a_fake_worker(secure, cluster_name):
    async with registry(secure, cluster_name, None) as plaintext:
        with pytest.raises(aetcd.ClientError):
            await plaintext.register(worker("fake-p0"))
    # TLS, trusting the right CA, but no client certificate: the handshake fails.
    ca = open(secure.certs["ca"], "rb").read()
    channel = grpc.aio.secure_channel(secure.endpoint, grpc.ssl_channel_credentials(root_certificates=ca))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rpc.KVStub(channel).Put(rpc.PutRequest(key=worker_key(cluster_name, "fake-p1"), value=b"{}"),
                                          timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
    async with registry(secure, cluster_name, "operator") as operator:
        assert await operator.members() == {}


async def test_a_certificate_from_the_ca_that_names_no_etcd_user_gets_nothing(secure, cluster_name):
    # The API clients' certificate shares the CA in `certs make`'s set: RBAC, not the CA, decides.
    tls = secure.identity("client", cert="client")
    async with Registry(secure.endpoint, cluster_name, ttl_s=TTL_S, tls=tls, **FAST) as stranger:
        with pytest.raises(EtcdAccessDenied, match="identity 'client'"):
            await stranger.register(worker("fake-p0"))
        with pytest.raises(aetcd.ClientError, match="permission denied"):
            await stranger.members()


async def test_a_worker_identity_cannot_drain_a_worker_or_rewrite_a_policy(secure, cluster_name):
    async with registry(secure, cluster_name, "worker") as w, registry(secure, cluster_name, "operator") as operator:
        await operator.register(worker("d0", "decode"))
        with pytest.raises(EtcdAccessDenied, match=r"drain/d0 to identity 'worker'.*pdserve-worker"):
            await w.request_drain("d0")
        with pytest.raises(EtcdAccessDenied, match="config/router"):
            await w.put_policy("router", POLICY)
        for key in (f"/pdserve/{cluster_name}/config/autoscale", f"/pdserve/{cluster_name}/planner/state",
                    f"/pdserve/other-{cluster_name}/workers/prefill/p9"):
            with pytest.raises(aetcd.ClientError, match="permission denied"):
                await w.client().put(key.encode(), b"x")
        assert await operator.get_policy("router") is None
        assert await operator.client().get(operator.keys.drain("d0")) is None
        assert set(await operator.members()) == {"d0"}  # its lease was not revoked either


async def test_a_worker_identity_registers_reads_the_cluster_and_leaves(secure, cluster_name):
    async with registry(secure, cluster_name, "worker") as p0, registry(secure, cluster_name, "operator") as operator:
        await operator.put_policy("router", POLICY)
        await p0.register(worker("p0"), nixl_metadata=b"\x00nixl")
        seen = await p0.watch_policy("router", validate=str)
        await seen.wait_synced(5)
        assert seen.current == POLICY  # workers read config/ ...
        assert (await operator.members())["p0"] == worker("p0")
        assert await operator.get_nixl_metadata("p0") == b"\x00nixl"
        await asyncio.sleep(TTL_S)  # ... keep their lease alive past its TTL ...
        assert set(await operator.members()) == {"p0"}
        await p0.deregister()  # ... and revoke it (it holds only keys they may write)
        assert await operator.members() == {}


async def test_the_operator_identity_drains_a_worker(secure, cluster_name):
    async with registry(secure, cluster_name, "worker") as d0, registry(secure, cluster_name, "operator") as operator:
        await d0.register(worker("d0", "decode"))
        drained = asyncio.Event()
        await d0.watch_drain("d0", lambda reason: drained.set())
        assert await operator.request_drain("d0", "test")
        await asyncio.wait_for(drained.wait(), 5)
        assert await operator.members() == {}  # its lease was revoked


async def test_a_worker_ignores_a_drain_request_older_than_itself_and_obeys_a_new_one(secure, cluster_name):
    """A worker may not delete drain keys: one left from an earlier incarnation stays, and a
    worker started again under that id must not drain at once because of it."""
    cfg = WorkerConfig(model="unused", worker_id="d0", cluster=cluster_name, etcd_endpoints=[secure.endpoint],
                       etcd_tls=secure.identity("worker").to_dict(), lease_ttl_s=TTL_S)
    async with registry(secure, cluster_name, "operator") as operator:
        await operator.request_drain("d0", "an earlier drain")
        drained = asyncio.Event()

        async def on_drain():
            drained.set()

        reg = await join_cluster(cfg, worker("d0", "decode"), on_drain=on_drain)
        try:
            await asyncio.sleep(0.3)
            assert not drained.is_set() and set(await operator.members()) == {"d0"}
            await operator.request_drain("d0", "drain now")
            await asyncio.wait_for(drained.wait(), 5)
        finally:
            await reg.close()


def test_pdserve_up_starts_its_etcd_with_tls_and_rbac(secure_etcd, tmp_path):
    """The launcher's etcd step: TLS listeners, users and roles before any worker starts."""
    from pdserve.cluster.launcher import ClusterState, Launcher, _terminate_group
    from pdserve.cluster.topology import load_topology

    c = secure_etcd.certs
    (tmp_path / "t.yaml").write_text(textwrap.dedent(f"""\
        cluster: launched
        model: {{path: auto}}
        roles: {{prefill: {{replicas: 1}}, decode: {{replicas: 1}}}}
        run_dir: {tmp_path}/runs
        etcd:
          tls:
            ca: {c['ca']}
            server: {{cert: {c['etcd']}, key: {c['etcd-key']}}}
            root: {{cert: {c['etcd-root']}, key: {c['etcd-root-key']}}}
            operator: {{cert: {c['etcd-operator']}, key: {c['etcd-operator-key']}}}
            worker: {{cert: {c['etcd-worker']}, key: {c['etcd-worker-key']}}}
        """))
    topo = load_topology(tmp_path / "t.yaml")
    state = ClusterState(cluster="launched", topology="t.yaml", namespace="x", ray_address="", ray_head_pid=None,
                         etcd_endpoints=[], etcd_pid=None, queue_name="q", model="m")
    Launcher(topo, "t.yaml", "m", progress=lambda line: None)._start_etcd(state, tmp_path / "runs")
    try:
        async def attempts():
            async with Registry(state.etcd_endpoints, "launched", tls=topo.etcd_tls("worker"), **FAST) as w, \
                    Registry(state.etcd_endpoints, "launched", tls=topo.etcd_tls("operator"), **FAST) as op, \
                    Registry(state.etcd_endpoints, "launched", **FAST) as plaintext:
                await w.register(worker("p0"))
                with pytest.raises(EtcdAccessDenied):
                    await w.request_drain("p0")
                with pytest.raises(aetcd.ClientError):
                    await plaintext.members()
                assert await op.request_drain("p0")

        asyncio.run(attempts())
    finally:
        _terminate_group(state.etcd_pid, "etcd", lambda line: None, own_group=False)


# -- certificates and settings (no etcd) ------------------------------------------------
TOPOLOGY = """\
cluster: sec
model: {path: auto}
roles: {prefill: {replicas: 1}, decode: {replicas: 1}}
"""


def test_certs_make_writes_one_etcd_client_certificate_per_identity(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from pdserve.cluster.certs import make_certs

    paths = make_certs(tmp_path)
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    for identity in ("root", "operator", "worker"):
        cert = x509.load_pem_x509_certificate(paths[f"etcd-{identity}"].read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity  # etcd's user name
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == \
            [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert oct(paths[f"etcd-{identity}-key"].stat().st_mode & 0o777) == "0o600"


def test_etcd_tls_reaches_each_process_as_its_identity(tmp_path):
    from pdserve.cluster.certs import make_certs
    from pdserve.cluster.topology import load_topology
    from pdserve.cluster.worker_config import launch_config

    make_certs(tmp_path / "pki")
    (tmp_path / "plain.yaml").write_text(TOPOLOGY)
    plain = load_topology(tmp_path / "plain.yaml")
    assert plain.etcd_tls("operator") is None and launch_config(plain, "decode", 0, model="/m",
                                                                  etcd_endpoints=[])["etcd_tls"] is None
    (tmp_path / "t.yaml").write_text(TOPOLOGY + textwrap.dedent("""\
        etcd:
          endpoints: [10.0.0.5:2379]
          tls:
            ca: pki/ca.pem
            worker: {cert: pki/etcd-worker.pem, key: pki/etcd-worker-key.pem}
        """))
    topo = load_topology(tmp_path / "t.yaml")
    for role in ("prefill", "decode"):
        tls = launch_config(topo, role, 0, model="/m", etcd_endpoints=["10.0.0.5:2379"])["etcd_tls"]
        pki = tmp_path / "pki"
        assert tls == {"ca_file": str(pki / "ca.pem"), "cert_file": str(pki / "etcd-worker.pem"),
                       "key_file": str(pki / "etcd-worker-key.pem"), "identity": "worker", "setting": "etcd.tls.worker"}
    with pytest.raises(ValueError, match="set etcd.tls.operator"):
        topo.etcd_tls("operator")  # this host holds no operator certificate: no `pdserve drain` from here
    assert topo.etcd_tls("operator", "worker").identity == "worker"  # what read-only commands accept


@pytest.mark.parametrize("section, where, message", [
    ("etcd:\n  tls: {ca: pki/ca.pem}\n", "etcd", "needs tls.server and tls.root"),
    ("etcd:\n  endpoints: [h:1]\n  tls: {ca: pki/ca.pem, worker: {cert: pki/nope.pem, key: pki/ca.pem}}\n",
     "etcd.tls.worker.cert", "not found"),
    ("etcd:\n  endpoints: [h:1]\n  tls: {ca: pki/ca.pem, admin: {cert: a, key: b}}\n", "etcd.tls.admin", "unknown key"),
])
def test_bad_etcd_tls_settings_name_the_key(tmp_path, section, where, message):
    from pdserve.cluster.certs import make_certs
    from pdserve.cluster.topology import TopologyError, load_topology

    make_certs(tmp_path / "pki")
    (tmp_path / "t.yaml").write_text(TOPOLOGY + section)
    with pytest.raises(TopologyError) as exc:
        load_topology(tmp_path / "t.yaml")
    key, _, msg = exc.value.issues[0]
    assert key == where and message in msg, exc.value.issues
