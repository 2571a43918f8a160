"""Fixtures of the decode-worker tests."""

from __future__ import annotations

import pytest

from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import PERMISSIVE_POLICY, WorkerThread, wait_until  # noqa: F401  (re-exported for the tests)


@pytest.fixture(scope="module")
def worker(llama_dir, tmp_path_factory):
    """One worker for the serving tests; QoS admits everything (QoS has its own tests)."""
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    cfg = DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 512}, router_policy=str(policy))
    w = WorkerThread(cfg).start()
    yield w
    w.stop()
