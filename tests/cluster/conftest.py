"""Fixtures for control-plane tests: a real etcd child process, a local Ray, unique cluster names."""

from __future__ import annotations

import os
import re
import uuid

import pytest

from pdserve.cluster.etcd_server import EmbeddedEtcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """One etcd per test module; tests isolate themselves by cluster name."""
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd") / "data")
    with server:
        yield server


@pytest.fixture
def fresh_etcd(tmp_path):
    """An etcd of this test's own, for tests that stop or restart it."""
    server = EmbeddedEtcd(tmp_path / "etcd-data")
    with server:
        yield server


@pytest.fixture
def cluster_name(request) -> str:
    """A cluster name unique to this test, so tests sharing an etcd never collide."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40].strip("-")
    return f"{stem}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray per test module (start-up costs ~2.5 s on 2 cores)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="pdserve-tests")
    yield
    ray.shutdown()
