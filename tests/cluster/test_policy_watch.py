"""Policy distribution through etcd: validate, then swap or keep the old one."""

from __future__ import annotations

import asyncio

import pydantic
import pytest
import yaml

from pdserve.cluster.registry import Registry
from pdserve.cluster.watch import PolicyRejection

pytestmark = pytest.mark.timeout(120)  # any hang fails fast, not after the suite-wide 600 s
FAST = dict(backoff_initial_s=0.05, backoff_max_s=0.5, request_timeout_s=2.0)


class ToyRouterPolicy(pydantic.BaseModel):
    """Stands in for the router package's schema (cluster must not import it)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    policy: str = "threshold"
    prefill_length_threshold: int = pydantic.Field(256, ge=0)


def validate_router(yaml_text: str) -> ToyRouterPolicy:
    """What a receiver passes: raise with a message naming the key, or return the policy."""
    try:
        return ToyRouterPolicy.model_validate(yaml.safe_load(yaml_text) or {})
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


async def until(predicate, timeout_s: float = 5.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


async def test_policy_update_reaches_the_watcher(etcd, cluster_name):
    changes: list[ToyRouterPolicy] = []
    async with Registry(etcd.endpoint, cluster_name, **FAST) as operator, \
            Registry(etcd.endpoint, cluster_name, **FAST) as worker:
        await operator.put_policy("router", "prefill_length_threshold: 128\n")
        watch = await worker.watch_policy("router", validate_router, on_change=changes.append)
        await watch.wait_synced()
        assert watch.current == ToyRouterPolicy(prefill_length_threshold=128)  # existing version applied

        revision = await operator.put_policy("router", "prefill_length_threshold: 512\n")
        await until(lambda: watch.revision == revision)
        assert watch.current.prefill_length_threshold == 512
        assert [c.prefill_length_threshold for c in changes] == [128, 512]
        assert await worker.get_policy("router") == "prefill_length_threshold: 512\n"


async def test_invalid_policy_is_refused_naming_the_key_and_the_old_one_stays(etcd, cluster_name):
    rejections: list[PolicyRejection] = []
    async with Registry(etcd.endpoint, cluster_name, **FAST) as operator, \
            Registry(etcd.endpoint, cluster_name, **FAST) as worker:
        good_revision = await operator.put_policy("router", "prefill_length_threshold: 300\n")
        watch = await worker.watch_policy("router", validate_router, on_reject=rejections.append)
        await watch.wait_synced()

        await operator.put_policy("router", "prefill_length_threshold: -5\n")
        await operator.put_policy("router", "prefil_length_treshold: 10\n")
        await until(lambda: len(rejections) == 2)

        assert watch.current == ToyRouterPolicy(prefill_length_threshold=300)
        assert watch.revision == good_revision
        assert "prefill_length_threshold" in rejections[0].reason
        assert "prefil_length_treshold" in rejections[1].reason
        assert f"keeping revision {good_revision}" in str(rejections[1])
        assert watch.last_rejection == rejections[1]

        # A later valid version is accepted again.
        await operator.put_policy("router", "prefill_length_threshold: 64\n")
        await until(lambda: watch.current.prefill_length_threshold == 64)


async def test_policies_are_per_kind_and_the_kind_is_checked(etcd, cluster_name):
    async with Registry(etcd.endpoint, cluster_name, **FAST) as reg:
        await reg.put_policy("autoscale", "min_replicas: 1\n")
        assert await reg.get_policy("router") is None
        raw = await reg.client().get(f"/pdserve/{cluster_name}/config/autoscale".encode())
        assert raw.value == b"min_replicas: 1\n" and raw.lease == 0  # not leased: outlives workers
        with pytest.raises(ValueError, match="kind"):
            await reg.put_policy("planner", "x: 1\n")
