"""deploy/ray/*.yaml pass Ray's own cluster-config validation: the code `ray up` runs
(`prepare_config` fills Ray's defaults, `validate_config` checks Ray's JSON schema and the
node-type rules), not a hand-written schema."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from ray.autoscaler._private.util import prepare_config, validate_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "ray"


def ray_up_checks(config: dict) -> dict:
    """What `ray up` does to a config before it touches a machine (commands._bootstrap_config)."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.mark.parametrize("name", ["local.yaml", "cluster.yaml"])
def test_shipped_configs_pass_rays_validation(name):
    prepared = ray_up_checks(load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_local_config_starts_every_listed_host_and_no_machine_wide_ray_stop():
    prepared = ray_up_checks(load("local.yaml"))
    [node_type] = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(prepared["provider"]["worker_ips"])
    commands = prepared["head_start_ray_commands"] + prepared["worker_start_ray_commands"]
    assert not any(c.strip().startswith("ray stop") for c in commands)
    assert "RAY_enable_autoscaler_v2=0" in prepared["head_start_ray_commands"][0]


def test_cloud_config_places_roles_by_custom_resources():
    types = ray_up_checks(load("cluster.yaml"))["available_node_types"]
    assert types["prefill_gpu"]["resources"] == {"pdserve_prefill": 1}
    assert types["decode_gpu"]["resources"] == {"pdserve_decode": 1}
    assert types["gateway_cpu"]["resources"] == {"pdserve_gateway": 1}


def test_an_unknown_key_fails_validation():
    config = load("cluster.yaml")
    config["available_node_types"]["prefill_gpu"]["min_wokers"] = 1  # typo
    with pytest.raises(Exception, match="min_wokers"):
        ray_up_checks(config)


def test_a_missing_head_node_type_fails_validation():
    config = load("cluster.yaml")
    config["head_node_type"] = "gpu_head"  # not one of available_node_types
    with pytest.raises(ValueError, match="head_node_type"):
        ray_up_checks(config)


def test_a_local_config_without_worker_ips_fails():
    config = load("local.yaml")
    del config["provider"]["worker_ips"]
    with pytest.raises(BaseException, match="worker_ips"):
        ray_up_checks(config)
