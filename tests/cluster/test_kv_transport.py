"""The KV data plane's UCX settings come from the topology (network.kv_transport, network.ucx),
not from worker code: loopback defaults, RDMA, devices, transports, and "" removing a setting
the process inherited."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from pdserve.common.cores import transfer_threads
from pdserve.cluster.netaddr import ucx_env
from pdserve.cluster.topology import TopologyError, load_topology
from pdserve.cluster.worker_config import WorkerConfig, launch_config
from pdserve.kvtransfer.nixl.nixl_shim import apply_ucx_env

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = """\
cluster: test
model:
  path: auto
roles:
  prefill: {replicas: 1}
  decode: {replicas: 1}
"""


def _topo(tmp_path, network: str = ""):
    path = tmp_path / "topo.yaml"
    path.write_text(TOPOLOGY + textwrap.dedent(network))
    return load_topology(path)


def _worker_config(topo) -> WorkerConfig:
    return WorkerConfig.of({k: v for k, v in launch_config(topo, "decode", 0, model="m", etcd_endpoints=["x:1"]).items()
                            if k in WorkerConfig.__dataclass_fields__})


def _agent_env(topo) -> dict:
    return _worker_config(topo).agent_ucx_env("127.0.0.1")


def test_loopback_default_keeps_ucx_on_lo_without_rdma(tmp_path):
    assert _agent_env(_topo(tmp_path)) == {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}


def test_rdma_devices_and_transports_from_the_topology(tmp_path):
    topo = _topo(tmp_path, """\
        network:
          kv_transport: {rdma: true, devices: "mlx5_0:1", transports: "rc,cuda_copy,cuda_ipc"}
          ucx: {UCX_IB_GID_INDEX: "3"}
        """)
    assert _agent_env(topo) == {"UCX_MODULES": "", "UCX_NET_DEVICES": "mlx5_0:1",
                                "UCX_TLS": "rc,cuda_copy,cuda_ipc", "UCX_IB_GID_INDEX": "3"}
    assert ucx_env("127.0.0.1", devices="all")["UCX_NET_DEVICES"] == ""  # all: UCX chooses


def test_posting_threads_follow_the_cores_each_rank_owns(tmp_path, monkeypatch):
    """kv_transport.threads: auto gives each rank's agent as many NIXL posting threads as the
    rank has cores (at most 4), none with one core; a number is taken as is; neither is a UCX
    variable."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    auto = _worker_config(_topo(tmp_path))
    assert [auto.agent_threads(ranks) for ranks in (1, 2, 4, 8)] == [4, 4, 2, 0]
    fixed = _worker_config(_topo(tmp_path, "network:\n  kv_transport: {threads: 0}\n"))
    assert fixed.agent_threads(1) == 0 and "threads" not in str(fixed.agent_ucx_env("127.0.0.1"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert transfer_threads("auto") == 0
    with pytest.raises(TopologyError, match=r"network\.kv_transport\.threads"):
        _topo(tmp_path, "network:\n  kv_transport: {threads: -1}\n")
    with pytest.raises(TopologyError, match=r"network\.kv_transport\.threads"):
        _topo(tmp_path, "network:\n  kv_transport: {threads: many}\n")


def test_a_misspelt_transport_key_is_named(tmp_path):
    with pytest.raises(TopologyError, match=r"network\.kv_transport\.device: unknown key"):
        _topo(tmp_path, "network:\n  kv_transport: {device: eth1}\n")


def test_an_empty_value_removes_an_inherited_setting(monkeypatch):
    monkeypatch.setenv("UCX_MODULES", "^ib")  # e.g. exported by the operator's shell
    monkeypatch.setenv("UCX_TLS", "sm")
    apply_ucx_env({"UCX_MODULES": "", "UCX_TLS": "tcp"})
    assert "UCX_MODULES" not in os.environ and os.environ["UCX_TLS"] == "tcp"


def test_no_worker_code_hard_codes_ucx_settings():
    worker_code = [p for d in ("decode", "prefill", "pdserve", "kvtransfer", "kvtransfer/nixl") for p in (REPO / d).glob("*.py")]
    offenders = [str(p.relative_to(REPO)) for p in worker_code
                 if "^ib" in p.read_text() and p.name != "nixl_shim.py"]  # the shim's loopback constant is for tests
    assert offenders == []
