"""`pdserve status` when the cluster's etcd is down: one line saying so, exit 1, no traceback."""

from __future__ import annotations

import socket

from pdserve import launch
from pdserve.cli import main
from pdserve.cluster.launcher import ClusterState, state_path
from pdserve.cluster.topology import load_topology

from tests.harness import small_topology_yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_with_etcd_down_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    topo_file = tmp_path / "topology.yaml"
    topo_file.write_text(small_topology_yaml("status-etcd-down", tmp_path))
    topo = load_topology(topo_file)
    ClusterState(cluster=topo.cluster, topology=str(topo_file), namespace="ns", ray_address="127.0.0.1:1",
                 ray_head_pid=None, etcd_endpoints=[f"127.0.0.1:{free_port()}"], etcd_pid=None,
                 queue_name="q", model="m").save(state_path(topo))
    monkeypatch.setattr(launch, "_queue_stats", lambda state: None)  # Ray is not what this test is about
    monkeypatch.setattr(launch, "STATUS_ETCD_TIMEOUT_S", 2.0)
    rc = main(["status", "--topology", str(topo_file)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "did not answer" in err and "Is etcd running?" in err
    assert "Traceback" not in err
