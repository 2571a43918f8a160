"""Fixtures for the kvtransfer tests: real NIXL agents in spawned child processes."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest

# Spawned children import the harness by module name; they inherit sys.path.
sys.path.insert(0, str(Path(__file__).parent))

from kvt_peer import PeerProcess  # noqa: E402


@pytest.fixture(scope="session")
def spawn_ctx():
    return multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def peers(spawn_ctx):
    """Two prefill-side senders and one decode-side receiver, shared by a test module.

    Teardown asserts that every child closed its agent and exited with code 0.
    """
    procs = {label: PeerProcess(spawn_ctx, label) for label in ("p0", "p1", "d0")}
    yield procs
    exit_codes = {label: proc.stop() for label, proc in procs.items()}
    assert exit_codes == {label: 0 for label in procs}, f"child exit codes: {exit_codes}"
