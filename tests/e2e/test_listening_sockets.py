"""Every listening socket of a running, fully secured cluster belongs to a surface that `pdserve
status` lists (pdserve/protection.py; docs/security.md, "Every listening socket"), and every
listener of a surface listed as protected refuses a client without credentials, for real.

`pdserve up` starts a 1P1D cluster with a planner, everything on loopback and every setting on:
TLS with client certificates and API keys on the decode worker, the embedded etcd with TLS and
one identity per worker, `queue.tls` and `ray.auth: token`. The test finds the cluster's
processes (the process trees of the pids in `up`'s state file: etcd, the Ray head, and the etcd
gate where there is one; and any process naming the Ray session's directory), lists every TCP
listener and unconnected UDP socket they own, and classifies each one by its owner and the
ports the cluster publishes: the state file, `pdserve status --json` (the workers' etcd records,
and the surfaces themselves), Ray's node and worker tables, the queue actor, the planner's
leader record and the workers' NIXL metadata.
A listener that belongs to no surface of the list fails the test: a port nobody listed is a
finding. Then each listener is probed: those of protected surfaces must refuse a client
without credentials (plaintext, TLS without a client certificate, no API key, no token, no
Ray token), with a positive control where the probe could otherwise fail for a wrong reason;
those of open surfaces must indeed be open (what `status` says must be true).

Ray binds its own listeners on every interface (or the node's address) whatever the topology's
`network.bind` says: those are reported with their address; the probes only connect to
loopback (a listener bound to a non-loopback address only is classified, not probed).
"""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import json
import os
import secrets
import socket
import ssl
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from pdserve.certs import make_certs
from pdserve.cluster.security import key_line
from pdserve.cluster.topology import load_topology
from pdserve.protection import NO, YES, surfaces
from pdserve.cluster.queue.frames import WIRE_VERSION, pack_frame
from tests.harness import small_topology_yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER = "sockets"
WORKERS = ("prefill-0", "decode-0")
PROBE_TIMEOUT_S = 10.0

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

# min = max = 1: the planner runs (and listens) but never starts or stops a worker.
POLICY = """\
autoscale:
  prefill: {min_replicas: 1, max_replicas: 1, scale_up: {queue_length: 1000}, scale_down: {queue_length: 0}}
  decode: {min_replicas: 1, max_replicas: 1, scale_up: {queue_length: 1000}, scale_down: {queue_length: 0}}
"""

SECURITY = """\
autoscale_policy: autoscale.yaml
etcd:
  lease_ttl_s: 3
  gate: {}
  tls:
    ca: pki/ca.pem
    server: {cert: pki/etcd.pem, key: pki/etcd-key.pem}
    root: {cert: pki/etcd-root.pem, key: pki/etcd-root-key.pem}
    operator: {cert: pki/etcd-operator.pem, key: pki/etcd-operator-key.pem}
    workers: {dir: pki/etcd-workers}
security:
  tls: {cert: pki/decode.pem, key: pki/decode-key.pem, client_ca: pki/ca.pem}
  api_keys: {file: keys.txt}
queue:
  tls: {cert: pki/queue.pem, key: pki/queue-key.pem, ca: pki/ca.pem}
ray: {auth: token, token_file: ray-token}
"""

# What the test reads from Ray and etcd, as a driver holding the Ray token and the operator's
# etcd identity (a subprocess: Ray's and the token's settings stay out of the test process).
FACTS = textwrap.dedent("""
    import asyncio, json, sys
    import ray
    from pdserve.cluster.planner.actor import planner_actor_name
    from pdserve.ray_auth import apply_ray_auth
    from pdserve.cluster.registry import Registry
    from pdserve.cluster.topology import load_topology

    topo, state = load_topology(sys.argv[1]), json.loads(open(sys.argv[2]).read())
    apply_ray_auth(topo)
    ray.init(address=state["ray_address"], namespace=state["namespace"], log_to_driver=False)
    try:
        from ray._private import state as ray_state
        from ray.core.generated import gcs_pb2
        from ray.experimental import internal_kv

        node = [n for n in ray.nodes() if n["Alive"]]
        # Ray's worker table (every worker and driver with its core-worker port): a private API,
        # the only one without the dashboard, which pdserve does not start.
        table = ray_state.state._global_state_accessor.get_worker_table()
        workers = [gcs_pb2.WorkerTableData.FromString(b) for b in table]
        actors = {a["Name"] or a["ActorID"]: {"pid": a["Pid"], "port": a["Address"]["Port"]}
                  for a in ray_state.actors().values() if a["State"] == "ALIVE"}
        queue = ray.get_actor(state["queue_name"], namespace=state["namespace"])
        wire = ray.get(queue.wire_endpoint.remote(), timeout=60)
        stats = ray.get(queue.stats.remote(), timeout=60)
        autoscaler = internal_kv._internal_kv_get(b"AutoscalerMetricsAddress")
        session_dir = ray._private.worker._global_node.get_session_dir_path()
    finally:
        ray.shutdown()

    async def etcd():
        async with Registry(state["etcd_endpoints"], state["cluster"], tls=topo.etcd_tls("operator")) as reg:
            leader = await reg.client().get(reg.keys.planner_leader())
            nixl = {w: await reg.get_nixl_metadata(w) for w in sys.argv[3:]}
        return (json.loads(leader.value) if leader else None), nixl

    leader, nixl = asyncio.run(etcd())
    print(json.dumps({
        "session_dir": session_dir, "nodes": node,
        "workers": [{"pid": w.pid, "port": w.worker_address.port} for w in workers if w.is_alive],
        "actors": actors, "queue_actor": state["queue_name"], "wire": wire, "queue_metrics": stats.metrics,
        "autoscaler_metrics": autoscaler.decode() if autoscaler else None,
        "planner": leader, "planner_actor": planner_actor_name(state["cluster"]),
        "nixl": {w: (json.loads(v)["nixl_metadata"] if v else None) for w, v in nixl.items()},
    }, default=str))
""")


def pdserve(*args, timeout=300):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib"}
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


# -- the cluster --------------------------------------------------------------------------
@dataclasses.dataclass
class Cluster:
    topology: Path
    pki: Path
    api_key: str
    ray_token: str
    state: dict


@pytest.fixture
def secured_cluster(tmp_path):
    pki = tmp_path / "pki"
    make_certs(pki, cluster=CLUSTER, worker_ids=list(WORKERS))
    api_key, ray_token = secrets.token_hex(16), secrets.token_hex(32)
    (tmp_path / "keys.txt").write_text(key_line(api_key) + "\n")
    (tmp_path / "ray-token").write_text(ray_token + "\n")
    (tmp_path / "ray-token").chmod(0o600)
    (tmp_path / "autoscale.yaml").write_text(POLICY)
    topology = tmp_path / "topology.yaml"
    topology.write_text(small_topology_yaml(CLUSTER, tmp_path).replace("etcd: {lease_ttl_s: 3}\n", "") + SECURITY)
    state_file = tmp_path / "runs" / f"{CLUSTER}.state.json"
    started: dict[int, psutil.Process] = {}
    try:
        up = pdserve("up", "--topology", str(topology))
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        state = json.loads(state_file.read_text())
        started.update(process_trees(*roots(state)))
        yield Cluster(topology, pki, api_key, ray_token, state)
    finally:
        down = None
        try:
            if state_file.exists():
                down = pdserve("down", "--topology", str(topology), timeout=120)
        except subprocess.TimeoutExpired as exc:
            down = exc
        finally:
            # Whatever `down` left (or `up` left without a state file): this cluster's processes only.
            leftovers = stop_leftovers(started, tmp_path)
    assert not isinstance(down, subprocess.TimeoutExpired), f"`pdserve down` did not finish: {down}"
    assert down is None or down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    assert not leftovers, f"still running after `pdserve down` (killed now): {leftovers}"


def process_trees(*roots: int | None) -> dict[int, psutil.Process]:
    out = {}
    for pid in roots:
        if pid is None:
            continue
        try:
            root = psutil.Process(pid)
            out[pid] = root
            out.update({c.pid: c for c in root.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return out


def stop_leftovers(started: dict[int, psutil.Process], tmp_path: Path, wait_s: float = 30.0) -> list[str]:
    """Kill what is left of the cluster: the processes recorded after `up` (same pid and start
    time: psutil checks), and any process naming this test's directory or holding a file in it
    (the etcd, the Ray head, when `up` failed before it wrote its state file)."""
    mine = dict(started)
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            if str(tmp_path) in " ".join(p.info["cmdline"] or []) or \
                    any(f.path.startswith(str(tmp_path)) for f in p.open_files()):
                mine[p.pid] = p
                mine.update({c.pid: c for c in p.children(recursive=True)})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    deadline = time.monotonic() + wait_s
    alive = [p for p in mine.values() if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _running(p)]
    left = []
    for p in alive:
        try:
            left.append(f"{p.pid} {p.name()}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return left


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- the listeners --------------------------------------------------------------------------
@dataclasses.dataclass
class Listener:
    pid: int
    process: str
    proto: str  # tcp | udp
    ip: str
    port: int
    surface: str | None = None
    what: str = ""
    ours: bool = False  # served by pdserve (bound to network.bind), not by Ray itself
    probe: str = ""

    @property
    def loopback(self) -> bool:
        return _ip(self.ip).is_loopback

    @property
    def host(self) -> str | None:
        """Where a probe reaches it on this host (loopback only), None: not from loopback."""
        ip = _ip(self.ip)
        return "127.0.0.1" if ip.is_loopback or ip.is_unspecified else None

    def row(self) -> str:
        where = "loopback" if self.loopback else ("all interfaces" if _ip(self.ip).is_unspecified else "non-loopback")
        return (f"{self.process[:22]:<22} pid {self.pid:<7} {self.proto} {self.ip:>18}:{self.port:<5} ({where:<14}) "
                f"{self.surface or 'UNLISTED':<26} {self.what}{'  | ' + self.probe if self.probe else ''}")


def _ip(text: str):
    ip = ipaddress.ip_address(text.split("%")[0])
    return (ip.ipv4_mapped or ip) if ip.version == 6 else ip


def roots(state: dict) -> list[int | None]:
    """The processes `up` starts itself (each a process tree): the Ray head, the embedded etcd
    and the etcd gate (etcd.gate)."""
    return [state["ray_head_pid"], state["etcd_pid"], state.get("gate_pid")]


def cluster_processes(state: dict, session_dir: str) -> dict[int, psutil.Process]:
    """The process trees `up` started, and any process of the Ray session that left its tree
    (re-parented): it names the session's directory in its command line."""
    procs = process_trees(*roots(state))
    for p in psutil.process_iter(["cmdline"]):
        try:
            if session_dir in " ".join(p.info["cmdline"] or []):
                procs.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            continue
    return procs


def listening_sockets(procs: dict[int, psutil.Process]) -> list[Listener]:
    out = []
    for pid, p in sorted(procs.items()):
        try:
            name = p.name()
            conns = p.net_connections(kind="inet") if hasattr(p, "net_connections") else p.connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for c in conns:
            tcp_listen = c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN
            udp_bound = c.type == socket.SOCK_DGRAM and not c.raddr
            if tcp_listen or udp_bound:
                out.append(Listener(pid, name, "tcp" if tcp_listen else "udp", c.laddr.ip, c.laddr.port))
    return out


def _port(address: str | None) -> int | None:
    return int(address.rpartition(":")[2]) if address else None


def _arg(cmdline: list[str], flag: str) -> str | None:
    for i, a in enumerate(cmdline):
        if a == flag and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def classify(sockets: list[Listener], procs, state: dict, status: dict, facts: dict) -> None:
    """Set each listener's surface (a name of `pdserve status`'s security list) and what it is,
    from its owner and the ports the cluster publishes; None when nothing explains it."""
    gcs_port = _port(state["ray_address"])
    node = facts["nodes"][0]
    ray_workers = {(w["pid"], w["port"]) for w in facts["workers"]}
    actor_of = {a["pid"]: name for name, a in facts["actors"].items()}
    queue_pid = facts["actors"][facts["queue_actor"]]["pid"]
    planner_pid = facts["actors"][facts["planner_actor"]]["pid"]
    # pdserve's workers: their etcd records (status) and NIXL metadata, by process.
    worker_of = {a["pid"]: a["worker_id"] for a in state["actors"]}
    for s in sockets:
        p = procs[s.pid]
        try:
            cmd, parent = p.cmdline(), p.ppid()
        except psutil.NoSuchProcess:
            cmd, parent = [], None
        line = " ".join(cmd)
        found: tuple[str, str, bool] | None = None
        if s.pid == state["etcd_pid"]:
            client = {_port(e) for e in state["etcd_endpoints"]}
            peer = _port(_arg(cmd, "--listen-peer-urls"))
            if s.port in client:
                found = ("etcd", "etcd client (state file)", True)
            elif s.port == peer:
                found = ("etcd", "etcd peer (--listen-peer-urls)", True)
        elif state.get("gate_pid") in (s.pid, parent) and s.port in {_port(e) for e in state["gate_endpoints"]}:
            # (the gate runs as the child of the supervisor whose pid the state file holds)
            found = ("etcd gate", "etcd gate (state file)", True)
        elif s.process == "gcs_server" and s.port == gcs_port:
            found = ("Ray", "Ray GCS (ray_address)", False)
        elif s.process == "raylet" and s.port == node["NodeManagerPort"]:
            found = ("Ray", "raylet node manager (NodeManagerPort)", False)
        elif s.process == "raylet" and s.port == node["ObjectManagerPort"]:
            found = ("Ray", "raylet object manager (ObjectManagerPort)", False)
        elif "RuntimeEnvAgent" in line and s.port == node["RuntimeEnvAgentPort"]:
            found = ("Ray", "runtime-env agent (RuntimeEnvAgentPort)", False)
        elif "ray.util.client.server" in line and str(s.port) == _arg(cmd, "--port"):
            found = ("Ray", "Ray client server (--port)", False)
        elif "autoscaler/_private/monitor.py" in line and s.port == _port(facts["autoscaler_metrics"]):
            found = ("Ray autoscaler /metrics", "autoscaler monitor (AutoscalerMetricsAddress)", False)
        elif (s.pid, s.port) in ray_workers:
            found = ("Ray", f"core worker of {actor_of.get(s.pid, 'a Ray worker')} (worker table)", False)
        elif s.pid == queue_pid and s.port == facts["wire"]["port"]:
            found = ("prefill queue wire", "queue wire (wire_endpoint)", True)
        elif s.pid == queue_pid and s.port == _port(facts["queue_metrics"]):
            found = ("queue /metrics", "queue metrics (stats().metrics)", True)
        elif s.pid == planner_pid and facts["planner"] and s.port == _port(facts["planner"]["metrics"]):
            found = ("planner /metrics", "planner metrics (planner/leader in etcd)", True)
        elif s.pid in worker_of:
            wid = worker_of[s.pid]
            endpoints = status["members"][wid]["endpoints"]
            named = [k for k, v in endpoints.items() if _port(v) == s.port]
            if named and named[0] in ("grpc", "http"):
                found = ("decode gRPC/HTTP", f"{wid} {named[0]} (etcd record)", True)
            elif named == ["metrics"]:
                found = ("prefill /metrics", f"{wid} metrics (etcd record)", True)
            elif named and named[0].startswith("ucx_"):
                # the UCX listeners of the NIXL agent's posting threads (network.kv_transport.threads)
                found = ("NIXL data plane (KV pages)", f"{wid} UCX listener of a posting thread (etcd record)", True)
            elif struct.pack(">H", s.port) in base64.b64decode(facts["nixl"][wid] or ""):
                # UCX's address in the worker's NIXL metadata carries its listener's port.
                found = ("NIXL data plane (KV pages)", f"{wid} UCX listener (NIXL metadata)", True)
        if found:
            s.surface, s.what, s.ours = found


# -- probes ---------------------------------------------------------------------------------
def raw_grpc(target: str, method: str, request: bytes = b"", creds=None, metadata=None):
    """The status code of one unary call with a raw (serialized) request."""
    channel = grpc.secure_channel(target, creds) if creds is not None else grpc.insecure_channel(target)
    with channel:
        call = channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            call(request, timeout=PROBE_TIMEOUT_S, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def _pb_bytes(field: int, value: bytes) -> bytes:
    assert len(value) < 128
    return bytes([(field << 3) | 2, len(value)]) + value


def _tls_context(c: Cluster, cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(c.pki / "ca.pem"))
    if cert:
        ctx.load_cert_chain(str(c.pki / f"{cert}.pem"), str(c.pki / f"{cert}-key.pem"))
    return ctx


def _grpc_creds(c: Cluster, cert: str | None = None):
    ca = (c.pki / "ca.pem").read_bytes()
    if cert is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    key, chain = (c.pki / f"{cert}-key.pem").read_bytes(), (c.pki / f"{cert}.pem").read_bytes()
    return grpc.ssl_channel_credentials(ca, key, chain)


def _exchange(host: str, port: int, data: bytes, ctx: ssl.SSLContext | None = None) -> bytes | Exception:
    """What the server answers `data` with (the bytes read until it closes, or 4 KiB), or the
    error that ended the exchange (a failed handshake, a reset)."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as raw:
            sock = ctx.wrap_socket(raw, server_hostname=host) if ctx is not None else raw
            with sock:
                sock.sendall(data)
                got = b""
                while len(got) < 4096:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                    if ctx is None or b"\r\n\r\n" in got or _frame(got) is not None:
                        break
                return got
    except (OSError, ssl.SSLError) as exc:
        return exc


def _frame(data: bytes):
    import msgpack

    if len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        return None
    try:
        return msgpack.unpackb(data[4:4 + int.from_bytes(data[:4], "big")], raw=False)
    except Exception:  # noqa: BLE001  (not a frame)
        return None


def refused(outcome) -> bool:
    """An exchange that got nothing a client could use: an error, or no answer."""
    return isinstance(outcome, Exception) or outcome == b""


def probe_ray(c: Cluster, s: Listener) -> str:
    target = f"{s.host}:{s.port}"
    method = {"Ray GCS": "/ray.rpc.NodeInfoGcsService/GetClusterId",
              "raylet node manager": "/ray.rpc.NodeManagerService/GetNodeStats",
              "raylet object manager": "/ray.rpc.ObjectManagerService/Pull",
              "Ray client server": "/ray.rpc.RayletDriver/ClusterInfo",
              "core worker": "/ray.rpc.CoreWorkerService/NumPendingTasks"}
    if s.what.startswith("runtime-env agent"):
        r = httpx.post(f"http://{target}/get_or_create_runtime_env", content=b"", timeout=PROBE_TIMEOUT_S)
        assert r.status_code == 401, (s.row(), r.status_code, r.text[:200])
        return "no Ray token: HTTP 401"
    name = next(m for prefix, m in method.items() if s.what.startswith(prefix))
    for metadata in (None, [("authorization", "Bearer " + "0" * 64)]):
        code = raw_grpc(target, name, metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (s.row(), metadata is not None, code)
    if s.what.startswith("Ray GCS"):  # the probe reaches the real thing: with the token it answers
        assert raw_grpc(target, name, metadata=[("authorization", "Bearer " + c.ray_token)]) == grpc.StatusCode.OK
        return "no/wrong Ray token: UNAUTHENTICATED; the token: OK"
    return "no/wrong Ray token: UNAUTHENTICATED"


def probe_etcd(c: Cluster, s: Listener) -> str:
    if s.what.startswith("etcd peer"):
        request = b"GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        plain = _exchange(s.host, s.port, request)
        assert refused(plain) or b"200 OK" not in plain, (s.row(), plain)
        bare = _exchange(s.host, s.port, request, _tls_context(c))
        assert refused(bare), (s.row(), bare)
        member = _exchange(s.host, s.port, request, _tls_context(c, "etcd"))
        assert not refused(member) and b"200 OK" in member and b"etcdserver" in member, (s.row(), member)
        return "plaintext: refused; TLS without a client certificate: refused; the CA's etcd certificate: 200"
    prefix = f"/pdserve/{CLUSTER}/".encode()
    request = _pb_bytes(1, prefix) + _pb_bytes(2, prefix[:-1] + b"0")
    target, method = f"{s.host}:{s.port}", "/etcdserverpb.KV/Range"
    assert raw_grpc(target, method, request) == grpc.StatusCode.UNAVAILABLE, s.row()
    assert raw_grpc(target, method, request, _grpc_creds(c)) == grpc.StatusCode.UNAVAILABLE, s.row()
    stranger = raw_grpc(target, method, request, _grpc_creds(c, "client"))  # from the CA, but no etcd user
    assert stranger != grpc.StatusCode.OK, (s.row(), stranger)
    assert raw_grpc(target, method, request, _grpc_creds(c, "etcd-operator")) == grpc.StatusCode.OK, s.row()
    return (f"plaintext / TLS without a client certificate: UNAVAILABLE; a CA certificate naming no etcd user: "
            f"{stranger.name}; the operator's: OK")


def probe_gate(c: Cluster, s: Listener) -> str:
    """The gate serves worker identities and the reader only: plaintext, no client certificate, a CA
    certificate naming no worker (the operator's included) get nothing; prefill-0's reads the
    cluster (and directly against etcd the same certificate gets nothing: gated)."""
    prefix = f"/pdserve/{CLUSTER}/".encode()
    request = _pb_bytes(1, prefix) + _pb_bytes(2, prefix[:-1] + b"0")
    target, method = f"{s.host}:{s.port}", "/etcdserverpb.KV/Range"
    assert raw_grpc(target, method, request) == grpc.StatusCode.UNAVAILABLE, s.row()
    assert raw_grpc(target, method, request, _grpc_creds(c)) == grpc.StatusCode.UNAVAILABLE, s.row()
    for stranger in ("client", "etcd-operator"):
        assert raw_grpc(target, method, request, _grpc_creds(c, stranger)) == grpc.StatusCode.PERMISSION_DENIED, \
            (s.row(), stranger)
    worker = "etcd-workers/prefill-0"
    assert raw_grpc(target, method, request, _grpc_creds(c, worker)) == grpc.StatusCode.OK, s.row()
    etcd = c.state["etcd_endpoints"][0]
    assert raw_grpc(etcd, method, request, _grpc_creds(c, worker)) == grpc.StatusCode.PERMISSION_DENIED, etcd
    return ("plaintext / TLS without a client certificate: UNAVAILABLE; a CA certificate naming no worker "
            "(the operator's too): PERMISSION_DENIED; a worker's: OK (and PERMISSION_DENIED directly at etcd)")


def probe_queue_wire(c: Cluster, s: Listener, token: str) -> str:
    hello = lambda t: pack_frame({"hello": t, "v": WIRE_VERSION})  # noqa: E731
    plain = _exchange(s.host, s.port, hello("0" * 32))
    assert refused(plain) or _frame(plain) is None, (s.row(), plain)
    wrong = _frame(_exchange(s.host, s.port, hello("0" * 32), _tls_context(c)) or b"")
    assert wrong is not None and wrong["ok"] is False and wrong["error"]["type"] == "PermissionError", (s.row(), wrong)
    right = _frame(_exchange(s.host, s.port, hello(token), _tls_context(c)) or b"")
    assert right is not None and right["ok"] is True, (s.row(), right)
    return "plaintext: no frame; TLS with a wrong token: PermissionError; the token: ok"


def probe_decode(c: Cluster, s: Listener) -> str:
    target = f"{s.host}:{s.port}"
    key = [("authorization", f"Bearer {c.api_key}")]
    if " grpc " in s.what:
        health, models = "/grpc.health.v1.Health/Check", "/pdserve.v1.Inference/ListModels"
        assert raw_grpc(target, health) == grpc.StatusCode.UNAVAILABLE, s.row()
        assert raw_grpc(target, models, creds=_grpc_creds(c)) == grpc.StatusCode.UNAVAILABLE, s.row()
        client = _grpc_creds(c, "client")
        assert raw_grpc(target, models, creds=client) == grpc.StatusCode.UNAUTHENTICATED, s.row()
        assert raw_grpc(target, health, creds=client) == grpc.StatusCode.OK, s.row()  # open_grpc_services
        assert raw_grpc(target, models, creds=client, metadata=key) == grpc.StatusCode.OK, s.row()
        return ("plaintext / TLS without a client certificate: UNAVAILABLE; client certificate without a key: "
                "UNAUTHENTICATED (health: served); with a key: OK")
    try:
        plain = httpx.get(f"http://{target}/health", timeout=PROBE_TIMEOUT_S).status_code
    except httpx.HTTPError as exc:
        plain = exc.__class__.__name__
    assert plain not in range(200, 300), (s.row(), plain)
    with pytest.raises((httpx.HTTPError, ssl.SSLError)):
        httpx.get(f"https://{target}/health", verify=_tls_context(c), timeout=PROBE_TIMEOUT_S)
    with httpx.Client(verify=_tls_context(c, "client"), timeout=PROBE_TIMEOUT_S) as client:
        assert client.get(f"https://{target}/v1/models").status_code == 401, s.row()
        assert client.get(f"https://{target}/health").status_code == 200, s.row()  # open_paths
        assert client.get(f"https://{target}/v1/models", headers=dict(key)).status_code == 200, s.row()
    return (f"plaintext: {plain}; TLS without a client certificate: refused; client certificate without a key: "
            "401 (/health: 200); with a key: 200")


def probe_open(s: Listener) -> str:
    """A surface listed as open must be: what `status` says is checked both ways."""
    if s.surface.endswith("/metrics"):
        r = httpx.get(f"http://{s.host}:{s.port}/metrics", timeout=PROBE_TIMEOUT_S)
        assert r.status_code == 200 and "# HELP" in r.text, (s.row(), r.status_code)
        return "open: GET /metrics without credentials: 200"
    with socket.create_connection((s.host, s.port), timeout=PROBE_TIMEOUT_S):
        return "open: TCP connect accepted"


# -- the test ---------------------------------------------------------------------------------
def test_every_listening_socket_is_a_listed_surface_and_the_protected_ones_refuse_strangers(secured_cluster):
    c = secured_cluster
    state = c.state
    status_run = pdserve("status", "--topology", str(c.topology), "--json", timeout=120)
    assert status_run.returncode == 0, status_run.stdout[-2000:] + status_run.stderr[-2000:]
    status = json.loads(status_run.stdout)
    listed = {s["name"]: s for s in status["security"]}
    # `status` prints exactly what the topology's surfaces are, every one of them protected here
    # but the open /metrics endpoints and the data plane (no setting protects them).
    assert [s.to_dict() for s in surfaces(load_topology(c.topology))] == status["security"]
    assert {n for n, s in listed.items() if s["protected"] != YES} == {
        "NIXL data plane (KV pages)", "prefill /metrics", "queue /metrics", "planner /metrics",
        "Ray autoscaler /metrics"}, listed
    assert set(status["members"]) == set(WORKERS)

    facts_run = subprocess.run([sys.executable, "-c", FACTS, str(c.topology),
                                str(c.topology.parent / "runs" / f"{CLUSTER}.state.json"), *WORKERS],
                               capture_output=True, text=True, timeout=120, cwd=REPO,
                               env={**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib"})
    assert facts_run.returncode == 0, facts_run.stderr[-3000:]
    facts = json.loads(facts_run.stdout.strip().splitlines()[-1])
    assert c.ray_token not in facts_run.stdout + facts_run.stderr
    token = facts["wire"].pop("token")

    procs = cluster_processes(state, facts["session_dir"])
    # Every process the cluster reports is one the enumeration covers.
    expected = {state["etcd_pid"], state["ray_head_pid"], state["gate_pid"], *(a["pid"] for a in state["actors"]),
                *(a["pid"] for a in facts["actors"].values())}
    assert expected <= set(procs), f"cluster processes outside the enumeration: {expected - set(procs)}"
    sockets = listening_sockets(procs)
    # Ray's worker table is read after the enumeration: a worker listening then is in it.
    classify(sockets, procs, state, status, facts)
    for s in sockets:
        if s.surface is not None and s.surface not in listed:  # known to the test, not to `status`
            s.surface, s.what = None, f"{s.what}: surface {s.surface!r} not in `pdserve status`"
    report = "\n".join(s.row() for s in sockets)
    unlisted = [s for s in sockets if s.surface is None]
    assert not unlisted, "listening sockets that no surface of `pdserve status` lists:\n" + \
        "\n".join(s.row() for s in unlisted) + "\n\nall of them:\n" + report

    # pdserve's own servers bind network.bind (loopback here); Ray's bind what Ray chooses.
    assert all(s.loopback for s in sockets if s.ours), report
    # What this topology must have shown (each kind at least once).
    kinds = {s.what.split(" (")[0].replace("prefill-0 ", "").replace("decode-0 ", "") for s in sockets}
    for kind in ("etcd client", "etcd peer", "etcd gate", "Ray GCS", "raylet node manager", "raylet object manager",
                 "queue wire", "queue metrics", "planner metrics", "grpc", "http", "metrics", "UCX listener"):
        assert kind in kinds, f"no {kind} listener found:\n{report}"

    for s in sockets:
        if s.host is None:
            s.probe = "not probed: bound to a non-loopback address only"
        elif listed[s.surface]["protected"] == NO:
            s.probe = probe_open(s)
        elif s.surface == "Ray":
            s.probe = probe_ray(c, s)
        elif s.surface == "etcd":
            s.probe = probe_etcd(c, s)
        elif s.surface == "etcd gate":
            s.probe = probe_gate(c, s)
        elif s.surface == "prefill queue wire":
            s.probe = probe_queue_wire(c, s, token)
        elif s.surface == "decode gRPC/HTTP":
            s.probe = probe_decode(c, s)
        else:
            pytest.fail(f"no probe for protected surface {s.surface!r}: {s.row()}")
    print("\nlistening sockets of the secured cluster:\n" + "\n".join(s.row() for s in sockets))
