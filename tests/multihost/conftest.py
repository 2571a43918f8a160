"""The multi-host suite: hosts are network namespaces made by the test (tests/multihost/netns.py).

Needs root and iproute2 (CI runs as root); skipped with the reason otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# Spawned children import these helpers by module name; they inherit sys.path.
sys.path[:0] = [str(HERE), str(HERE.parent / "kvtransfer")]

from pdserve.bench.netns import Network, unavailable  # noqa: E402

_WHY_NOT = unavailable()


# Modules whose hosts run sshd (`ray up` reaches hosts over SSH and syncs with rsync).
_NEED_SSH = {"test_ray_up.py", "test_cluster_across_hosts.py"}


def _why_no_ssh() -> str | None:
    import shutil

    if not (shutil.which("sshd") or Path("/usr/sbin/sshd").exists()):
        return "sshd is not installed (Debian package openssh-server; `make test` installs it as root: tests/prereqs.sh)"
    if not shutil.which("rsync"):
        return "rsync is not installed (`make test` installs it as root: tests/prereqs.sh)"
    return None


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if item.path.parent == HERE]
    if not ours:
        return
    if _WHY_NOT is not None:
        skip = pytest.mark.skip(reason=f"multi-host tests {_WHY_NOT}")
        for item in ours:
            item.add_marker(skip)
        return
    why = _why_no_ssh()
    if why is not None:
        skip = pytest.mark.skip(reason=f"multi-host tests over SSH: {why}")
        for item in ours:
            if item.path.name in _NEED_SSH:
                item.add_marker(skip)


@pytest.fixture
def network_factory():
    """Make a Network of named hosts; every one made is torn down after the test."""
    made: list[Network] = []

    def make(*hosts: str) -> Network:
        net = Network(list(hosts)).__enter__()
        made.append(net)
        return net

    yield make
    for net in made:
        net.close()
