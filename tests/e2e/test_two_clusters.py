"""Two `pdserve up` clusters on one host (different names) serve side by side without touching
each other. The trap: every `ray start --head` rewrites Ray's "current cluster" file, so after
the second cluster starts, a bare `ray.init()` / address "auto" joins the SECOND cluster. pdserve
always names its Ray: `pdserve worker --topology A` (no --ray-address) joins A's head, read from
the state file `pdserve up` wrote for A (before: "auto", i.e. B's head)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.api import Client
from pdserve.cluster.registry import Registry
from tests.harness import small_topology_yaml, wait_until

pytestmark = pytest.mark.timeout(420)
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}


def pdserve(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=REPO)


def _members(endpoints: list[str], cluster: str) -> set:
    async def go():
        async with Registry(endpoints, cluster) as reg:
            return set(await reg.members())

    return asyncio.run(go())


def _topology(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    text = small_topology_yaml(name, d).replace("  prefill:\n    replicas: 1\n", "  prefill:\n    replicas: 0\n")
    path = d / "topology.yaml"
    path.write_text(text)
    return path


def test_two_clusters_on_one_host_serve_at_once_and_a_worker_joins_its_own(tmp_path):
    a, b = _topology(tmp_path, "two-a"), _topology(tmp_path, "two-b")
    states = {}
    worker = None
    try:
        for name, path in (("two-a", a), ("two-b", b)):
            up = pdserve("up", "--topology", str(path))
            assert up.returncode == 0, up.stdout + up.stderr
            states[name] = json.loads((path.parent / "runs" / f"{name}.state.json").read_text())
        sa, sb = states["two-a"], states["two-b"]
        assert sa["ray_address"] != sb["ray_address"] and sa["etcd_endpoints"] != sb["etcd_endpoints"]
        for s in (sa, sb):  # both serve at once
            dec = next(x for x in s["actors"] if x["role"] == "decode")
            with Client(dec["grpc"]) as c:
                out = c.generate("two clusters on one host", max_tokens=4, temperature=0.0)
            assert out.finish_reason == "length" and out.breakdown["worker_id"] == "decode-0"
        # B's head started last: Ray's current-cluster file names B now. A worker of A, given
        # no --ray-address, must still land in A's Ray (the address `up` recorded for A).
        log = tmp_path / "worker-a.log"
        worker = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "worker", "--role", "decode", "--topology", str(a),
             "--etcd", sa["etcd_endpoints"][0], "--worker-id", "decode-extra", "--drain-timeout", "5"],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=ENV, cwd=REPO, start_new_session=True)
        wait_until(lambda: "decode-extra" in _members(sa["etcd_endpoints"], "two-a") or worker.poll() is not None,
                   180, 0.5)
        assert worker.poll() is None, log.read_text()[-3000:]
        assert f"ray {sa['ray_address']}" in log.read_text(), log.read_text()[-3000:]
        probe = subprocess.run(
            [sys.executable, "-c", "import ray, sys; ray.init(address=sys.argv[1], namespace=sys.argv[2], "
             "log_to_driver=False); print(sorted(ray.util.list_named_actors()))", sa["ray_address"], sa["namespace"]],
            capture_output=True, text=True, timeout=120, env=ENV)
        assert "two-a-decode-extra" in probe.stdout, probe.stdout + probe.stderr
        assert _members(sb["etcd_endpoints"], "two-b") == {"decode-0"}
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(90) == 0, log.read_text()[-3000:]
        worker = None
        st = pdserve("status", "--topology", str(b))
        assert st.returncode == 0 and "decode-0" in st.stdout and "decode-extra" not in st.stdout, st.stdout
        down = pdserve("down", "--topology", str(a))
        assert down.returncode == 0, down.stdout + down.stderr
        states.pop("two-a")
        dec = next(x for x in sb["actors"] if x["role"] == "decode")
        with Client(dec["grpc"]) as c:  # B outlives A's `down`
            assert c.generate("still here", max_tokens=2, temperature=0.0).finish_reason == "length"
    finally:
        if worker is not None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)
        for name, path in (("two-a", a), ("two-b", b)):
            if name in states:
                pdserve("down", "--topology", str(path))
