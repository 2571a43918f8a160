"""KV pages cross a real link: NIXL agents on two namespace hosts, UCX over TCP on eth0.

The hosts share one kernel (and /dev/shm), so without the TCP-only UCX settings
the transfer could take a shared-memory shortcut; the link's own byte counters
prove the pages went over the wire.
"""

from __future__ import annotations

import multiprocessing

import pytest
from kvt_peer import PeerProcess, assert_pool_equal, connect, expected_pool, llama8b, mapping, open_agent, snapshot
from pdserve.bench.netns import TCP_UCX_ENV

WRITE_TIMEOUT_S = 30.0


@pytest.fixture
def two_hosts(network_factory):
    net = network_factory("prefill", "decode")
    ctx = multiprocessing.get_context("spawn")
    procs = {name: PeerProcess(ctx, name, netns=net[name].netns, ucx_env=TCP_UCX_ENV)
             for name in ("prefill", "decode")}
    yield net, procs
    codes = {name: p.stop(30) if not p.stopped else 0 for name, p in procs.items()}
    assert all(c in (0, None) or c < 0 for c in codes.values()), codes


def test_pages_cross_the_link_byte_exact(two_hosts):
    net, procs = two_hosts
    p, d = procs["prefill"], procs["decode"]
    layout = llama8b("float16", 24)  # 2 MiB per block across 32 layers
    open_agent(p, layout, seed=21)
    open_agent(d, layout, seed=22)
    receiver = connect(p, d)
    local, remote = mapping("scattered", 12, 24, 24, seed=5)
    tx0, rx0 = net["prefill"].link_stats()["tx_bytes"], net["decode"].link_stats()["rx_bytes"]

    reply = p.ok("write", peer=receiver, local=local, remote=remote, timeout_s=WRITE_TIMEOUT_S)

    assert reply["num_bytes"] == 12 * 32 * layout.block_bytes
    assert_pool_equal(snapshot(d), expected_pool((layout, 22), [(layout, 21, local, remote)]))
    sent = net["prefill"].link_stats()["tx_bytes"] - tx0
    got = net["decode"].link_stats()["rx_bytes"] - rx0
    assert sent >= reply["num_bytes"] and got >= reply["num_bytes"], (sent, got, reply["num_bytes"])


def test_a_pulled_link_fails_the_write_with_a_typed_error(two_hosts):
    net, procs = two_hosts
    p, d = procs["prefill"], procs["decode"]
    layout = llama8b("float16", 8)
    open_agent(p, layout, seed=1)
    open_agent(d, layout, seed=2)
    receiver = connect(p, d)
    p.send("write_until_error", peer=receiver, local=[0, 1, 2, 3], remote=[4, 5, 6, 7], timeout_s=3.0, max_s=60.0)
    assert p.receive()["event"] == "writing"  # one write went through: the link works
    net["prefill"].link(up=False)
    reply = p.receive(90)
    assert reply["ok"] and reply["writes_ok"] >= 1
    assert reply["error"] in ("TransferTimeoutError", "TransferError"), reply
