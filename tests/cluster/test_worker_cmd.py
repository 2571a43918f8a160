"""`pdserve worker`, the entry point of a Kubernetes pod, and `pdserve drain --etcd --cluster`,
its preStop hook: run for real as subprocesses against a real etcd and a local Ray head,
the way the Helm chart's containers run them (ray start, then pdserve worker)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.cluster.etcd_server import free_loopback_port
from pdserve.cluster.registry import Registry
from tests.harness import small_topology_yaml

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
WAIT_S = 90.0
MAX_TOKENS = 600  # ~4 s of decoding on CPU: SIGTERM comes mid-request, stop() would cut it


@pytest.fixture
def topology(tmp_path, cluster_name):
    path = tmp_path / "topology.yaml"
    path.write_text(small_topology_yaml(cluster_name, tmp_path))
    return path


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head for this module's workers (what the chart's ray-head pod runs); each test
    has a cluster name of its own."""
    tmp_path = tmp_path_factory.mktemp("ray-head")
    port = free_loopback_port()
    log = open(tmp_path / "ray-head.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    try:
        _wait(lambda: _port_open(port) or proc.poll() is not None, 60, "Ray head start")
        assert proc.poll() is None, (tmp_path / "ray-head.log").read_text()[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        _stop_group(proc, timeout_s=5.0)  # then SIGKILL to the group: a test head holds nothing


def pdserve_proc(*args, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=ENV, cwd=REPO, start_new_session=True)


def test_worker_registers_and_a_sigterm_or_a_prestop_drain_takes_it_out(topology, ray_head, etcd, cluster_name,
                                                                         tmp_path):
    from pdserve.cluster.topology import load_topology
    from pdserve.engine.model_maker import resolve_model

    model = resolve_model(load_topology(topology))  # made once here: two workers must not race to make it
    common = ["--role", "prefill", "--topology", str(topology), "--ray-address", ray_head, "--etcd", etcd.endpoint,
              "--model", model, "--drain-timeout", "20"]
    ids = ("pod-prefill-a", "pod-prefill-b")
    procs = {wid: pdserve_proc("worker", *common, "--worker-id", wid, log=tmp_path / f"{wid}.log") for wid in ids}
    logs = lambda wid: (tmp_path / f"{wid}.log").read_text()  # noqa: E731
    try:
        # "ready" comes after the worker's start() returned, which registers it first.
        _wait(lambda: all("ready {" in logs(w) for w in ids) or any(p.poll() is not None for p in procs.values()),
              WAIT_S, "both workers ready")
        for wid, p in procs.items():
            assert p.poll() is None, logs(wid)
            assert f'"worker_id": "{wid}"' in logs(wid) and '"node": "' in logs(wid), logs(wid)
        members = _members(etcd.endpoint, cluster_name)
        assert {members[w].role for w in ids} == {"prefill"}

        # a: SIGTERM alone (a pod deleted without a preStop hook): drains, leaves, exits 0.
        procs["pod-prefill-a"].send_signal(signal.SIGTERM)
        assert procs["pod-prefill-a"].wait(60) == 0, logs("pod-prefill-a")
        assert "draining pod-prefill-a" in logs("pod-prefill-a")
        assert "pod-prefill-a" not in _members(etcd.endpoint, cluster_name)

        # b: the chart's preStop hook (no state file: --etcd --cluster), then the kubelet's SIGTERM.
        drain = subprocess.run([sys.executable, "-m", "pdserve.cli", "drain", "pod-prefill-b", "--etcd", etcd.endpoint,
                                "--cluster", cluster_name], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=60)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        _wait(lambda: "pod-prefill-b" not in _members(etcd.endpoint, cluster_name), 15, "pod-prefill-b leaves etcd")
        assert procs["pod-prefill-b"].poll() is None  # drained, still up until the kubelet's SIGTERM
        procs["pod-prefill-b"].send_signal(signal.SIGTERM)
        assert procs["pod-prefill-b"].wait(60) == 0, logs("pod-prefill-b")
        # Its drain key is gone with it (not leased; a pod name never comes back).
        assert not asyncio.run(_drain_keys(etcd.endpoint, cluster_name))
        assert "stopped" in logs("pod-prefill-b")
    finally:
        for p in procs.values():
            _stop_group(p)


def test_sigterm_lets_a_decode_workers_in_flight_request_finish(tmp_path, ray_head, etcd, cluster_name):
    import json
    import threading

    from pdserve.api import Client
    from pdserve.cluster.topology import load_topology
    from pdserve.engine.model_maker import resolve_model

    topo = tmp_path / "decode-only.yaml"  # 0P1D: the decode worker needs no queue and no NIXL peer
    topo.write_text(small_topology_yaml(cluster_name, tmp_path).replace("replicas: 1", "replicas: 0", 1))
    model = resolve_model(load_topology(topo))
    log = tmp_path / "decode.log"
    proc = pdserve_proc("worker", "--role", "decode", "--topology", str(topo), "--ray-address", ray_head,
                        "--etcd", etcd.endpoint, "--model", model, "--worker-id", "pod-decode-a",
                        "--drain-timeout", "60", log=log)
    try:
        _wait(lambda: "ready {" in log.read_text() or proc.poll() is not None, WAIT_S, "decode worker ready")
        assert proc.poll() is None, log.read_text()
        ready = json.loads(log.read_text().split("ready ", 1)[1].splitlines()[0])
        tokens, first, done = [], threading.Event(), {}

        def generate():
            with Client(ready["grpc"], timeout_s=120) as c:
                for msg in c.stream("Drain me gently", max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0):
                    tokens.extend(msg.token_ids)
                    first.set()
                    done["finish_reason"] = msg.finish_reason or done.get("finish_reason")

        client = threading.Thread(target=generate, daemon=True)
        client.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        at_sigterm = len(tokens)
        client.join(90)
        assert not client.is_alive()
        assert at_sigterm < MAX_TOKENS  # the request was in flight when the pod was told to stop
        assert len(tokens) == MAX_TOKENS and done["finish_reason"] == "length"
        assert proc.wait(60) == 0, log.read_text()
        assert "pod-decode-a" not in _members(etcd.endpoint, cluster_name)
    finally:
        _stop_group(proc)


def test_check_accepts_the_chart_arguments_and_starts_nothing(topology, capsys):
    rc = main(["worker", "--role", "decode", "--topology", str(topology), "--etcd", "pd-etcd:2379,10.0.0.2:2379",
               "--ray-address", "pd-ray-head:6379", "--worker-id", "pd-decode-7c9f8d6b5-x2x7q", "--check"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("OK: decode worker pd-decode-7c9f8d6b5-x2x7q") and "pd-etcd:2379,10.0.0.2:2379" in out


@pytest.mark.parametrize("args, flag", [
    (["--role", "prefill"], "--etcd"),  # neither --etcd nor the topology's etcd.endpoints
    (["--role", "prefill", "--etcd", "etcd-no-port"], "--etcd"),
    (["--role", "prefill", "--etcd", "e:2379", "--worker-id", "pod/0"], "--worker-id"),
    (["--role", "prefill", "--etcd", "e:2379", "--ray-address", "head"], "--ray-address"),
    (["--role", "prefill", "--etcd", "e:2379", "--drain-timeout", "0"], "--drain-timeout"),
    (["--role", "router", "--etcd", "e:2379"], "--role"),
])
def test_check_refuses_bad_arguments_naming_the_flag(topology, capsys, args, flag):
    try:
        rc = main(["worker", "--topology", str(topology), *args, "--check"])
    except SystemExit as exc:  # argparse's own refusals (choices)
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    assert flag in err and "Traceback" not in err


def test_check_refuses_a_missing_or_invalid_topology(tmp_path, capsys):
    assert main(["worker", "--role", "decode", "--topology", str(tmp_path / "none.yaml"), "--etcd", "e:1", "--check"]) == 2
    assert "--topology" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(small_topology_yaml("bad", tmp_path).replace("replicas: 1", "replicas: -1", 1))
    assert main(["worker", "--role", "decode", "--topology", str(bad), "--etcd", "e:1", "--check"]) == 2
    err = capsys.readouterr().err
    assert "--topology" in err and "roles.prefill.replicas" in err


def test_drain_with_etcd_needs_cluster_and_checks_both(capsys):
    assert main(["drain", "pod-1", "--etcd", "e:2379", "--cluster", "pd", "--check"]) == 0
    assert "OK: drain pod-1 of cluster pd" in capsys.readouterr().out
    assert main(["drain", "pod-1", "--etcd", "e:2379", "--check"]) == 2
    assert "--cluster" in capsys.readouterr().err
    assert main(["drain", "pod-1", "--etcd", "e", "--cluster", "pd", "--check"]) == 2
    assert "--etcd" in capsys.readouterr().err
    assert main(["drain", "pod-1", "--etcd", "e:2379", "--cluster", "p/d", "--check"]) == 2
    assert "--cluster" in capsys.readouterr().err


def test_drain_without_etcd_flags_still_reads_the_state_file_of_up(tmp_path, topology, cluster_name, capsys):
    from pdserve.cluster.topology import load_topology
    from pdserve.launcher import ClusterState, state_path

    ClusterState(cluster=cluster_name, topology=str(topology), namespace="ns", ray_address="127.0.0.1:1",
                 ray_head_pid=None, etcd_endpoints=["127.0.0.1:23790"], etcd_pid=None, queue_name="q",
                 model="m").save(state_path(load_topology(topology)))
    assert main(["drain", "prefill-0", "--topology", str(topology), "--check"]) == 0
    assert f"OK: drain prefill-0 of cluster {cluster_name} (etcd 127.0.0.1:23790)" in capsys.readouterr().out


# -- helpers --------------------------------------------------------------------------------
def _members(endpoint: str, cluster: str) -> dict:
    async def go():
        async with Registry([endpoint], cluster) as reg:
            return await reg.members()

    return asyncio.run(go())


async def _drain_keys(endpoint: str, cluster: str) -> list:
    from pdserve.cluster.keys import Keyspace

    async with Registry([endpoint], cluster) as reg:
        prefix = Keyspace(cluster).drain("x")[:-1]
        return list(await reg.client().get_prefix(prefix))


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.2)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stop_group(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass
