"""`ray up deploy/ray/local.yaml` brings a Ray head up in one host and worker nodes in two others."""

from __future__ import annotations

import pytest
from pdserve.bench.netns import Network
from ray_up import clean_up, ray_up


@pytest.fixture(scope="module")
def ray_cluster():
    net = Network(["head", "prefill", "decode"]).__enter__()
    cluster = None
    try:
        cluster = ray_up(net, "head", ["prefill", "decode"])
        yield cluster
    finally:
        net.close()
        clean_up(cluster, net)


def test_every_host_is_a_ray_node_at_its_own_address(ray_cluster):
    net = ray_cluster.net
    nodes = {n["ip"]: n["resources"] for n in ray_cluster.nodes()}
    assert set(nodes) == {net[h].addr for h in ("head", "prefill", "decode")}
    for ip, resources in nodes.items():
        assert resources.get(f"node:{ip}") == 1.0  # what a topology pins a role to
    assert nodes[net["head"].addr].get("pdserve_head") == 1.0  # local.yaml's head resource
