"""Fixtures for control-plane tests: a real etcd child process (plaintext, or TLS with client
certificates and RBAC), a local Ray, unique cluster names."""

from __future__ import annotations

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


class SecureEtcd:
    """A TLS etcd with client-certificate auth and RBAC, as `pdserve up` starts one: the
    certificates `pdserve certs make` writes, and a bootstrap per cluster (`grant`)."""

    def __init__(self, server: EmbeddedEtcd, certs: dict):
        self.server = server
        self.certs = certs
        self.endpoint = server.endpoint

    def identity(self, name: str, cert: str | None = None):
        """The EtcdTLS of identity `name` (root, operator, worker); `cert`: another of the
        certificates by its `certs make` name (e.g. "client": signed by the CA, not a user)."""
        from pdserve.cluster.etcd_auth import EtcdTLS

        stem = cert or f"etcd-{name}"
        return EtcdTLS(ca_file=str(self.certs["ca"]), cert_file=str(self.certs[stem]),
                       key_file=str(self.certs[f"{stem}-key"]), identity=name, setting=f"etcd.tls.{name}")

    async def grant(self, cluster: str) -> None:
        """Users, roles and grants for `cluster`, authentication on (idempotent)."""
        from pdserve.cluster.etcd_auth import bootstrap_rbac

        await bootstrap_rbac(self.endpoint, self.identity("root"), [cluster])


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory):
    """One TLS + RBAC etcd per test module, on loopback; stopped however the module ends."""
    from pdserve.certs import make_certs
    from pdserve.cluster.etcd_server import EtcdServerTLS

    root = tmp_path_factory.mktemp("secure-etcd")
    certs = make_certs(root / "certs", ["127.0.0.1", "localhost"])
    tls = EtcdServerTLS(cert_file=str(certs["etcd"]), key_file=str(certs["etcd-key"]), ca_file=str(certs["ca"]))
    with EmbeddedEtcd(root / "data", tls=tls) as server:
        yield SecureEtcd(server, certs)


@pytest.fixture
def cluster_name(request) -> str:
    """A cluster name unique to this test, so tests sharing an etcd never collide."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40].strip("-")
    return f"{stem}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray per test module (start-up costs ~2.5 s on 2 cores)."""
    import ray

    from tests.harness import start_local_ray

    start_local_ray("pdserve-tests")
    yield
    ray.shutdown()
