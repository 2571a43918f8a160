"""etcd with TLS, client certificates and RBAC (cluster/etcd_auth.py, docs/security.md),
against a real etcd started as `pdserve up` starts it. Each attack of issue #20 on etcd
(drain a worker, rewrite the policy, register a fake worker) is tried without credentials
and with the worker identity, and refused; the operator and the workers still do their jobs.
With an identity per worker (etcd.tls.workers) a worker cannot touch another worker's record
or NIXL metadata either, which the shared worker identity could."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import textwrap

import aetcd
import grpc
import pytest
from aetcd import rpc

from pdserve.certs import issue_worker_certs
from pdserve.cluster.etcd_auth import ClusterAccess, EtcdAccessDenied, WorkerCerts, bootstrap_rbac
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


async def test_the_reader_identity_follows_the_cluster_and_writes_nothing(secure, cluster_name):
    """What a gateway or the KV index connects as: it reads the members and policies, and
    etcd refuses it every write (a worker record, a policy, a drain)."""
    async with registry(secure, cluster_name, "reader") as r, registry(secure, cluster_name, "operator") as operator:
        await operator.register(worker("d0", "decode"))
        await operator.put_policy("router", POLICY)
        assert set(await r.members()) == {"d0"}
        seen = await r.watch_policy("router", validate=str)
        await seen.wait_synced(5)
        assert seen.current == POLICY
        with pytest.raises(EtcdAccessDenied, match=r"drain/d0 to identity 'reader'.*pdserve-reader"):
            await r.request_drain("d0")
        for key in (worker_key(cluster_name, "fake-p0"), f"/pdserve/{cluster_name}/config/router".encode(),
                    f"/pdserve/{cluster_name}/nixl/d0".encode()):
            with pytest.raises(aetcd.ClientError, match="permission denied"):
                await r.client().put(key, b"x")
        assert set(await operator.members()) == {"d0"} and await operator.get_policy("router") == POLICY


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


# -- one identity per worker (etcd.tls.workers) -------------------------------------------
SLOTS = (("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0"))


def worker_certs(secure, cluster: str, worker_ids, where) -> WorkerCerts:
    """Certificates of `cluster`'s worker ids from the etcd's CA, under `where`/etcd-workers
    (`pdserve certs workers` beside a copy of the CA)."""
    where.mkdir()
    for name in ("ca.pem", "ca-key.pem"):
        shutil.copy(secure.certs["ca"].parent / name, where / name)
    issue_worker_certs(where, cluster, worker_ids)
    return WorkerCerts(ca_file=str(secure.certs["ca"]), dir=str(where / "etcd-workers"), cluster=cluster)


@pytest.fixture
async def own(secure_etcd, cluster_name, tmp_path) -> WorkerCerts:
    """This test's cluster with a user per worker slot and no shared worker grant, and the
    slots' certificates."""
    await bootstrap_rbac(secure_etcd.endpoint, secure_etcd.identity("root"),
                         [ClusterAccess(cluster_name, SLOTS, shared_worker=False)])
    return worker_certs(secure_etcd, cluster_name, [wid for _, wid in SLOTS], tmp_path / "pki")


def as_worker(secure, own: WorkerCerts, worker_id: str) -> Registry:
    return Registry(secure.endpoint, own.cluster, ttl_s=TTL_S, tls=own.tls(worker_id), **FAST)


async def test_a_worker_identity_of_its_own_writes_its_own_keys_and_no_other_workers(secure_etcd, own):
    c = own.cluster
    async with as_worker(secure_etcd, own, "prefill-0") as p0, as_worker(secure_etcd, own, "prefill-1") as p1, \
            registry(secure_etcd, c, "operator") as operator:
        await p1.register(worker("prefill-1"), nixl_metadata=b"p1-agent")
        await p0.register(worker("prefill-0"), nixl_metadata=b"p0-agent")
        info = p0.info
        info.load = {"tasks": 3}
        assert await p0.update(info)  # its own record, load included
        p1_lease = (await p0.client().get(worker_key(c, "prefill-1"))).lease
        nixl_p1 = f"/pdserve/{c}/nixl/prefill-1".encode()
        for attempt in (lambda: p0.client().put(worker_key(c, "prefill-1"), worker("prefill-1").to_json()),
                        lambda: p0.client().delete(worker_key(c, "prefill-1")),
                        lambda: p0.client().put(nixl_p1, b"evil-agent"),
                        lambda: p0.client().delete(nixl_p1),
                        lambda: p0.client().revoke_lease(p1_lease),
                        # its own id under another role
                        lambda: p0.client().put(f"/pdserve/{c}/workers/decode/prefill-0".encode(), b"{}"),
                        lambda: p1.client().put(nixl_p1 + b"0", b"x"),  # exact keys: nixl/prefill-10 is not p1's
                        # maintenance is root's (lease keep-alive, grant and compaction are not
                        # covered by etcd's RBAC at all: docs/security.md says how pdserve copes)
                        lambda: p0.client().hash(), lambda: p0.client().defragment()):
            with pytest.raises(aetcd.ClientError, match="permission denied"):
                await attempt()
        async with as_worker(secure_etcd, own, "prefill-0") as fake:
            with pytest.raises(EtcdAccessDenied, match=r"identity 'worker/.*/prefill-0'.*role pdserve-worker/"):
                await fake.register(worker("prefill-9"))
        members = await operator.members()
        assert set(members) == {"prefill-0", "prefill-1"} and members["prefill-0"].load == {"tasks": 3}
        assert await operator.get_nixl_metadata("prefill-1") == b"p1-agent"
        await p0.deregister()  # revoking its own lease: it holds only its own keys
        assert set(await operator.members()) == {"prefill-1"}


async def test_the_shared_worker_identity_could_replace_a_decode_workers_task_key_and_its_own_cannot(
        secure_etcd, own):
    """The attack the role-level grant left open: a prefill host rewrites decode-0's record
    (its task-signing key, endpoints) and NIXL metadata, so that its own forged tasks verify
    and KV pages go where it says. With the shared identity it works; with its own it does not."""
    forged = WorkerInfo(worker_id="decode-0", role="decode", endpoints={"grpc": "10.6.6.6:1"}, task_key="Zm9yZ2Vk")
    old = f"{own.cluster}-shared"
    await secure_etcd.grant(old)  # the grants before per-worker identities
    for cluster, attacker in ((old, registry(secure_etcd, old, "worker")), (own.cluster,
                                                                          as_worker(secure_etcd, own, "prefill-0"))):
        async with as_worker(secure_etcd, own, "decode-0") as d0, attacker, \
                registry(secure_etcd, cluster, "operator") as operator:
            if cluster == own.cluster:
                await d0.register(worker("decode-0", "decode"), nixl_metadata=b"d0-agent")
            else:  # the shared cluster's decode-0 (the per-worker user holds no grant there)
                await operator.register(worker("decode-0", "decode"), nixl_metadata=b"d0-agent")
            key = f"/pdserve/{cluster}/workers/decode/decode-0".encode()
            lease = (await operator.client().get(key)).lease
            attack = [lambda: attacker.client().put(key, forged.to_json(), lease=lease),
                      lambda: attacker.client().put(f"/pdserve/{cluster}/nixl/decode-0".encode(), b"evil-agent",
                                                    lease=lease)]
            if cluster == old:
                for step in attack:
                    await step()
                assert (await operator.members())["decode-0"].task_key == forged.task_key
                assert await operator.get_nixl_metadata("decode-0") == b"evil-agent"
                continue
            for step in attack:
                with pytest.raises(aetcd.ClientError, match="permission denied"):
                    await step()
            assert (await operator.members())["decode-0"] == worker("decode-0", "decode")
            assert await operator.get_nixl_metadata("decode-0") == b"d0-agent"


async def test_moving_a_cluster_to_per_worker_identities_revokes_the_shared_worker_grant(secure_etcd, cluster_name):
    await secure_etcd.grant(cluster_name)
    async with registry(secure_etcd, cluster_name, "worker") as shared:
        await shared.register(worker("prefill-0"))
        await shared.deregister()
        access = ClusterAccess(cluster_name, SLOTS, shared_worker=False)
        for _ in range(2):  # idempotent, the revocation included
            await bootstrap_rbac(secure_etcd.endpoint, secure_etcd.identity("root"), [access])
        with pytest.raises(EtcdAccessDenied, match="identity 'worker'"):
            await shared.register(worker("prefill-0"))


async def test_a_worker_joins_as_the_identity_of_its_worker_id(secure_etcd, own):
    """The config carries where the certificates are; the id picks one when the worker joins,
    so a worker that changes role in place (a new id) joins as that id."""
    cfg = WorkerConfig(model="unused", cluster=own.cluster, etcd_endpoints=[secure_etcd.endpoint],
                       etcd_worker_certs=own.to_dict(), lease_ttl_s=TTL_S)
    async def on_drain():
        pass

    for info in (worker("prefill-1"), worker("decode-0", "decode")):
        reg = await join_cluster(cfg, info, b"agent", on_drain=on_drain)
        try:
            assert reg.tls.identity == f"worker/{own.cluster}/{info.worker_id}"
        finally:
            await reg.close()
    with pytest.raises(ValueError, match=r"worker prefill-7 has no etcd identity.*etcd.tls.workers.slots"):
        await join_cluster(cfg, worker("prefill-7"), on_drain=on_drain)


def launcher_topology(secure, tmp_path, cluster: str, worker_ids: list[str], etcd_extra: str = ""):
    """A topology whose embedded etcd has TLS, RBAC and a certificate per worker id (under
    tmp_path/pki), at tmp_path/t.yaml; and the launcher's empty state for it."""
    from pdserve.cluster.topology import load_topology
    from pdserve.launcher import ClusterState

    c = secure.certs
    own = worker_certs(secure, cluster, worker_ids, tmp_path / "pki")
    (tmp_path / "t.yaml").write_text(textwrap.dedent(f"""\
        cluster: {cluster}
        model: {{path: auto}}
        roles: {{prefill: {{replicas: 1}}, decode: {{replicas: 1}}}}
        run_dir: {tmp_path}/runs
        etcd:
          {etcd_extra or "lease_ttl_s: 10"}
          tls:
            ca: {c['ca']}
            server: {{cert: {c['etcd']}, key: {c['etcd-key']}}}
            root: {{cert: {c['etcd-root']}, key: {c['etcd-root-key']}}}
            operator: {{cert: {c['etcd-operator']}, key: {c['etcd-operator-key']}}}
            workers: {{dir: {own.dir}}}
        """))
    state = ClusterState(cluster=cluster, topology="t.yaml", namespace="x", ray_address="", ray_head_pid=None,
                         etcd_endpoints=[], etcd_pid=None, queue_name="q", model="m")
    return load_topology(tmp_path / "t.yaml"), state


def test_pdserve_up_starts_its_etcd_with_tls_and_rbac(secure_etcd, tmp_path):
    """The launcher's etcd step: TLS listeners, users and roles before any worker starts: one
    per worker id the topology and its autoscale policy can run, and none shared."""
    from pdserve.launcher import Launcher
    from pdserve.processes import terminate_group

    topo, state = launcher_topology(secure_etcd, tmp_path, "launched", ["prefill-0", "prefill-1", "decode-0"])
    lines = []
    launcher = Launcher(topo, "t.yaml", "m", progress=lines.append, max_replicas={"prefill": 2, "decode": 1})
    launcher._check_worker_identities()
    launcher._start_etcd(state, tmp_path / "runs")
    assert "RBAC on (users root, operator, and one per worker id: 3)" in lines[-1]
    try:
        async def attempts():
            tls = {wid: topo.worker_etcd_tls(wid) for wid in ("prefill-0", "prefill-1")}
            async with Registry(state.etcd_endpoints, "launched", tls=tls["prefill-1"], **FAST) as p1, \
                    Registry(state.etcd_endpoints, "launched", tls=tls["prefill-0"], **FAST) as p0, \
                    Registry(state.etcd_endpoints, "launched", tls=secure_etcd.identity("worker"), **FAST) as shared, \
                    Registry(state.etcd_endpoints, "launched", tls=topo.etcd_tls("operator"), **FAST) as op, \
                    Registry(state.etcd_endpoints, "launched", **FAST) as plaintext:
                await p1.register(worker("prefill-1"))  # a slot the autoscale policy's max_replicas adds
                await p0.register(worker("prefill-0"))
                for attempt in (lambda: p0.request_drain("prefill-0"),
                                lambda: p0.client().delete(worker_key("launched", "prefill-1")),
                                lambda: shared.register(worker("prefill-2"))):  # the shared identity: no grant here
                    with pytest.raises((EtcdAccessDenied, aetcd.ClientError), match="permission denied"):
                        await attempt()
                with pytest.raises(aetcd.ClientError):
                    await plaintext.members()
                assert await op.request_drain("prefill-0")

        asyncio.run(attempts())
    finally:
        terminate_group(state.etcd_pid, "etcd", lambda line: None, own_group=False)


# -- certificates and settings (no etcd) ------------------------------------------------
TOPOLOGY = """\
cluster: sec
model: {path: auto}
roles: {prefill: {replicas: 1}, decode: {replicas: 1}}
"""


def test_certs_make_writes_one_etcd_client_certificate_per_identity(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from pdserve.certs import make_certs

    paths = make_certs(tmp_path)
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    for identity in ("root", "operator", "worker", "reader"):
        cert = x509.load_pem_x509_certificate(paths[f"etcd-{identity}"].read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity  # etcd's user name
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == \
            [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert oct(paths[f"etcd-{identity}-key"].stat().st_mode & 0o777) == "0o600"


def test_etcd_tls_reaches_each_process_as_its_identity(tmp_path):
    from pdserve.certs import make_certs
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
    from pdserve.certs import make_certs
    from pdserve.cluster.topology import TopologyError, load_topology

    make_certs(tmp_path / "pki")
    (tmp_path / "t.yaml").write_text(TOPOLOGY + section)
    with pytest.raises(TopologyError) as exc:
        load_topology(tmp_path / "t.yaml")
    issue = exc.value.issues[0]
    assert issue.path == where and message in issue.message, exc.value.issues


# -- worker slots: the ids that get an identity, and what the planner does with them -------
AUTOSCALE = """\
autoscale:
  prefill: {min_replicas: 1, max_replicas: 3, scale_up: {queue_length: 8}, scale_down: {queue_length: 1}}
  decode: {min_replicas: 1, max_replicas: 1, scale_up: {queue_length: 1000}, scale_down: {queue_length: 0}}
"""


def per_worker_topology(tmp_path, workers: str = "{dir: pki/etcd-workers}", extra: str = ""):
    from pdserve.certs import make_certs
    from pdserve.cluster.topology import load_topology
    from pdserve.cluster.worker_config import worker_slots
    from pdserve.cluster.planner.policy import autoscale_max_replicas

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "autoscale.yaml").write_text(AUTOSCALE)
    (tmp_path / "t.yaml").write_text(TOPOLOGY + "autoscale_policy: autoscale.yaml\n" + textwrap.dedent(f"""\
        etcd:
          endpoints: [10.0.0.5:2379]
          tls:
            ca: pki/ca.pem
            workers: {workers}
        """) + extra)
    topo = load_topology(tmp_path / "t.yaml", check_files=False)
    ids = [wid for _, wid in worker_slots(topo, autoscale_max_replicas(topo))]
    make_certs(tmp_path / "pki", cluster="sec", worker_ids=ids)
    return load_topology(tmp_path / "t.yaml"), ids


def test_every_id_the_topology_and_its_autoscale_policy_can_run_gets_an_identity(tmp_path):
    from pdserve.cluster.topology import load_topology
    from pdserve.cluster.worker_config import worker_slot_counts

    topo, ids = per_worker_topology(tmp_path / "a")
    assert ids == ["prefill-0", "prefill-1", "prefill-2", "decode-0"]  # max_replicas 3 and 1
    assert worker_slot_counts(topo) == {"prefill": 1, "decode": 1}  # no policy: the replicas
    _, ids = per_worker_topology(tmp_path / "b", "{dir: pki/etcd-workers, slots: {prefill: 5}}")
    assert ids == [f"prefill-{i}" for i in range(5)] + ["decode-0"]  # explicit slots win over max_replicas
    (tmp_path / "b/t.yaml").write_text((tmp_path / "b/t.yaml").read_text().replace("prefill: 5", "decode: 0"))
    with pytest.raises(ValueError, match=r"etcd.tls.workers.slots.decode is 0, fewer than roles.decode.replicas"):
        worker_slot_counts(load_topology(tmp_path / "b/t.yaml"))


def test_each_worker_config_picks_the_certificate_of_its_worker_id(tmp_path):
    from pdserve.cluster.worker_config import launch_config

    topo, _ = per_worker_topology(tmp_path)
    cfg = WorkerConfig.of({k: v for k, v in launch_config(topo, "prefill", 0, model="/m", etcd_endpoints=["h:1"])
                           .items() if k in WorkerConfig.__dataclass_fields__})
    assert cfg.etcd_tls is None  # no shared worker identity in this topology
    tls = cfg.etcd_tls_for("decode-0")  # the same config under another id (a role flip)
    assert (tls.identity, tls.cert_file) == ("worker/sec/decode-0", str(tmp_path / "pki/etcd-workers/decode-0.pem"))
    with pytest.raises(ValueError, match=r"worker decode-1 has no etcd identity.*etcd.tls.workers.slots"):
        cfg.etcd_tls_for("decode-1")
    with pytest.raises(ValueError, match=r"--topology .*worker prefill-9 has no etcd identity"):
        from pdserve.worker_cmd import plan

        plan(argparse.Namespace(topology=str(tmp_path / "t.yaml"), role="prefill", worker_id="prefill-9", etcd=None,
                                ray_address=None, model=None, drain_timeout=10.0))
    # Both listed: ids without a certificate of their own fall back to the shared identity.
    both, _ = per_worker_topology(tmp_path / "both", extra="    worker: {cert: pki/etcd-worker.pem, "
                                                           "key: pki/etcd-worker-key.pem}\n")
    assert both.worker_etcd_tls("prefill-0").identity == "worker/sec/prefill-0"
    assert both.worker_etcd_tls("prefill-pod-x7").identity == "worker"


def test_the_planner_reuses_free_ids_within_the_slots_and_names_the_setting_when_none_is_left():
    from pdserve.cluster.planner.act import NoWorkerSlot
    from pdserve.cluster.planner.core import Planner
    from pdserve.cluster.planner.decide import Decision
    from pdserve.cluster.planner.observe import Snapshot

    class Backend:
        calls: list = []

        def actor_name(self, wid):
            return f"c-{wid}"

        async def start(self, role, wid, flexible=False):
            self.calls.append(wid)

    planner = Planner(cluster="c", etcd_endpoints=["127.0.0.1:1"], policy=None, backend=Backend(),
                      queue_stats=None, units={}, known_workers=["prefill-0", "prefill-1"], worker_slots={"prefill": 3})
    snap = Snapshot(t=0.0, queue=None, workers={"prefill-2": {"role": "prefill"}})
    planner.state.stopped = ["prefill-0"]  # the planner drained and stopped it: its id is free again
    assert planner._next_worker_id("prefill", snap) == "prefill-0"
    planner.state.actor_of["decode-0"] = "c-prefill-0"  # prefill-0's process serves as decode-0 now
    with pytest.raises(NoWorkerSlot, match=r"all 3 prefill worker ids.*raise etcd.tls.workers.slots.prefill"):
        planner._next_worker_id("prefill", snap)
    up = Decision(role="prefill", mode="threshold", current=2, desired=3, action="up", reason="threshold_up",
                  explanation=[], figures={}, at=0.0)
    asyncio.run(planner.act(up, snap))
    assert Backend.calls == [] and "etcd.tls.workers.slots.prefill" in planner.log[-1]
