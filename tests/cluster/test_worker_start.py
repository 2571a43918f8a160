"""The shared worker start-up: one role config base, the launcher's config dicts, joining the cluster."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
from pathlib import Path

import pytest

from pdserve.cluster import keys
from pdserve.cluster.join import join_cluster, leave_cluster
from pdserve.cluster.records import WorkerInfo
from pdserve.cluster.registry import RegistrationState, Registry
from pdserve.cluster.topology import load_topology
from pdserve.cluster.worker_config import WorkerConfig, launch_config
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.prefill.worker import PrefillWorkerConfig
from tests.harness import small_topology_yaml

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

# The keys the launcher passed before the shared config existed: a topology deployed
# today must keep reaching the workers under these names.
LAUNCH_KEYS = {"model", "engine_args", "worker_id", "cluster", "etcd_endpoints", "lease_ttl_s", "queue_name",
               "queue_namespace", "freeze_gc"}
PREFILL_KEYS = LAUNCH_KEYS | {"batch_max_tokens", "poll_timeout_ms", "exit_on_loop_death", "metrics_port"}
DECODE_KEYS = LAUNCH_KEYS | {"grpc_port", "http_port", "router_policy", "served_model_name", "remote_prefill",
                             "exit_on_engine_death"}


@pytest.fixture
def topology(tmp_path):
    path = tmp_path / "topology.yaml"
    text = small_topology_yaml("start-up", tmp_path, ROOT / "configs" / "router" / "default.yaml")
    text = text.replace("ports: {grpc: 0, http: 0}", "ports: {grpc: 50100, http: 0}").replace(
        "    resources: {num_cpus: 1}\n    engine", "    resources: {num_cpus: 1}\n    ports: {metrics: 9400}\n    engine", 1)
    path.write_text(text)
    return load_topology(path)


def test_both_role_configs_extend_the_one_base_and_its_defaults_come_from_keys():
    shared = {f.name for f in dataclasses.fields(WorkerConfig)}
    for role_cfg in (DecodeWorkerConfig, PrefillWorkerConfig):
        assert issubclass(role_cfg, WorkerConfig)
        own = {f.name for f in dataclasses.fields(role_cfg)} - shared
        assert not own & shared
    cfg = WorkerConfig(model="m")
    assert (cfg.queue_name, cfg.queue_namespace) == (keys.DEFAULT_QUEUE_NAME, keys.DEFAULT_NAMESPACE)
    assert cfg.worker_id_for("decode").startswith("decode-")
    assert WorkerConfig(model="m", worker_id="w").worker_id_for("decode") == "w"
    made = PrefillWorkerConfig.of({"model": "m", "layerwise": False})
    assert isinstance(made, PrefillWorkerConfig) and not made.layerwise
    assert PrefillWorkerConfig.of(made) is made


def test_version_is_defined_once_in_keys():
    for rel in ("decode/worker.py", "prefill/worker.py"):
        tree = ast.parse((ROOT / rel).read_text())
        assigned = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
        assert "VERSION" not in assigned, f"{rel} defines VERSION again: use pdserve.cluster.keys.VERSION"


def test_launch_configs_keep_every_key_and_build_the_role_configs(topology):
    prefill = launch_config(topology, "prefill", 0, model="/m", etcd_endpoints=["127.0.0.1:2379"])
    decode = launch_config(topology, "decode", 1, model="/m", etcd_endpoints=["127.0.0.1:2379"])
    assert PREFILL_KEYS <= set(prefill) and DECODE_KEYS <= set(decode)
    assert prefill["worker_id"] == "prefill-0" and decode["worker_id"] == "decode-1"
    assert prefill["queue_name"] == decode["queue_name"] == topology.queue.name
    assert prefill["queue_namespace"] == topology.ray.namespace
    assert prefill["freeze_gc"] and prefill["exit_on_loop_death"] and decode["exit_on_engine_death"]
    assert prefill["metrics_port"] == 9400 and prefill["batch_max_tokens"] == topology.queue.batch_max_tokens
    assert (decode["grpc_port"], decode["http_port"]) == (50101, 0)  # base + replica; 0 = any free port
    assert decode["remote_prefill"] and decode["router_policy"] == str(topology.router_policy_path)
    assert prefill["engine_args"] == dict(topology.roles.prefill.engine)
    PrefillWorkerConfig.of(prefill)
    DecodeWorkerConfig.of(decode)


async def test_join_registers_clears_a_stale_drain_and_follows_drain_requests(etcd, cluster_name):
    cfg = WorkerConfig(model="m", cluster=cluster_name, etcd_endpoints=[etcd.endpoint], lease_ttl_s=2.0)
    info = WorkerInfo(worker_id="p0", role="prefill", version=keys.VERSION)
    drained = asyncio.Event()

    async def on_drain():
        drained.set()

    async with Registry(etcd.endpoint, cluster_name) as operator:
        await operator.client().put(operator.keys.drain("p0"), b"left over from an earlier run")
        registry = await join_cluster(cfg, info, b"nixl-bytes", on_drain=on_drain)
        try:
            assert registry.state is RegistrationState.REGISTERED
            assert set(await operator.members("prefill")) == {"p0"}
            assert await operator.get_nixl_metadata("p0") == b"nixl-bytes"
            await asyncio.sleep(0.3)
            assert not drained.is_set()  # the stale request was cleared, not obeyed
            assert await operator.request_drain("p0")
            await asyncio.wait_for(drained.wait(), 10)
            await leave_cluster(registry, "prefill worker p0")
            assert registry.state is RegistrationState.DEREGISTERED
            assert await operator.members("prefill") == {}
        finally:
            await registry.close()


async def test_join_needs_etcd_endpoints():
    with pytest.raises(ValueError, match="needs etcd_endpoints"):
        await join_cluster(WorkerConfig(model="m"), WorkerInfo(worker_id="p0", role="prefill"), on_drain=None)


def test_a_restarted_actor_starts_once_when_its_own_start_call_arrives_twice(monkeypatch):
    """Ray can deliver a restarted actor's call to its own start() twice (a delivery reported
    failed while the actor read as RESTARTING had run, and was resent): the second one must not
    start a second engine beside the first (cluster/actors.py `restartable`)."""
    import types

    import ray

    from pdserve.cluster.actors import restartable

    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(was_current_actor_reconstructed=False))

    class Worker:
        def __init__(self, cfg):
            self.starts = 0

        async def start(self):
            self.starts += 1
            await asyncio.sleep(0.01)  # the second delivery arrives while the first is loading

    worker = restartable(Worker)({})

    async def twice():
        await asyncio.gather(worker._start_after_restart(), worker._start_after_restart())

    asyncio.run(twice())
    assert worker.starts == 1
