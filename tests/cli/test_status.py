"""`pdserve status` when the cluster's etcd is down: one line saying so, exit 1, no traceback."""

from __future__ import annotations

import socket

from pdserve import status_cmd
from pdserve.cli import main
from pdserve.cluster.topology import load_topology
from pdserve.launcher import ClusterState, state_path
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
    monkeypatch.setattr(status_cmd, "_queue_stats", lambda state: None)  # Ray is not what this test is about
    monkeypatch.setattr(status_cmd, "STATUS_ETCD_TIMEOUT_S", 2.0)
    rc = main(["status", "--topology", str(topo_file)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "did not answer" in err and "Is etcd running?" in err
    assert "Traceback" not in err


SECURE = """\
network: {bind: 10.0.0.0/8}
queue: {wire: node}
security:
  tls: {cert: decode.pem, key: decode-key.pem, client_ca: ca.pem}
  api_keys: {file: keys.txt}
ray: {auth: token, token_file: ray-token}
"""


def secure_topology(tmp_path, extra: str = SECURE):
    for name in ("decode.pem", "decode-key.pem", "ca.pem", "keys.txt"):
        (tmp_path / name).write_text("placeholder\n")  # status reads none of them
    (tmp_path / "ray-token").write_text("f" * 64)
    path = tmp_path / "topology.yaml"
    path.write_text(small_topology_yaml("status-security", tmp_path).replace("etcd: {lease_ttl_s: 3}\n", "") + extra)
    return path


def test_status_shows_which_surfaces_are_protected_and_how(tmp_path, monkeypatch, capsys):
    import json

    topo_file = secure_topology(tmp_path)
    topo = load_topology(topo_file)
    ClusterState(cluster=topo.cluster, topology=str(topo_file), namespace="ns", ray_address="127.0.0.1:1",
                 ray_head_pid=None, etcd_endpoints=[f"127.0.0.1:{free_port()}"], etcd_pid=None,
                 queue_name="q", model="m").save(state_path(topo))
    # Neither Ray (nor this process's Ray settings: the topology asks for token auth) is in play.
    monkeypatch.setattr(status_cmd, "_queue_stats_as", lambda topo, state: None)
    monkeypatch.setattr(status_cmd, "STATUS_ETCD_TIMEOUT_S", 1.0)
    main(["status", "--topology", str(topo_file)])  # etcd is down: membership unknown, security still shown
    out = capsys.readouterr().out
    line = lambda name: next(ln for ln in out.splitlines() if ln.startswith(f"  {name} "))  # noqa: E731
    assert " yes " in line("decode gRPC/HTTP") and "mutual TLS" in line("decode gRPC/HTTP")
    assert "API keys (keys.txt)" in line("decode gRPC/HTTP") and "/health" in line("decode gRPC/HTTP")
    assert " no " in line("etcd") and line("etcd").endswith("[set etcd.tls]")
    assert " partly " in line("prefill queue wire") and line("prefill queue wire").endswith("[set queue.tls]")
    assert " yes " in line("Ray") and "ray.token_file" in line("Ray")
    assert " no " in line("NIXL data plane") and "private" in line("NIXL data plane")

    main(["status", "--topology", str(topo_file), "--json"])
    security = {s["name"]: s for s in json.loads(capsys.readouterr().out)["security"]}
    assert security["Ray"]["protected"] == "yes" and security["etcd"]["setting"] == "etcd.tls"
    assert security["NIXL data plane (KV pages)"]["protected"] == "no"


def test_surfaces_served_beyond_loopback_without_protection_are_warned_about(tmp_path):
    from pdserve.protection import exposure_warnings

    open_topo = load_topology(secure_topology(tmp_path, "network: {bind: 10.0.0.0/8}\nqueue: {wire: node}\n"))
    warnings = exposure_warnings(open_topo)
    for setting in ("security.tls", "etcd.tls", "ray.auth: token", "queue.tls"):
        assert sum(setting in w for w in warnings) == 1, (setting, warnings)
    assert exposure_warnings(load_topology(secure_topology(tmp_path, ""))) == []  # loopback: nothing to warn
    # TLS and Ray token set: only the plaintext etcd (embedded at the bound address) and the queue remain.
    secure = exposure_warnings(load_topology(secure_topology(tmp_path)))
    assert len(secure) == 2 and "etcd.tls" in secure[0] and "queue.tls" in secure[1]
    # A loopback cluster that joins Ray on another host: Ray is exposed, the rest is not.
    assert [w for w in exposure_warnings(load_topology(secure_topology(tmp_path, "")), "10.0.0.5:6379")
            if "ray.auth" in w]


def test_the_ranks_column_shows_a_workers_tensor_parallel_size_and_pool_layout():
    from pdserve.status_cmd import tp_ranks

    assert tp_ranks({"kv_layout": {"tensor_parallel_size": 2, "kv_layout": "HND"}}) == "2 HND"
    assert tp_ranks({"kv_layout": {"tensor_parallel_size": 1, "kv_layout": "HND"}}) == "1 HND"
    assert tp_ranks({"kv_layout": {"tensor_parallel_size": 1, "kv_layout": "NHD"}}) == "1"
    assert tp_ranks({"kv_layout": {}}) == "1"  # a worker of an older version


def test_each_worker_shows_its_family_kv_dtype_and_layout():
    from pdserve.status_cmd import kv_summary

    fp8 = {"kv_layout": {"model_id": "qwen3-moe-tiny", "architecture": "qwen3_moe", "dtype": "bfloat16",
                         "kv_dtype": "float8_e4m3fn", "kv_cache_dtype": "fp8_e4m3", "kv_layout": "HND",
                         "block_size": 16}}
    assert kv_summary(fp8) == ("model qwen3-moe-tiny: family qwen3_moe, KV float8_e4m3fn (fp8_e4m3), layout HND, "
                               "blocks of 16 tokens")
    plain = {"kv_layout": {"model_id": "m", "architecture": "llama", "dtype": "float32", "kv_dtype": "float32",
                           "kv_cache_dtype": "auto", "kv_layout": "NHD", "block_size": 16}}
    assert kv_summary(plain) == "model m: family llama, KV float32, layout NHD, blocks of 16 tokens"
    assert kv_summary({"kv_layout": {}}) == ""  # a record without a pool's layout
