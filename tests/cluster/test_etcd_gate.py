"""The etcd gate (cluster/etcd_gate.py) in front of a real TLS + RBAC etcd: a worker does its
whole part through it (register, keep alive, update, watch, leave) with the certificate of
its own id, and with that certificate tries every operation on others' objects: every one is
refused, through the gate and directly against etcd (which grants gated workers nothing).
Without the gate, etcd itself lets any identity keep alive or inspect another's lease and
compact the store (tests/cluster/test_etcd_security.py measures that)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from aetcd import rpc

from pdserve.cluster.etcd_auth import ClusterAccess, EtcdAccessDenied, bootstrap_rbac
from pdserve.cluster.etcd_gate_policy import GatePolicy, _within
from pdserve.cluster.etcd_gate_server import EtcdGate
from pdserve.cluster.keys import Keyspace
from pdserve.cluster.registry import Registry
from tests.cluster.test_etcd_security import FAST, POLICY, SLOTS, TTL_S, launcher_topology, worker, worker_certs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def gated(secure_etcd, cluster_name, tmp_path):
    """This test's cluster in gate mode (worker users without grants) and a gate in front."""
    await bootstrap_rbac(secure_etcd.endpoint, secure_etcd.identity("root"),
                         [ClusterAccess(cluster_name, SLOTS, shared_worker=False, gated=True)])
    own = worker_certs(secure_etcd, cluster_name, [wid for _, wid in SLOTS], tmp_path / "pki")
    c = secure_etcd.certs
    gate = await EtcdGate(GatePolicy(cluster_name, SLOTS), secure_etcd.endpoint, secure_etcd.identity("operator"),
                          server_cert=str(c["etcd"]), server_key=str(c["etcd-key"]), ca_file=str(c["ca"])).start()
    try:
        yield gate, own
    finally:
        await gate.stop(0)


def through(gate: EtcdGate, own, worker_id: str) -> Registry:
    return Registry(gate.endpoint, own.cluster, ttl_s=TTL_S, tls=own.tls(worker_id), **FAST)


def stubs(endpoint: str, tls) -> tuple[grpc.aio.Channel, rpc.KVStub, rpc.LeaseStub, rpc.WatchStub]:
    channel = grpc.aio.secure_channel(endpoint, tls.credentials())
    return channel, rpc.KVStub(channel), rpc.LeaseStub(channel), rpc.WatchStub(channel)


async def denied(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert "permission denied" in err.value.details()
    return err.value.details()


async def test_a_worker_does_its_whole_part_through_the_gate(secure_etcd, gated):
    gate, own = gated
    async with through(gate, own, "prefill-0") as p0, through(gate, own, "decode-0") as d0:
        seen = []
        await d0.watch_members(on_add=lambda info: seen.append(info.worker_id), role="prefill")
        await p0.register(worker("prefill-0"), nixl_metadata=b"p0-agent")
        await d0.register(worker("decode-0", role="decode"))
        assert set(await d0.members()) == {"prefill-0", "decode-0"}
        assert await d0.get_nixl_metadata("prefill-0") == b"p0-agent"
        await asyncio.sleep(TTL_S * 1.5)  # the lease is kept alive through the gate
        assert (await p0.member("prefill", "prefill-0")) is not None
        for _ in range(100):
            if "prefill-0" in seen:
                break
            await asyncio.sleep(0.05)
        assert "prefill-0" in seen
        await p0.deregister()
        assert (await d0.member("prefill", "prefill-0")) is None


async def test_a_workers_certificate_can_touch_no_other_workers_lease_or_key(secure_etcd, gated):
    """decode-0's certificate against prefill-0's lease and keys, through the gate: keep-alive,
    time-to-live, revoke, attaching it to a put or a transaction, writing or deleting its key,
    listing leases, compaction, reading or watching outside the cluster: all refused, and
    prefill-0 stays registered. Directly against etcd the same certificate gets nothing."""
    gate, own = gated
    keys = Keyspace(own.cluster)
    async with through(gate, own, "prefill-0") as p0:
        await p0.register(worker("prefill-0"), nixl_metadata=b"p0")
        lease = p0.lease_id
        assert lease
        channel, kv, leases, watch = stubs(gate.endpoint, own.tls("decode-0"))
        try:
            mine = (await leases.LeaseGrant(rpc.LeaseGrantRequest(TTL=5))).ID  # its own: allowed
            stream = leases.LeaseKeepAlive()
            await stream.write(rpc.LeaseKeepAliveRequest(ID=mine))
            assert (await stream.read()).TTL > 0
            await stream.write(rpc.LeaseKeepAliveRequest(ID=lease))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            theirs = keys.worker("prefill", "prefill-0")
            mine_key = keys.worker("decode", "decode-0")
            await denied(leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease, keys=True)))
            await denied(leases.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease)))
            await denied(leases.LeaseLeases(rpc.LeaseLeasesRequest()))
            await denied(kv.Compact(rpc.CompactionRequest(revision=1)))
            await denied(kv.Put(rpc.PutRequest(key=mine_key, value=b"{}", lease=lease)))
            await denied(kv.Put(rpc.PutRequest(key=theirs, value=b"{}")))
            await denied(kv.DeleteRange(rpc.DeleteRangeRequest(key=theirs)))
            await denied(kv.DeleteRange(rpc.DeleteRangeRequest(key=keys.prefix(), range_end=b"\x00")))
            await denied(kv.Range(rpc.RangeRequest(key=b"/", range_end=b"\x00")))
            txn = rpc.TxnRequest(success=[rpc.RequestOp(request_put=rpc.PutRequest(key=mine_key, lease=lease))])
            await denied(kv.Txn(txn))
            nested = rpc.TxnRequest(success=[rpc.RequestOp(request_txn=rpc.TxnRequest(
                success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=theirs))]))])
            await denied(kv.Txn(nested))
            w = watch.Watch()
            await w.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(key=b"/", range_end=b"\x00")))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await w.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # What it may do: read the cluster, write its own record with its own lease.
            await kv.Put(rpc.PutRequest(key=mine_key, value=b"{}", lease=mine))
            assert (await kv.Range(rpc.RangeRequest(key=theirs))).count == 1
        finally:
            await channel.close()
        # Directly against etcd, a gated worker's certificate reads and writes nothing.
        channel, kv, leases, _ = stubs(secure_etcd.endpoint, own.tls("decode-0"))
        try:
            await denied(kv.Range(rpc.RangeRequest(key=theirs)))
            await denied(kv.Put(rpc.PutRequest(key=keys.worker("decode", "decode-0"), value=b"{}")))
        finally:
            await channel.close()
        # A certificate of the CA that names no worker of the cluster gets nothing from the gate.
        channel, kv, _, _ = stubs(gate.endpoint, secure_etcd.identity("client", cert="client"))
        try:
            await denied(kv.Range(rpc.RangeRequest(key=theirs)))
        finally:
            await channel.close()
        await asyncio.sleep(TTL_S * 1.2)
        assert (await p0.member("prefill", "prefill-0")) is not None  # its lease untouched, still kept alive
        assert gate.refused >= 14


async def test_a_restarted_gate_knows_its_workers_leases_by_their_keys(secure_etcd, gated):
    gate, own = gated
    async with through(gate, own, "prefill-0") as p0:
        await p0.register(worker("prefill-0"))
        lease = p0.lease_id
        c = secure_etcd.certs
        fresh = await EtcdGate(GatePolicy(own.cluster, SLOTS), secure_etcd.endpoint,
                               secure_etcd.identity("operator"), server_cert=str(c["etcd"]),
                               server_key=str(c["etcd-key"]), ca_file=str(c["ca"])).start()
        try:
            for owner, other in (("prefill-0", "prefill-1"),):
                channel, _, leases, _ = stubs(fresh.endpoint, own.tls(owner))
                try:
                    assert (await leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease))).TTL > 0
                finally:
                    await channel.close()
                channel, _, leases, _ = stubs(fresh.endpoint, own.tls(other))
                try:
                    await denied(leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease)))
                finally:
                    await channel.close()
        finally:
            await fresh.stop(0)


def test_grant_ranges():
    g_exact = ("READWRITE", b"/p/c/workers/prefill/prefill-1", b"")
    g_prefix = ("READ", b"/p/c/", b"/p/c0")
    assert _within(b"/p/c/workers/prefill/prefill-1", b"", g_exact)
    assert not _within(b"/p/c/workers/prefill/prefill-10", b"", g_exact)
    assert not _within(b"/p/c/workers/prefill/prefill-1", b"/p/c/workers/prefill/prefill-2", g_exact)
    assert _within(b"/p/c/x", b"", g_prefix) and _within(b"/p/c/", b"/p/c0", g_prefix)
    assert not _within(b"/p/c/", b"\x00", g_prefix) and not _within(b"/p/", b"/p/c0", g_prefix)
    assert not _within(b"/p/c/", b"/p/d", g_prefix)


async def test_with_the_gate_off_the_bootstrap_still_grants_workers(secure_etcd, cluster_name, tmp_path):
    """Gate mode is a bootstrap choice: the same cluster bootstrapped without it grants each
    worker its keys again (and with it, revokes them)."""
    own = worker_certs(secure_etcd, cluster_name, [wid for _, wid in SLOTS], tmp_path / "pki")
    root = secure_etcd.identity("root")
    for gated_mode in (False, True, False):
        await bootstrap_rbac(secure_etcd.endpoint, root,
                             [ClusterAccess(cluster_name, SLOTS, shared_worker=False, gated=gated_mode)])
        reg = Registry(secure_etcd.endpoint, cluster_name, ttl_s=TTL_S, tls=own.tls("prefill-0"), **FAST)
        try:
            if gated_mode:
                with pytest.raises((EtcdAccessDenied, Exception), match="permission denied"):
                    await reg.register(worker("prefill-0"))
            else:
                await reg.register(worker("prefill-0"))
                await reg.deregister()
        finally:
            await reg.close()


def test_pdserve_up_starts_the_gate_beside_its_etcd_and_workers_get_its_endpoint(secure_etcd, tmp_path):
    """The launcher's etcd step with `etcd.gate`: etcd, its RBAC with the workers' users
    granted nothing, and the gate; a worker registers through the gate's endpoint, the same
    certificate gets nothing from etcd directly, and the operator still reaches etcd."""
    from pdserve.launcher import Launcher
    from pdserve.processes import terminate_group

    topo, state = launcher_topology(secure_etcd, tmp_path, "gated", ["prefill-0", "decode-0"], "gate: {}")
    lines = []
    launcher = Launcher(topo, str(tmp_path / "t.yaml"), "m", progress=lines.append)
    try:
        launcher._start_etcd(state, tmp_path / "runs")
        assert state.gate_endpoints and state.worker_etcd_endpoints == state.gate_endpoints
        assert state.gate_endpoints != state.etcd_endpoints and "etcd gate started" in lines[-1]

        async def attempts():
            tls = topo.worker_etcd_tls("prefill-0")
            async with Registry(state.worker_etcd_endpoints, "gated", tls=tls, **FAST) as via_gate, \
                    Registry(state.etcd_endpoints, "gated", tls=tls, **FAST) as direct, \
                    Registry(state.etcd_endpoints, "gated", tls=topo.etcd_tls("operator"), **FAST) as op:
                await via_gate.register(worker("prefill-0"))
                assert "prefill-0" in await op.members()
                with pytest.raises(Exception, match="permission denied"):
                    await direct.members()
                assert await op.request_drain("prefill-0")

        asyncio.run(attempts())
    finally:
        if state.gate_pid:
            terminate_group(state.gate_pid, "etcd gate", lambda line: None)
        if state.etcd_pid:
            terminate_group(state.etcd_pid, "etcd", lambda line: None, own_group=False)


def test_a_gate_without_what_it_needs_is_refused_naming_the_setting(tmp_path):
    from pdserve.cluster.topology import TopologyError, load_topology

    (tmp_path / "t.yaml").write_text("cluster: c\nmodel: {path: auto}\nroles: {prefill: {replicas: 1}, "
                                     "decode: {replicas: 1}}\netcd: {gate: {}}\n")
    with pytest.raises(TopologyError, match="gate needs tls"):
        load_topology(tmp_path / "t.yaml")


async def test_a_worker_behind_the_gate_outlives_an_etcd_restart(secure_etcd, gated):
    """etcd stops for 2 s (its data kept, so the lease may survive or expire): the worker's
    keep-alive and watch go through the gate's reconnecting channel and it stays, or is
    again, registered, with a lease the gate still lets it keep alive."""
    gate, own = gated
    async with through(gate, own, "decode-0") as d0, through(gate, own, "prefill-0") as p0:
        await d0.register(worker("decode-0", role="decode"))
        seen = []
        await p0.watch_members(on_add=lambda info: seen.append(info.worker_id), role="decode")
        secure_etcd.server.stop()
        await asyncio.sleep(2.0)
        await asyncio.to_thread(secure_etcd.server.start)
        for _ in range(300):
            if d0.state.name == "REGISTERED" and await _registered(p0, "decode-0"):
                break
            await asyncio.sleep(0.05)
        assert d0.state.name == "REGISTERED" and await _registered(p0, "decode-0")
        await asyncio.sleep(TTL_S * 1.5)  # kept alive through the gate after the restart
        assert await _registered(p0, "decode-0")
        assert "decode-0" in seen


async def _registered(reg: Registry, worker_id: str) -> bool:
    try:
        return (await reg.member("decode", worker_id)) is not None
    except Exception:  # noqa: BLE001  (etcd still coming back)
        return False


# -- the reader identity (gateways, the KV index) -------------------------------------------------
async def test_without_the_gate_the_reader_keeps_any_workers_lease_alive(secure_etcd, cluster_name, tmp_path):
    """Why the reader goes through the gate too: directly against etcd, the read-only identity a
    gateway holds keeps a worker's lease alive (etcd's RBAC covers keys, not leases), and could
    so keep a hung worker registered."""
    await bootstrap_rbac(secure_etcd.endpoint, secure_etcd.identity("root"),
                         [ClusterAccess(cluster_name, SLOTS, shared_worker=False)])
    own = worker_certs(secure_etcd, cluster_name, [wid for _, wid in SLOTS], tmp_path / "pki")
    async with Registry(secure_etcd.endpoint, cluster_name, ttl_s=TTL_S, tls=own.tls("prefill-0"), **FAST) as p0:
        await p0.register(worker("prefill-0"))
        channel, _, leases, _ = stubs(secure_etcd.endpoint, secure_etcd.identity("reader"))
        try:
            stream = leases.LeaseKeepAlive()
            await stream.write(rpc.LeaseKeepAliveRequest(ID=p0.lease_id))
            assert (await stream.read()).TTL > 0  # renewed for the reader
        finally:
            await channel.close()


async def test_through_the_gate_the_reader_follows_the_cluster_and_touches_no_lease_or_key(secure_etcd, gated):
    """The reader's certificate through the gate: it lists and watches the members and follows a
    policy, as a gateway does; keep-alive, time-to-live and revoke of prefill-0's lease, a lease
    of its own, lease listing, compaction, any write (a worker record, a policy, a drain) and a
    read outside the cluster are refused, and prefill-0 stays registered under its lease.
    Directly against etcd, the gated cluster grants the reader nothing."""
    gate, own = gated
    keys = Keyspace(own.cluster)
    reader = secure_etcd.identity("reader")
    async with Registry(secure_etcd.endpoint, own.cluster, tls=secure_etcd.identity("operator"), **FAST) as op, \
            Registry(gate.endpoint, own.cluster, tls=reader, **FAST) as r, through(gate, own, "prefill-0") as p0:
        await op.put_policy("router", POLICY)
        members = await r.watch_members()
        await members.wait_synced(10)
        await p0.register(worker("prefill-0"), nixl_metadata=b"p0")
        lease = p0.lease_id
        await members.wait_for(lambda m: "prefill-0" in m, timeout_s=10)
        assert set(await r.members()) == {"prefill-0"} and await r.get_nixl_metadata("prefill-0") == b"p0"
        policy = await r.watch_policy("router", validate=str)
        await policy.wait_synced(10)
        assert policy.current == POLICY
        with pytest.raises(EtcdAccessDenied, match="permission denied"):
            await r.request_drain("prefill-0")

        channel, kv, leases, watch = stubs(gate.endpoint, reader)
        try:
            stream = leases.LeaseKeepAlive()
            await stream.write(rpc.LeaseKeepAliveRequest(ID=lease))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
            await denied(leases.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease)))
            await denied(leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease, keys=True)))
            assert "reader writes nothing" in await denied(leases.LeaseGrant(rpc.LeaseGrantRequest(TTL=5)))
            await denied(leases.LeaseLeases(rpc.LeaseLeasesRequest()))
            await denied(kv.Compact(rpc.CompactionRequest(revision=1)))
            for key in (keys.worker("prefill", "prefill-0"), keys.worker("prefill", "fake-p9"), keys.policy("router"),
                        keys.nixl("prefill-0")):
                await denied(kv.Put(rpc.PutRequest(key=key, value=b"x")))
            await denied(kv.DeleteRange(rpc.DeleteRangeRequest(key=keys.worker("prefill", "prefill-0"))))
            await denied(kv.Txn(rpc.TxnRequest(success=[rpc.RequestOp(
                request_put=rpc.PutRequest(key=keys.policy("router"), value=b"x"))])))
            await denied(kv.Range(rpc.RangeRequest(key=b"/", range_end=b"\x00")))
            w = watch.Watch()
            await w.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(key=b"/", range_end=b"\x00")))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await w.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            await channel.close()
        # Directly against etcd the gated cluster grants the reader no key.
        channel, kv, _, _ = stubs(secure_etcd.endpoint, reader)
        try:
            await denied(kv.Range(rpc.RangeRequest(key=keys.prefix(), range_end=keys.prefix()[:-1] + b"0")))
        finally:
            await channel.close()
        assert (await op.member("prefill", "prefill-0")) is not None and p0.lease_id == lease
        assert await op.get_policy("router") == POLICY


async def test_the_gated_bootstrap_takes_the_readers_grant_and_gives_it_back_without_the_gate(
        secure_etcd, cluster_name):
    """Gate mode revokes the reader role's grant on the cluster (the reader reads through the
    gate); bootstrapped without it again, the reader reads etcd directly again."""
    root, keys = secure_etcd.identity("root"), Keyspace(cluster_name)
    for gated_mode in (False, True, False):
        await bootstrap_rbac(secure_etcd.endpoint, root, [ClusterAccess(cluster_name, SLOTS, gated=gated_mode)])
        channel, kv, _, _ = stubs(secure_etcd.endpoint, secure_etcd.identity("reader"))
        try:
            read = kv.Range(rpc.RangeRequest(key=keys.prefix(), range_end=keys.prefix()[:-1] + b"0"))
            if gated_mode:
                await denied(read)
            else:
                assert (await read).count == 0
        finally:
            await channel.close()


async def test_directly_against_etcd_any_certificate_of_the_ca_still_renews_any_lease(secure_etcd, gated):
    """etcd's own limit, which the gate cannot lift: etcd 3.5 renews any lease for any client
    certificate its CA signed (a gated reader's, one naming no etcd user), without a grant. So
    the gate scopes leases only where workers and readers cannot reach etcd's client port
    themselves (the Helm chart's NetworkPolicy with etcd.gate.enabled; docs/security.md). If
    this starts failing, etcd has closed the hole: say so in docs/security.md."""
    gate, own = gated
    async with through(gate, own, "prefill-0") as p0:
        await p0.register(worker("prefill-0"))
        for cert in (secure_etcd.identity("reader"), secure_etcd.identity("client", cert="client")):
            channel, _, leases, _ = stubs(secure_etcd.endpoint, cert)
            try:
                stream = leases.LeaseKeepAlive()
                await stream.write(rpc.LeaseKeepAliveRequest(ID=p0.lease_id))
                assert (await stream.read()).TTL > 0
            finally:
                await channel.close()


def test_pdserve_up_gives_gateways_and_the_kv_index_the_gates_endpoint(secure_etcd, tmp_path, capsys):
    """With etcd.gate a gateway or the KV index, which connect as `reader`, get the gate's
    endpoint from `up` (its actors' configs) and from the state file (`pdserve kv index` run by
    hand); as the operator (a topology without etcd.tls.reader) they keep etcd's."""
    import textwrap

    from pdserve.cli import main
    from pdserve.cluster.topology import load_topology
    from pdserve.gateway.actor import gateway_config
    from pdserve.launcher import Launcher, state_path

    c = secure_etcd.certs
    topo, state = launcher_topology(secure_etcd, tmp_path, "followers", ["prefill-0", "decode-0"], "gate: {}")
    text = (tmp_path / "t.yaml").read_text() + textwrap.indent(
        f"reader: {{cert: {c['etcd-reader']}, key: {c['etcd-reader-key']}}}\n", "    ")
    (tmp_path / "t.yaml").write_text(text)
    topo = load_topology(tmp_path / "t.yaml")
    state.etcd_endpoints, state.gate_endpoints = ["127.0.0.1:2379"], ["127.0.0.1:2389"]
    launcher = Launcher(topo, str(tmp_path / "t.yaml"), "m")
    endpoints = launcher._follower_etcd_endpoints(state)
    assert endpoints == ["127.0.0.1:2389"]
    cfg = gateway_config(topo, 0, "m", endpoints)
    assert cfg["etcd_endpoints"] == ["127.0.0.1:2389"] and cfg["etcd_tls"]["identity"] == "reader"
    state.save(state_path(topo))
    assert main(["kv", "index", "--topology", str(tmp_path / "t.yaml"), "--check"]) == 0
    out = capsys.readouterr().out
    assert "etcd 127.0.0.1:2389, etcd identity reader" in out, out
    operator_only = Launcher(load_topology(tmp_path / "t.yaml"), str(tmp_path / "t.yaml"), "m")
    (tmp_path / "t.yaml").write_text(text.replace("reader:", "# reader:"))
    operator_only.topo = load_topology(tmp_path / "t.yaml")
    assert operator_only._follower_etcd_endpoints(state) == ["127.0.0.1:2379"]


def test_a_gate_you_run_is_named_by_gate_endpoints_and_gates_the_bootstrap(secure_etcd, cluster_name, tmp_path,
                                                                             capsys):
    """With etcd.endpoints (an etcd you run, the Helm chart's) the gate is yours too: the topology
    names it (`etcd.gate.endpoints`), `up` hands it to the workers without starting one, and
    `pdserve etcd-auth` bootstraps gated: the reader then reads nothing in etcd directly."""
    import textwrap
    from pathlib import Path

    from pdserve.cli import main
    from pdserve.cluster.topology import TopologyError, load_topology
    from pdserve.launcher import ClusterState, Launcher

    c = secure_etcd.certs

    def topology(gate: str) -> str:
        (tmp_path / "t.yaml").write_text(textwrap.dedent(f"""\
            cluster: {cluster_name}
            model: {{path: auto}}
            roles: {{prefill: {{replicas: 1}}, decode: {{replicas: 1}}}}
            etcd:
              endpoints: [{secure_etcd.endpoint}]
              {gate}
              tls:
                ca: {c['ca']}
                server: {{cert: {c['etcd']}, key: {c['etcd-key']}}}
                root: {{cert: {c['etcd-root']}, key: {c['etcd-root-key']}}}
                operator: {{cert: {c['etcd-operator']}, key: {c['etcd-operator-key']}}}
                worker: {{cert: {c['etcd-worker']}, key: {c['etcd-worker-key']}}}
            """))
        return str(tmp_path / "t.yaml")

    with pytest.raises(TopologyError, match="set gate.endpoints to where it listens"):
        load_topology(topology("gate: {}"))
    with pytest.raises(TopologyError, match="gate.port: only for the gate `pdserve up` starts"):
        load_topology(topology("gate: {port: 2389, endpoints: ['gate.infra:2389']}"))
    path = topology("gate: {endpoints: ['gate.infra:2389']}")
    topo = load_topology(path)
    state = ClusterState(cluster=cluster_name, topology=path, namespace="x", ray_address="", ray_head_pid=None,
                         etcd_endpoints=list(topo.etcd.endpoints), etcd_pid=None, queue_name="q", model="m")
    Launcher(topo, path, "m", progress=lambda line: None)._start_etcd(state, tmp_path)
    assert state.worker_etcd_endpoints == ["gate.infra:2389"] and state.gate_pid is None
    assert main(["etcd-auth", "--topology", path]) == 0
    assert f"gated: the workers' users and reader get no grants in cluster {cluster_name}" in capsys.readouterr().out

    async def read_directly():
        channel, kv, _, _ = stubs(secure_etcd.endpoint, secure_etcd.identity("reader"))
        try:
            prefix = Keyspace(cluster_name).prefix()
            await denied(kv.Range(rpc.RangeRequest(key=prefix, range_end=prefix[:-1] + b"0")))
        finally:
            await channel.close()

    asyncio.run(read_directly())
    # An embedded etcd: `up` starts the gate itself, so naming one is refused.
    (tmp_path / "t.yaml").write_text(Path(path).read_text().replace(f"  endpoints: [{secure_etcd.endpoint}]\n", ""))
    with pytest.raises(TopologyError, match="gate.endpoints: `pdserve up` starts the gate beside the etcd it embeds"):
        load_topology(tmp_path / "t.yaml")
