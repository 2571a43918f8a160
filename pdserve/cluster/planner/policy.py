"""The planner's autoscale policy: its schema and parser, and what the cluster derives from it.

The schema is pure policy, so it lives with the router's (router/autoscale.py), where
``pdserve policy check`` reads it too; it is parsed by router/loader.py (``parse_autoscale``,
``load_autoscale_file``) with the line-numbered errors of every YAML schema
(common/yaml_schema.py). This module names them for the planner and adds
``autoscale_max_replicas``: the worker slots a topology's policy asks for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.cluster.keys import ROLES
from pdserve.router.autoscale import AutoscalePolicy
from pdserve.router.loader import load_autoscale_file, parse_autoscale

if TYPE_CHECKING:
    from pdserve.cluster.topology import Topology

__all__ = ["AutoscalePolicy", "autoscale_max_replicas", "load_autoscale_file", "parse_autoscale"]


def autoscale_max_replicas(topology: Topology) -> dict[str, int] | None:
    """The topology's autoscale policy's max_replicas per role (None without a policy): how many
    worker slots get an etcd identity of their own (cluster/worker_config.py worker_slots)."""
    path = topology.autoscale_policy_path
    if path is None:
        return None
    policy = load_autoscale_file(path)
    return {role: getattr(policy.autoscale, role).max_replicas for role in ROLES}
