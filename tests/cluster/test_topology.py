"""Topology files: the shipped ones validate; broken ones name the key and line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pdserve.cluster.topology import (
    DEFAULT_DECODE_ENTRYPOINT,
    DEFAULT_PREFILL_ENTRYPOINT,
    TopologyError,
    load_topology,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs" / "topologies").glob("*.yaml"))

MINIMAL = """\
cluster: test
model:
  path: auto
roles:
  prefill:
    replicas: 1
  decode:
    replicas: 1
"""


def write(tmp_path: Path, text: str, name: str = "topo.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_the_three_topologies_are_shipped():
    assert {p.name for p in SHIPPED} >= {"1p1d-local.yaml", "2p2d.yaml", "4p8d.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_topology_validates_and_its_policy_files_exist(path):
    topo = load_topology(path)
    assert topo.roles.decode.replicas >= 1
    assert topo.router_policy_path is not None and topo.router_policy_path.is_file()
    assert topo.autoscale_policy_path is None or topo.autoscale_policy_path.is_file()


def test_local_topology_is_1p1d_on_cpu_with_a_made_model_and_embedded_etcd():
    topo = load_topology(REPO / "configs" / "topologies" / "1p1d-local.yaml")
    assert (topo.roles.prefill.replicas, topo.roles.decode.replicas) == (1, 1)
    assert topo.model.is_auto and topo.model_path is None
    assert topo.model_cache_path == REPO / ".cache" / "models"
    assert topo.embedded_etcd and topo.ray.address is None
    assert topo.roles.prefill.resources.num_gpus == topo.roles.decode.resources.num_gpus == 0
    assert topo.roles.prefill.engine["device"] == "cpu"


@pytest.mark.parametrize("name, counts", [("2p2d.yaml", (2, 2)), ("4p8d.yaml", (4, 8))])
def test_gpu_topologies_ask_one_gpu_per_replica(name, counts):
    topo = load_topology(REPO / "configs" / "topologies" / name)
    assert (topo.roles.prefill.replicas, topo.roles.decode.replicas) == counts
    assert topo.roles.prefill.resources.num_gpus == topo.roles.decode.resources.num_gpus == 1


def test_minimal_topology_gets_defaults(tmp_path):
    topo = load_topology(write(tmp_path, MINIMAL))
    assert topo.roles.prefill.entrypoint == DEFAULT_PREFILL_ENTRYPOINT
    assert topo.roles.decode.entrypoint == DEFAULT_DECODE_ENTRYPOINT
    assert topo.etcd.lease_ttl_s == 10.0 and topo.queue.capacity == 1024
    assert topo.router_policy is None and topo.base_dir == tmp_path


def test_unknown_key_is_named_with_its_line(tmp_path):
    path = write(tmp_path, MINIMAL.replace("    replicas: 1\n  decode", "    replicas: 1\n    replica_count: 2\n  decode"))
    with pytest.raises(TopologyError) as err:
        load_topology(path)
    assert str(err.value) == (f"{path}:7:5: roles.prefill.replica_count: unknown key 'replica_count' (allowed: replicas, "
                              "resources, engine, tensor_parallel_size, ports, cpus, entrypoint); did you mean 'replicas'?")


def test_negative_replicas_are_named_with_their_line(tmp_path):
    path = write(tmp_path, MINIMAL.replace("replicas: 1\n  decode", "replicas: -2\n  decode"))
    with pytest.raises(TopologyError, match=r":6:5: roles\.prefill\.replicas: Input should be greater than or equal to 0 \(got -2\)"):
        load_topology(path)


def test_zero_decode_replicas_are_refused(tmp_path):
    path = write(tmp_path, MINIMAL[: MINIMAL.rindex("replicas: 1")] + "replicas: 0\n")
    with pytest.raises(TopologyError, match=r":8:5: roles\.decode\.replicas: .*greater than or equal to 1"):
        load_topology(path)


def test_missing_model_is_named(tmp_path):
    path = write(tmp_path, MINIMAL.replace("model:\n  path: auto\n", ""))
    with pytest.raises(TopologyError) as err:
        load_topology(path)
    assert [(i.path, i.line, i.column, i.message) for i in err.value.issues] == [("model", 1, 1, "Field required")]
    assert "model: Field required" in str(err.value)


def test_missing_model_path_is_named_with_the_model_line(tmp_path):
    path = write(tmp_path, MINIMAL.replace("  path: auto\n", "  name: x\n"))
    with pytest.raises(TopologyError, match=r":2:1: model\.path: Field required"):
        load_topology(path)


def test_every_error_is_reported_at_once(tmp_path):
    path = write(tmp_path, MINIMAL.replace("cluster: test", "cluster: test\ncolour: blue").replace("replicas: 1\n  decode", "replicas: -1\n  decode"))
    with pytest.raises(TopologyError) as err:
        load_topology(path)
    assert {issue.path for issue in err.value.issues} == {"colour", "roles.prefill.replicas"}


def test_missing_policy_file_is_named(tmp_path):
    path = write(tmp_path, MINIMAL + "router_policy: ../router/nope.yaml\n")
    with pytest.raises(TopologyError, match=r":9:1: router_policy: file '\.\./router/nope\.yaml' not found"):
        load_topology(path)
    assert load_topology(path, check_files=False).router_policy == "../router/nope.yaml"


def test_policy_paths_resolve_against_the_topology_directory(tmp_path):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "mine.yaml").write_text("router: {}\n")
    (tmp_path / "topologies").mkdir()
    topo = load_topology(write(tmp_path / "topologies", MINIMAL + "router_policy: ../router/mine.yaml\n"))
    assert topo.router_policy_path == tmp_path / "router" / "mine.yaml"


@pytest.mark.parametrize(
    "extra, key",
    [
        ("etcd:\n  endpoints: [localhost]\n", "etcd.endpoints"),
        ("etcd:\n  lease_ttl_s: 0.5\n", "etcd.lease_ttl_s"),
        ("cluster: has/slash\n", "cluster"),
        ("queue:\n  capacity: 0\n", "queue.capacity"),
        ("queue:\n  poll_timeout_ms: 2000\n  stall_timeout_s: 3\n", "queue"),  # idle workers would look hung
    ],
)
def test_bad_values_name_their_key(tmp_path, extra, key):
    text = MINIMAL.replace("cluster: test\n", "") if extra.startswith("cluster") else MINIMAL
    with pytest.raises(TopologyError) as err:
        load_topology(write(tmp_path, text + extra))
    assert [issue.path for issue in err.value.issues] == [key]


def test_bad_entrypoint_and_port_collisions_are_named(tmp_path):
    text = MINIMAL.replace("  decode:\n    replicas: 1\n", "  decode:\n    replicas: 2\n    entrypoint: not-a-module\n")
    with pytest.raises(TopologyError, match=r"roles\.decode\.entrypoint: String should match pattern"):
        load_topology(write(tmp_path, text))
    text = MINIMAL.replace("  decode:\n    replicas: 1\n", "  decode:\n    replicas: 2\n    ports: {grpc: 8000, http: 8001}\n")
    with pytest.raises(TopologyError, match=r"roles\.decode\.ports\.http: port 8001 is also used by roles\.decode\.ports\.grpc"):
        load_topology(write(tmp_path, text))


def test_duplicate_keys_and_broken_yaml_are_reported_with_lines(tmp_path):
    with pytest.raises(TopologyError, match=r":3:1: cluster: duplicate key"):
        load_topology(write(tmp_path, "cluster: a\nmodel: {path: auto}\ncluster: b\nroles: {}\n"))
    with pytest.raises(TopologyError, match=r":2:6: invalid YAML: mapping values are not allowed here"):
        load_topology(write(tmp_path, "cluster: a\n  bad: indent\n"))
    with pytest.raises(TopologyError, match=r":1:1: top level must be a mapping of keys"):
        load_topology(write(tmp_path, "- just\n- a list\n"))
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(tmp_path / "missing.yaml")


def test_topology_check_command_prints_ok_or_every_problem(tmp_path, capsys):
    import argparse

    from pdserve import cluster_cli as cli

    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command"))
    bad = write(tmp_path, MINIMAL.replace("replicas: 1\n  decode", "replicas: -1\n  decode"))
    args = parser.parse_args(["topology", "check", str(SHIPPED[0]), str(bad)])
    assert args.func(args) == 1
    out, err = capsys.readouterr()
    assert f"{SHIPPED[0]}: OK: cluster" in out
    assert f"{bad}:6:5: roles.prefill.replicas:" in err


TP = """\
cluster: test
model:
  path: auto
roles:
  prefill:
    replicas: 1
    tensor_parallel_size: {p}
    engine: {pe}
  decode:
    replicas: 1
    tensor_parallel_size: {d}
    engine: {de}
"""


def test_tensor_parallel_roles_give_their_engines_the_size_and_an_hnd_pool_when_they_differ(tmp_path):
    topo = load_topology(write(tmp_path, TP.format(p=2, d=1, pe="{device: cpu}", de="{}")))
    assert topo.engine_args("prefill") == {"device": "cpu", "tensor_parallel_size": 2, "kv_layout": "HND"}
    assert topo.engine_args("decode") == {"kv_layout": "HND"}
    same = load_topology(write(tmp_path, TP.format(p=2, d=2, pe="{}", de="{}")))
    assert same.engine_args("decode") == {"tensor_parallel_size": 2}  # equal sizes: whole blocks, any layout


@pytest.mark.parametrize("p,d,pe,de,words", [
    (2, 1, "{kv_layout: NHD}", "{}", "roles.prefill.engine.kv_layout='NHD'.*set it to HND"),
    (2, 2, "{tensor_parallel_size: 4}", "{}", "roles.prefill.engine.tensor_parallel_size=4 disagrees"),
    (1, 2, "{}", "{}", None),
])
def test_tensor_parallel_settings_that_cannot_work_are_refused_naming_the_key(tmp_path, p, d, pe, de, words):
    path = write(tmp_path, TP.format(p=p, d=d, pe=pe, de=de))
    if words is None:
        load_topology(path)
        return
    with pytest.raises(TopologyError, match=words):
        load_topology(path)


def test_a_gpu_replica_needs_a_gpu_per_rank(tmp_path):
    text = TP.format(p=2, d=1, pe="{}", de="{}").replace("    tensor_parallel_size: 2\n",
                                                          "    tensor_parallel_size: 2\n    resources: {num_gpus: 1}\n")
    with pytest.raises(TopologyError, match="roles.prefill.resources.num_gpus=1 but .*set num_gpus: 2"):
        load_topology(write(tmp_path, text))


def test_the_planner_counts_a_gpu_tp_replica_as_its_gpus(tmp_path):
    from pdserve.cluster.planner.actor import cpu_units

    text = TP.format(p=4, d=1, pe="{}", de="{}").replace(
        "    tensor_parallel_size: 4\n", "    tensor_parallel_size: 4\n    resources: {num_gpus: 4}\n").replace(
        "    tensor_parallel_size: 1\n", "    tensor_parallel_size: 1\n    resources: {num_gpus: 1}\n")
    assert cpu_units(load_topology(write(tmp_path, text))) == {"prefill": 4, "decode": None}
