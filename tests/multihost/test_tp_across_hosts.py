"""A TP=2 prefill worker on one namespace host serves a TP=1 decode worker on another.

Brought up the way an operator would (`ray up`, then `pdserve up` with a topology whose
prefill role has tensor_parallel_size 2): the prefill worker's two ranks run on the prefill
host, each with its own NIXL agent, and both write their halves of every request's KV
heads across the veth into the decode host's HND pool (UCX on TCP). Requests forced
remote come back as the local path makes them; the pages crossed the link.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from ray_up import clean_up, ray_up
from test_cluster_across_hosts import CLUSTER, NAMESPACE, TTL_S, MultiHostCluster, prompt_of, worker_processes

from pdserve.bench.netns import Network


def write_topology(path: Path, model: str, net: Network, ray_address: str, run_dir: str) -> None:
    engine = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 1024, "kv_cache_memory_bytes": 64 << 20}
    topo = {
        "cluster": CLUSTER,
        "model": {"path": model},
        "roles": {
            "prefill": {"replicas": 1, "engine": engine, "tensor_parallel_size": 2,
                        "resources": {"num_cpus": 1, "custom": {f"node:{net['prefill'].addr}": 0.01}}},
            "decode": {"replicas": 1, "engine": engine,
                       "resources": {"num_cpus": 1, "custom": {f"node:{net['decode'].addr}": 0.01}}},
        },
        "etcd": {"lease_ttl_s": TTL_S},
        "ray": {"address": ray_address, "namespace": NAMESPACE},
        "queue": {"wire": "node", "batch_max_tokens": 1024},
        "network": {"bind": "node", "ucx": {"UCX_TLS": "tcp"}},
        "run_dir": run_dir,
    }
    path.write_text(yaml.safe_dump(topo))


@pytest.fixture(scope="module")
def cluster(llama_dir):
    net = Network(["head", "prefill", "decode"]).__enter__()
    ray_cluster = None
    run_dir = tempfile.mkdtemp(prefix="pdserve-mh-tp-")
    try:
        ray_cluster = ray_up(net, "head", ["prefill", "decode"])
        topology = Path(run_dir) / "topology.yaml"
        write_topology(topology, llama_dir, net, ray_cluster.address, run_dir)
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


def test_a_tp2_prefill_host_serves_a_tp1_decode_host_token_exact(cluster):
    net = cluster.net
    stats = cluster.stats()
    assert len(stats[f"{CLUSTER}-prefill-0"]["tp_ranks"]) == 1  # rank 1 beside rank 0
    status = cluster.pdserve("status", "--topology", str(cluster.topology), timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    assert any(line.split()[:3] == ["prefill-0", "prefill", "2"] for line in status.stdout.splitlines()), status.stdout
    prompts = [prompt_of(150 + 16 * i, seed=i) for i in range(4)]
    local = cluster.generate(prompts, route="local")
    tx0, rx0 = net["prefill"].link_stats()["tx_bytes"], net["decode"].link_stats()["rx_bytes"]
    remote = cluster.generate(prompts, route="remote")
    after = cluster.stats()
    tx1, rx1 = net["prefill"].link_stats()["tx_bytes"], net["decode"].link_stats()["rx_bytes"]
    assert all("error" not in o for o in local + remote), local + remote
    assert [o["token_ids"] for o in remote] == [o["token_ids"] for o in local]
    assert [o["breakdown"]["route"] for o in remote] == ["remote"] * len(prompts)
    written = after[f"{CLUSTER}-prefill-0"]["bytes_written"] - stats[f"{CLUSTER}-prefill-0"]["bytes_written"]
    assert written > 0 and tx1 - tx0 >= written and rx1 - rx0 >= written, (tx1 - tx0, rx1 - rx0, written)
