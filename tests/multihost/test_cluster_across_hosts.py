"""An XpYd cluster across hosts, brought up the way an operator would.

`ray up deploy/ray/local.yaml` starts Ray on three namespace hosts; `pdserve up` on
the head host then starts etcd and the queue there, the prefill worker on the prefill
host and the decode worker on the decode host (placed by Ray's per-node resources),
every server bound to its host's address (network.bind: node) and UCX on TCP. A
client on the head host (neither worker's) streams requests to the decode host.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from pdserve.bench.netns import Network
from ray_up import VENV_BIN, clean_up, ray_up

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
MAX_TOKENS = 8
NAMESPACE = "pdserve"
CLUSTER = "mh"
TTL_S = 4
QUARANTINE_S = 8  # blocks a partitioned prefill worker may still write stay unused this long


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 31000 + 3 for i in range(n)]


class MultiHostCluster:
    def __init__(self, ray_cluster, topology: Path, state: dict):
        self.ray = ray_cluster
        self.net = ray_cluster.net
        self.topology = topology
        self.state = state

    @property
    def decode_grpc(self) -> str:
        return next(a["grpc"] for a in self.state["actors"] if a["role"] == "decode")

    def client(self, op: str, timeout: float = 300, **args) -> dict:
        payload = json.dumps({"op": op, **args})
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(HERE)}
        res = subprocess.run(self.net["head"].cmd(sys.executable, str(HERE / "mh_client.py"), payload),
                             capture_output=True, text=True, timeout=timeout, env=env)
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT=")), None)
        if res.returncode != 0 or line is None:
            raise RuntimeError(f"client {op} failed ({res.returncode}): {res.stderr[-3000:]}")
        return json.loads(line.removeprefix("RESULT="))

    def stats(self) -> dict:
        return self.client("stats", ray=self.ray.address, namespace=NAMESPACE,
                           actors={f"{CLUSTER}-decode-0": "stats", f"{CLUSTER}-prefill-0": "get_stats"})

    def generate(self, prompts, route: str, **kw) -> list[dict]:
        return self.client("generate", target=self.decode_grpc, prompts=prompts, route=route,
                           max_tokens=MAX_TOKENS, **kw)["outs"]

    def generate_in_background(self, prompts, route: str, **kw) -> subprocess.Popen:
        payload = json.dumps({"op": "generate", "target": self.decode_grpc, "prompts": prompts, "route": route,
                              "max_tokens": MAX_TOKENS, **kw})
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(HERE)}
        return subprocess.Popen(self.net["head"].cmd(sys.executable, str(HERE / "mh_client.py"), payload),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def wait_member(self, worker: str, present: bool, timeout_s: float) -> float | None:
        return self.client("wait_member", etcd=self.state["etcd_endpoints"], cluster=CLUSTER, worker=worker,
                           present=present, timeout_s=timeout_s, timeout=timeout_s + 120)["elapsed_s"]

    def pdserve(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        return subprocess.run(self.net["head"].cmd(str(VENV_BIN / "pdserve"), *args), capture_output=True,
                              text=True, timeout=timeout, env=env)


def worker_processes(net: Network) -> dict[str, list[str]]:
    """Host -> the pdserve worker actor processes alive in it (Ray names them ray::<Class>)."""
    out = {}
    for name, host in net.hosts.items():
        pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
        found = []
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "DecodeWorker" in cmd or "PrefillWorker" in cmd:
                found.append(cmd.strip())
        if found:
            out[name] = found
    return out


def write_topology(path: Path, model: str, net: Network, ray_address: str, run_dir: str, prefill_tp: int = 1) -> None:
    engine = {"device": "cpu", "attention_backend": "torch", "dtype": "float32",
              "max_num_batched_tokens": 1024, "kv_cache_memory_bytes": 64 << 20}
    topo = {
        "cluster": CLUSTER,
        "model": {"path": model},
        "roles": {
            "prefill": {"replicas": 1, "engine": engine, "tensor_parallel_size": prefill_tp,
                        "resources": {"num_cpus": 1, "custom": {f"node:{net['prefill'].addr}": 0.01}}},
            "decode": {"replicas": 1, "engine": engine, "remote_quarantine_s": QUARANTINE_S,
                       "resources": {"num_cpus": 1, "custom": {f"node:{net['decode'].addr}": 0.01}}},
        },
        "etcd": {"lease_ttl_s": TTL_S},
        "ray": {"address": ray_address, "namespace": NAMESPACE},
        "queue": {"wire": "node", "batch_max_tokens": 1024},
        # Every server on its host's address; UCX on TCP so that the pages cross the veth
        # (the hosts share a kernel: shared memory would otherwise be a shortcut).
        "network": {"bind": "node", "ucx": {"UCX_TLS": "tcp"}},
        "run_dir": run_dir,
    }
    path.write_text(yaml.safe_dump(topo))


@contextlib.contextmanager
def brought_up(model: str, prefill_tp: int = 1):
    """`ray up` over three namespace hosts, then `pdserve up`; `pdserve down` and teardown after."""
    net = Network(["head", "prefill", "decode"]).__enter__()
    ray_cluster = None
    run_dir = tempfile.mkdtemp(prefix="pdserve-mh-")
    try:
        ray_cluster = ray_up(net, "head", ["prefill", "decode"])
        topology = Path(run_dir) / "topology.yaml"
        write_topology(topology, model, net, ray_cluster.address, run_dir, prefill_tp)
        mh = MultiHostCluster(ray_cluster, topology, {})
        up = mh.pdserve("up", "--topology", str(topology))
        Path(run_dir, "pdserve-up.log").write_text(up.stdout + up.stderr)
        assert up.returncode == 0, f"pdserve up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        mh.state = json.loads(Path(run_dir, f"{CLUSTER}.state.json").read_text())
        yield mh
        down = mh.pdserve("down", "--topology", str(topology), timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert worker_processes(net) == {}, "pdserve down left workers running"
    finally:
        net.close()
        clean_up(ray_cluster, net)
        subprocess.run(["rm", "-rf", run_dir])


@pytest.fixture(scope="module")
def cluster(llama_dir):
    with brought_up(llama_dir) as mh:
        yield mh


def test_workers_serve_on_their_hosts_addresses(cluster):
    net, st = cluster.net, cluster.state
    assert cluster.decode_grpc.split(":")[0] == net["decode"].addr
    assert st["etcd_endpoints"][0].split(":")[0] == net["head"].addr
    stats = cluster.stats()
    assert stats[f"{CLUSTER}-prefill-0"]["metrics"].split(":")[0] == net["prefill"].addr
    status = cluster.pdserve("status", "--topology", str(cluster.topology), "--json", timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    members = json.loads(status.stdout)["members"]
    assert {w: m["address"] for w, m in members.items()} == {"prefill-0": net["prefill"].addr,
                                                              "decode-0": net["decode"].addr}


def test_remote_prefill_crosses_hosts_token_exact(cluster):
    net = cluster.net
    prompts = [prompt_of(200 + 16 * i, seed=i) for i in range(4)]
    local = cluster.generate(prompts, route="local")
    before = cluster.stats()
    tx0, rx0 = net["prefill"].link_stats()["tx_bytes"], net["decode"].link_stats()["rx_bytes"]
    remote = cluster.generate(prompts, route="remote")
    after = cluster.stats()
    tx1, rx1 = net["prefill"].link_stats()["tx_bytes"], net["decode"].link_stats()["rx_bytes"]

    assert all("error" not in o for o in local + remote), local + remote
    assert [o["token_ids"] for o in remote] == [o["token_ids"] for o in local]
    assert [o["breakdown"]["route"] for o in remote] == ["remote"] * len(prompts)
    d0, d1 = before[f"{CLUSTER}-decode-0"], after[f"{CLUSTER}-decode-0"]
    p0, p1 = before[f"{CLUSTER}-prefill-0"], after[f"{CLUSTER}-prefill-0"]
    assert d1["num_prompt_tokens_computed"] == d0["num_prompt_tokens_computed"]  # decode computed none
    received = d1["remote"]["bytes_received"] - d0["remote"]["bytes_received"]
    written = p1["bytes_written"] - p0["bytes_written"]
    assert received == written > 0
    assert tx1 - tx0 >= written and rx1 - rx0 >= written, (tx1 - tx0, rx1 - rx0, written)


def _finish(proc: subprocess.Popen, timeout: float) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    line = next((x for x in out.splitlines() if x.startswith("RESULT=")), None)
    assert proc.returncode == 0 and line is not None, err[-3000:]
    return json.loads(line.removeprefix("RESULT="))["outs"]


def test_a_pulled_prefill_link_loses_no_request_and_leaks_no_block(cluster):
    """8 remote requests in flight, their pages crawling over a 1 Mbit/s link; the prefill
    host's link goes down: every request completes exactly (local fallback), the decode
    host's free blocks return to their baseline, the prefill worker leaves etcd within its
    TTL + 2 s; the link comes back: it registers again and serves remote prefill again."""
    net = cluster.net
    prompts = [prompt_of(300 + 8 * i, seed=100 + i) for i in range(8)]
    reference = [o["token_ids"] for o in cluster.generate(prompts, route="local")]
    free0 = cluster.stats()[f"{CLUSTER}-decode-0"]["num_free_blocks"]
    prefill = net["prefill"]
    prefill.limit_rate(1)
    try:
        tx0 = prefill.link_stats()["tx_bytes"]
        proc = cluster.generate_in_background(prompts, route="remote", timeout_s=180)
        deadline = time.monotonic() + 120
        while prefill.link_stats()["tx_bytes"] - tx0 < 64_000:  # pages are on the wire
            assert proc.poll() is None and time.monotonic() < deadline, "no KV transfer started"
            time.sleep(0.05)
        prefill.link(up=False)
        gone = cluster.wait_member("prefill-0", present=False, timeout_s=TTL_S + 2)
        outs = _finish(proc, 240)
    finally:
        prefill.link(up=True)
        prefill.limit_rate(None)
    assert gone is not None, f"prefill-0 still registered {TTL_S + 2} s after its link went down"
    assert [o.get("token_ids") for o in outs] == reference, [o.get("error") for o in outs]
    fell_back = [bool(o["breakdown"].get("fell_back_to_local")) for o in outs]
    assert any(fell_back), [o["breakdown"] for o in outs]  # those whose pages were cut off
    assert all(f or o["breakdown"]["route"] == "remote" for f, o in zip(fell_back, outs))
    # Blocks the cut-off prefill worker had taken stay quarantined (its writes could still land
    # when the link returns) until their late notification arrives or QUARANTINE_S passes.
    deadline = time.monotonic() + QUARANTINE_S + 30
    while True:
        stats = cluster.stats()[f"{CLUSTER}-decode-0"]
        if (stats["num_free_blocks"] == free0 and stats["inflight"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert stats["num_free_blocks"] == free0 and stats["inflight"] == 0, stats

    assert cluster.wait_member("prefill-0", present=True, timeout_s=60) is not None, "prefill-0 never came back"
    again = cluster.generate(prompts[:2], route="remote")
    assert [o["token_ids"] for o in again] == reference[:2]
    assert [o["breakdown"]["route"] for o in again] == ["remote", "remote"], again
