"""Ray resource accounting for everything `pdserve up` starts (cluster/resources.py): the head
it starts is sized for the gateways and the KV index too, `pdserve topology check` lists what
each part asks for and refuses what no head it starts could place, and `up` fails at once,
naming the shortfall, instead of waiting minutes on an actor Ray can never schedule."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pytest

from pdserve.cluster.resources import custom_without_cluster, head_cpus, ray_demand, shortfall, total
from pdserve.cluster.topology import load_topology

REPO = Path(__file__).resolve().parents[2]

ONE_P_TWO_D = """\
cluster: rc
model:
  path: auto
roles:
  prefill:
    replicas: 1
  decode:
    replicas: 2
gateway: {replicas: 1}
kv_index: {enabled: true}
"""


def _topo(tmp_path, text):
    path = tmp_path / "topo.yaml"
    path.write_text(textwrap.dedent(text))
    return load_topology(path, check_files=False)


def test_the_1p2d_gateway_topology_counts_the_gateway_and_the_kv_index(tmp_path):
    demands = ray_demand(_topo(tmp_path, ONE_P_TWO_D))
    assert total(demands) == {"CPU": 1 + 2 + 0.5 + 0.25}
    # The head `up` used to start counted the workers only (3 CPUs): the gateway's 0.5 never fit.
    assert head_cpus(demands) == 4
    assert shortfall(demands, {"CPU": 3.0}) == [
        "CPU: need 3.75, the Ray cluster has 3 free (prefill worker 1x1, decode worker 2x1, gateway 1x0.5, "
        "kv index 1x0.25)"]
    assert shortfall(demands, {"CPU": 4.0, "memory": 1e9}) == []


def test_the_planners_max_replicas_and_tp_ranks_are_counted(tmp_path):
    topo = _topo(tmp_path, """\
        cluster: rc
        model: {path: auto}
        roles:
          prefill: {replicas: 1, tensor_parallel_size: 2, resources: {num_cpus: 0}}
          decode: {replicas: 1, resources: {num_cpus: 2}}
        """)
    demands = ray_demand(topo, {"prefill": 1, "decode": 3})
    by_what = {d.what: d for d in demands}
    assert by_what["decode worker"].count == 3 and "max_replicas 3" in by_what["decode worker"].note
    # A TP rank that asks for no CPU still reserves a sliver in its bundle (cluster/actors.py).
    assert by_what["prefill worker, TP=2"].each == {"CPU": pytest.approx(0.02)}
    assert head_cpus(demands) == 7
    assert head_cpus(ray_demand(topo)) == 3  # without the planner: what starts now


def test_custom_resources_are_named_when_no_ray_cluster_is_given(tmp_path):
    topo = _topo(tmp_path, """\
        cluster: rc
        model: {path: auto}
        roles:
          prefill: {replicas: 1, resources: {custom: {pdserve_prefill: 1}}}
          decode: {replicas: 1, resources: {custom: {"node:10.0.0.2": 0.01}}}
        gateway: {replicas: 2, custom: {pdserve_gateway: 1}}
        """)
    demands = ray_demand(topo)
    # node:<ip> is every node's own resource: not something only `ray up` nodes carry.
    assert custom_without_cluster(demands) == ["pdserve_gateway (asked by gateway)",
                                               "pdserve_prefill (asked by prefill worker)"]
    assert shortfall(demands, {"CPU": 10, "pdserve_gateway": 1, "pdserve_prefill": 1, "node:10.0.0.2": 1}) == [
        "pdserve_gateway: need 2, the Ray cluster has 1 free (gateway 2x1)"]


def _check(*files):
    from pdserve import cluster_cli as cli

    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["topology", "check", *map(str, files)])
    return args.func(args)


def test_topology_check_lists_what_up_starts_and_refuses_custom_resources_without_a_cluster(tmp_path, capsys):
    shipped = REPO / "configs" / "topologies" / "1p2d-gateway.yaml"
    assert _check(shipped) == 0
    out = capsys.readouterr().out
    assert "gateway              x1  each CPU 0.5" in out and "kv index" in out
    assert "total: CPU 3.75; a Ray head `pdserve up` starts gets 4 CPUs" in out
    bad = tmp_path / "custom.yaml"
    bad.write_text(ONE_P_TWO_D.replace("gateway: {replicas: 1}", "gateway: {replicas: 1, custom: {gw_node: 1}}"))
    assert _check(bad) == 1
    err = capsys.readouterr().err
    assert "gw_node (asked by gateway)" in err and "Set ray.address" in err
    with_cluster = tmp_path / "with-cluster.yaml"
    with_cluster.write_text(bad.read_text() + "ray: {address: '10.0.0.1:6379'}\n")
    assert _check(with_cluster) == 0


def test_up_refuses_at_once_what_the_head_it_starts_cannot_place(tmp_path):
    """A custom resource only `ray up` nodes carry: `up` fails right after starting the head,
    naming it, and leaves nothing running (before: a GetTimeoutError after READY_TIMEOUT_S)."""
    import time

    from pdserve.launcher import READY_TIMEOUT_S, Launcher
    from pdserve.state import state_path
    from tests.harness import small_topology_yaml

    text = small_topology_yaml("rc-short", tmp_path) + "gateway: {replicas: 1, custom: {gw_node: 1}}\n"
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    topo = load_topology(path)
    lines = []
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"gw_node: need 1, the Ray cluster has 0 free \(gateway 1x1\)"):
        Launcher(topo, str(path), model_path=str(tmp_path / "no-model"), progress=lines.append).up()
    assert time.monotonic() - start < READY_TIMEOUT_S / 2, lines
    assert "start-up failed; stopping what was started" in lines
    assert not any(line.startswith(("prefill ", "decode ")) for line in lines), lines  # no worker was started
    assert not state_path(topo).exists()


def test_a_ray_head_not_listening_in_time_is_stopped_and_started_again(tmp_path, monkeypatch):
    """A head `up` starts that is alive but does not listen within RAY_START_TIMEOUT_S (once in
    CI runs, a local head's GCS never came up; a second start worked) is stopped, whole, and
    started once more on another port. The first head is made to look silent (its port reads
    closed) for 2 s; the second is real."""
    import pdserve.launcher as launcher
    from pdserve.launcher import ClusterState, Launcher
    from pdserve.processes import port_open, terminate_group, wait_gone
    from tests.harness import small_topology_yaml

    path = tmp_path / "topology.yaml"
    path.write_text(small_topology_yaml("rc-restart", tmp_path))
    topo = load_topology(path, check_files=False)
    state = ClusterState(cluster=topo.cluster, topology=str(path), namespace="ns", ray_address="",
                         ray_head_pid=None, etcd_endpoints=[], etcd_pid=None, queue_name="q", model="m")
    silent: dict = {}
    stopped: list[int] = []

    def looks_closed(port):  # the first head's port, whatever it does
        silent.setdefault("port", port)
        return False if port == silent["port"] else port_open(port)

    def stop(pid, *args, **kwargs):
        stopped.append(pid)
        terminate_group(pid, *args, **kwargs)
        monkeypatch.setattr(launcher, "RAY_START_TIMEOUT_S", 60.0)  # the second head: Ray's own time

    monkeypatch.setattr(launcher, "port_open", looks_closed)
    monkeypatch.setattr(launcher, "terminate_group", stop)
    monkeypatch.setattr(launcher, "RAY_START_TIMEOUT_S", 2.0)
    lines: list[str] = []
    Launcher(topo, str(path), "m", progress=lines.append)._start_ray(state, tmp_path)
    try:
        assert any("not listening after 2 s: stopped, starting it again" in line for line in lines), lines
        assert len(stopped) == 1 and stopped[0] != state.ray_head_pid
        assert wait_gone(stopped[0], 0.5)  # the first head is gone
        port = int(state.ray_address.rsplit(":", 1)[1])
        assert port != silent["port"] and port_open(port)
    finally:
        terminate_group(state.ray_head_pid, "ray head", lines.append, leader_first=True)
