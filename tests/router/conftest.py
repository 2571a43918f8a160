"""Shared builders for router tests: a policy from plain dicts, seed costs,
a snapshot and request with the fields a test cares about."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pdserve.router.costs import CostEstimates
from pdserve.router.decide import ClusterSnapshot, RequestFeatures
from pdserve.router.policy import RouterPolicy

KV_BYTES_PER_TOKEN = 128 * 1024


def make_policy(router: dict | None = None, qos: dict | None = None) -> RouterPolicy:
    return RouterPolicy.model_validate({"router": router or {}, "qos": qos or {}})


def seed_costs(policy: RouterPolicy, **changes) -> CostEstimates:
    costs = CostEstimates.seed(policy.router.cost_model, KV_BYTES_PER_TOKEN)
    return dataclasses.replace(costs, **changes)


def snap(policy: RouterPolicy, costs: CostEstimates | None = None, **fields) -> ClusterSnapshot:
    fields.setdefault("prefill_pool_size", 2)
    return ClusterSnapshot(costs=costs or seed_costs(policy), **fields)


def req(prompt_len: int, **fields) -> RequestFeatures:
    return RequestFeatures(prompt_len=prompt_len, **fields)


@pytest.fixture
def rt() -> SimpleNamespace:
    """The builders above as ``rt.policy``, ``rt.snap``, ``rt.req``, ``rt.costs``
    (test modules cannot import conftest under --import-mode=importlib)."""
    return SimpleNamespace(policy=make_policy, snap=snap, req=req, costs=seed_costs)
