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


def pytest_collection_modifyitems(config, items):
    if _WHY_NOT is None:
        return
    skip = pytest.mark.skip(reason=f"multi-host tests {_WHY_NOT}")
    for item in items:
        if item.path.parent == HERE:
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
