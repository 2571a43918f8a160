"""Ray's token authentication from the topology (`ray.auth: token`, pdserve/ray_auth.py): the
settings, and a real Ray head started the way `pdserve up` starts it, which refuses a caller
without the token and serves one with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from pdserve.cluster.topology import TopologyError, load_topology
from pdserve.launcher import ClusterState, Launcher
from pdserve.ray_auth import RayAuthError, child_env, ray_auth_env, token_source
from tests.harness import small_topology_yaml

pytestmark = pytest.mark.timeout(120)
TOKEN = "5f0c9a7e1b2d4c6e8f0a1b3c5d7e9f1a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e"  # test-only, 64 hex digits


def topology(tmp_path, ray: str = "ray: {auth: token, token_file: ray-token}\n", token: str | None = TOKEN):
    if token is not None:
        (tmp_path / "ray-token").write_text(token + "\n")
    path = tmp_path / "topology.yaml"
    path.write_text(small_topology_yaml("ray-auth", tmp_path) + ray)
    return path


def test_token_auth_reads_the_token_file_and_the_file_wins_over_an_exported_token(tmp_path):
    topo = load_topology(topology(tmp_path))
    env = ray_auth_env(topo.ray, topo.resolve, {"RAY_AUTH_TOKEN": "x" * 32})
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "ray-token"), "RAY_AUTH_TOKEN": ""}
    child = child_env(topo, {"RAY_AUTH_TOKEN": "x" * 32, "PATH": "/bin"})
    assert "RAY_AUTH_TOKEN" not in child and child["RAY_AUTH_MODE"] == "token"
    assert token_source(topo.ray, topo.resolve) == f"ray.token_file {tmp_path / 'ray-token'}"


def test_auth_stays_as_the_environment_says_by_default(tmp_path):
    topo = load_topology(topology(tmp_path, ray=""))
    assert ray_auth_env(topo.ray, topo.resolve, {}) == {"RAY_AUTH_MODE": "disabled"}
    assert ray_auth_env(topo.ray, topo.resolve, {"RAY_AUTH_MODE": "token"}) == {"RAY_AUTH_MODE": "token"}


@pytest.mark.parametrize("ray, token, error", [
    ("ray: {auth: token, token_file: ray-token}\n", None, "ray.token_file: file 'ray-token' not found"),
    ("ray: {token_file: ray-token}\n", TOKEN, "ray.auth: token or remove ray.token_file"),
    ("ray: {auth: tokens}\n", None, "ray.auth"),
])
def test_a_wrong_ray_auth_setting_is_refused_naming_it(tmp_path, ray, token, error):
    with pytest.raises(TopologyError, match=error):
        load_topology(topology(tmp_path, ray=ray, token=token))


def test_an_empty_token_file_or_no_token_at_all_is_an_error_naming_the_setting(tmp_path, monkeypatch):
    topo = load_topology(topology(tmp_path, token=""))
    with pytest.raises(RayAuthError, match="ray.token_file: the Ray token file .* holds nothing"):
        ray_auth_env(topo.ray, topo.resolve, {})
    bare = load_topology(topology(tmp_path, ray="ray: {auth: token}\n"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token either
    with pytest.raises(RayAuthError, match="set ray.token_file"):
        ray_auth_env(bare.ray, bare.resolve, {})
    assert ray_auth_env(bare.ray, bare.resolve, {"RAY_AUTH_TOKEN": TOKEN}) == {"RAY_AUTH_MODE": "token"}


def test_a_head_started_with_token_auth_refuses_callers_without_the_token(tmp_path):
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    topo_file = topology(tmp_path)
    topo = load_topology(topo_file)
    state = ClusterState(cluster=topo.cluster, topology=str(topo_file), namespace="ns", ray_address="",
                         ray_head_pid=None, etcd_endpoints=[], etcd_pid=None, queue_name="q", model="m")
    Launcher(topo, str(topo_file), "m", progress=lambda line: None)._start_ray(state, tmp_path)
    try:
        with grpc.insecure_channel(state.ray_address) as channel:
            gcs = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            ask = lambda metadata: gcs.GetClusterId(gcs_service_pb2.GetClusterIdRequest(),  # noqa: E731
                                                    timeout=10, metadata=metadata)
            for metadata in (None, [("authorization", "Bearer " + "0" * 64)], [("authorization", TOKEN)]):
                with pytest.raises(grpc.RpcError) as refused:
                    ask(metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ask([("authorization", "Bearer " + TOKEN)]).cluster_id
        # A driver as pdserve's commands run one: started with auth disabled in its environment
        # and Ray already imported, it turns token auth on from the topology, then joins and
        # runs a task (on a worker process the head spawned: it must hold the token too).
        driver = textwrap.dedent(f"""
            import ray
            from pdserve.ray_auth import apply_ray_auth
            from pdserve.cluster.topology import load_topology
            print(apply_ray_auth(load_topology({str(topo_file)!r})))
            ray.init(address={state.ray_address!r}, log_to_driver=False)
            print("task", ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60))
        """)
        out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=90,
                             env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        assert out.returncode == 0 and "task 42" in out.stdout, out.stdout + out.stderr[-3000:]
        assert "token authentication (token from ray.token_file" in out.stdout
        assert TOKEN not in out.stdout + out.stderr + (tmp_path / "ray-auth-ray.log").read_text()
    finally:
        _kill_group(state.ray_head_pid)


def _kill_group(pid: int | None, grace_s: float = 1.0) -> None:
    """SIGTERM to the head's process group, SIGKILL after `grace_s`: a test head holds nothing."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
            os.kill(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            break
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
