"""A TP worker is one Ray placement group: STRICT_PACK, one bundle per rank.

Real local Ray with four declared GPUs (Ray's accounting needs no device): `start_worker_actor`
creates the group, the worker's actor takes bundle 0, and `claim_rank_devices` gives rank r the
GPU of bundle r through CUDA_VISIBLE_DEVICES (rank r runs on cuda:r). Stopping the worker removes
the group; a worker Ray restarts claims its ranks' GPUs again."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pdserve.cluster.actors import (
    actor_name,
    rank_bundles,
    ranks_group_name,
    remove_ranks_group,
    start_worker_actor,
    stop_actor,
)
from pdserve.cluster.topology import load_topology
from tests.harness import small_topology_yaml, start_local_ray

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "pdserve-rank-placement"


@pytest.fixture(scope="module")
def ray_gpus():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_local_ray(NAMESPACE, num_gpus=4, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray
    ray.shutdown()


def topology(tmp_path, tp: int, num_gpus: int):
    text = small_topology_yaml("ranks", tmp_path).replace(
        "  prefill:\n    replicas: 1\n    resources: {num_cpus: 1}\n",
        f"  prefill:\n    replicas: 1\n    tensor_parallel_size: {tp}\n    entrypoint: tests.cluster.rank_probe:RankProbe\n"
        f"    resources: {{num_cpus: 1, num_gpus: {num_gpus}}}\n", 1)
    text += f"ray: {{namespace: {NAMESPACE}}}\n"
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    return load_topology(path)


def group_table(ray, actor: str) -> dict | None:
    from ray.util.placement_group import get_placement_group, placement_group_table

    try:
        table = placement_group_table(get_placement_group(ranks_group_name(actor)))
    except ValueError:
        return None
    return None if table["state"] == "REMOVED" else table


def wait_for(cond, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return got


def test_rank_bundles_share_the_role_out_and_bundle_0_places_the_worker():
    assert rank_bundles(2, 4, 2, {"node:10.0.0.2": 0.01}) == [{"CPU": 1, "GPU": 2, "node:10.0.0.2": 0.01},
                                                             {"CPU": 1, "GPU": 2}]
    assert rank_bundles(4, 0, 4, {}) == [{"CPU": 1}] * 4
    assert rank_bundles(0, 0, 2, {}) == [{"CPU": 0.01}, {"CPU": 0.01}]  # Ray refuses an all-zero bundle


def test_a_tp2_worker_is_one_strict_pack_group_whose_ranks_hold_distinct_gpus(ray_gpus, tmp_path):
    ray = ray_gpus
    topo = topology(tmp_path, tp=2, num_gpus=2)
    names = []
    try:
        started = [start_worker_actor(topo, "prefill", i, model="/m", etcd_endpoints=["127.0.0.1:1"]) for i in (0, 1)]
        names = [s.name for s in started]
        placed = ray.get([s.start_ref for s in started], timeout=120)
        for s, got in zip(started, placed):
            table = group_table(ray, s.name)
            assert table is not None and table["strategy"] == "STRICT_PACK", table
            assert list(table["bundles"].values()) == [{"CPU": 0.5, "GPU": 1.0}] * 2, table
            assert got["group"] == table["placement_group_id"], (got, table)
            ranks = got["cuda_visible_devices"].split(",")
            assert len(ranks) == 2 and len(set(ranks)) == 2, got
            assert ranks[0] == got["gpu_ids"][0], got  # rank 0 (this actor) on bundle 0's GPU
        both = [d for got in placed for d in got["cuda_visible_devices"].split(",")]
        assert sorted(both) == ["0", "1", "2", "3"], placed  # four ranks, four GPUs, none shared
        assert ray.available_resources().get("GPU", 0) == 0

        # Killed with a restart allowed: Ray brings the actor back in bundle 0 and it claims again.
        first = placed[0]
        ray.kill(started[0].actor, no_restart=False)
        again = wait_for(lambda: _placement_after_restart(ray, started[0].name, first["pid"]),
                         "the restarted worker to claim its ranks' GPUs", 120)
        assert sorted(again["cuda_visible_devices"].split(",")) == sorted(first["cuda_visible_devices"].split(",")), \
            (first, again)

        for name in names:
            stop_actor(name, NAMESPACE, 10, lambda _line: None)
            assert group_table(ray, name) is None
        wait_for(lambda: ray.available_resources().get("GPU", 0) == 4, "the groups' GPUs to be free", 60)
    finally:
        for name in names:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:
                pass
            remove_ranks_group(name)


def _placement_after_restart(ray, name: str, old_pid: int) -> dict | None:
    try:
        got = ray.get(ray.get_actor(name, namespace=NAMESPACE).placement.remote(), timeout=10)
    except Exception:  # noqa: BLE001  (still restarting)
        return None
    if got["pid"] == old_pid or not got["cuda_visible_devices"] or "," not in got["cuda_visible_devices"]:
        return None
    return got


def test_a_worker_whose_name_is_taken_leaves_no_group(ray_gpus, tmp_path):
    ray = ray_gpus
    topo = topology(tmp_path, tp=2, num_gpus=2)
    first = start_worker_actor(topo, "prefill", 0, model="/m", etcd_endpoints=["127.0.0.1:1"])
    try:
        ray.get(first.start_ref, timeout=120)
        with pytest.raises(ValueError, match="exists already"):
            start_worker_actor(topo, "prefill", 0, model="/m", etcd_endpoints=["127.0.0.1:1"])
        assert group_table(ray, first.name) is not None  # the running worker's group is untouched
    finally:
        stop_actor(first.name, NAMESPACE, 10, lambda _line: None)
    assert group_table(ray, actor_name(topo.cluster, "prefill-0")) is None
