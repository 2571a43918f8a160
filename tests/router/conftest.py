"""Shared builders for router tests: a policy from plain dicts, seed costs,
a snapshot and request with the fields a test cares about."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pdserve.router.costs import CostEstimates
from pdserve.router.policy import RouterPolicy
from pdserve.router.values import ClusterSnapshot, RequestFeatures

KV_BYTES_PER_TOKEN = 128 * 1024


def make_policy(router: dict | None = None, qos: dict | None = None) -> RouterPolicy:
    return RouterPolicy.model_validate({"router": router or {}, "qos": qos or {}})


def seed_costs(policy: RouterPolicy, **changes) -> CostEstimates:
    """The policy's seed costs, except that a step's fixed and per-stream parts are 0 unless a
    test sets them: a local prefill then costs exactly eff_len x prefill_local_ms_per_token,
    which keeps the arithmetic of most tests simple (tests of the step curve set them)."""
    costs = CostEstimates.seed(policy.router.cost_model, KV_BYTES_PER_TOKEN)
    changes.setdefault("step_fixed_ms", 0.0)
    changes.setdefault("step_decode_ms_per_seq", 0.0)
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
