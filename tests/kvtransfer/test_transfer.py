"""Real NIXL agents in separate (spawned) processes writing KV pages over loopback.

Senders p0, p1 and receiver d0 live for the whole module (see conftest.py);
each test (re)opens the agents it needs with a layout and a pool seed, so the
test can predict every byte of the receiver's pool and compare a snapshot.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvt_peer import (
    PeerProcess,
    assert_pool_equal,
    blocks_digest,
    connect,
    expected_pool,
    llama8b,
    mapping,
    open_agent,
    seeded_pool,
    snapshot,
)

from pdserve.kvtransfer.notices import PrefillDone, decode_prefill_done
from pdserve.kvtransfer.nixl import KVLayout

SMALL_SEND = KVLayout("tiny-llama", "float16", num_layers=3, num_blocks=24, block_size=4,
                      num_kv_heads=2, head_dim=8)
SMALL_RECV = KVLayout("tiny-llama", "float16", num_layers=3, num_blocks=40, block_size=4,
                      num_kv_heads=2, head_dim=8)
WRITE_TIMEOUT_S = 10.0


# ---- byte-exact placement -------------------------------------------------


@pytest.mark.parametrize("kind", ["scattered", "reversed", "runs"])
def test_small_layout_pages_land_byte_exact(peers, kind):
    p0, d0 = peers["p0"], peers["d0"]
    open_agent(p0, SMALL_SEND, seed=1)
    open_agent(d0, SMALL_RECV, seed=2)
    receiver = connect(p0, d0)
    local, remote = mapping(kind, 12, SMALL_SEND.num_blocks, SMALL_RECV.num_blocks, seed=7)

    p0.ok("write", peer=receiver, local=local, remote=remote, timeout_s=WRITE_TIMEOUT_S)

    expected = expected_pool((SMALL_RECV, 2), [(SMALL_SEND, 1, local, remote)])
    assert_pool_equal(snapshot(d0), expected)


@pytest.mark.parametrize("kind", ["scattered", "reversed", "runs"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_llama8b_layout_pages_land_byte_exact(peers, dtype, kind):
    send_layout, recv_layout = llama8b(dtype, 32), llama8b(dtype, 48)
    p0, d0 = peers["p0"], peers["d0"]
    open_agent(p0, send_layout, seed=3)
    open_agent(d0, recv_layout, seed=4)
    receiver = connect(p0, d0)
    local, remote = mapping(kind, 24, 32, 48, seed=11)

    reply = p0.ok("write", peer=receiver, local=local, remote=remote, timeout_s=WRITE_TIMEOUT_S)

    assert reply["num_bytes"] == 24 * 32 * recv_layout.block_bytes
    expected = expected_pool((recv_layout, 4), [(send_layout, 3, local, remote)])
    assert_pool_equal(snapshot(d0), expected)


@pytest.mark.parametrize("kind", ["scattered", "runs"])
def test_a_read_brings_a_peers_pages_into_ours_byte_exact_and_notifies_it(peers, kind):
    """The other direction (a prefix lent for reading, kvtransfer/lend.py): d0 reads p0's pages
    into its own blocks; p0, polling, learns the read is over from the notification."""
    p0, d0 = peers["p0"], peers["d0"]
    open_agent(p0, SMALL_SEND, seed=5)
    open_agent(d0, SMALL_RECV, seed=6)
    holder = d0.ok("add_peer", info=p0.info)["name"]
    theirs, ours = mapping(kind, 10, SMALL_SEND.num_blocks, SMALL_RECV.num_blocks, seed=13)
    p0.send("collect", count=1, timeout_s=WRITE_TIMEOUT_S)  # the holder drives its agent meanwhile
    reply = d0.ok("read", peer=holder, local=ours, remote=theirs, notify=b"read-done", timeout_s=WRITE_TIMEOUT_S)
    notes = p0.receive()["notifications"]
    assert [n["payload"] for n in notes] == [b"read-done"]
    assert reply["num_bytes"] == 10 * SMALL_SEND.num_layers * SMALL_RECV.block_bytes
    expected = expected_pool((SMALL_RECV, 6), [(SMALL_SEND, 5, theirs, ours)])
    assert_pool_equal(snapshot(d0), expected)
    assert_pool_equal(snapshot(p0), seeded_pool(SMALL_SEND, 5))  # a read leaves the holder's pool alone


def test_runs_are_coalesced_into_one_descriptor_per_layer_and_run(peers):
    p0, d0 = peers["p0"], peers["d0"]
    open_agent(p0, SMALL_SEND, seed=1)
    open_agent(d0, SMALL_RECV, seed=2)
    receiver = connect(p0, d0)
    local, remote = [0, 1, 2, 3, 10, 11], [20, 21, 22, 23, 5, 6]

    coalesced = p0.ok("write", peer=receiver, local=local, remote=remote)
    per_block = p0.ok("write", peer=receiver, local=local, remote=remote, coalesce=False)

    assert (coalesced["num_descriptors"], per_block["num_descriptors"]) == (2 * 3, 6 * 3)
    expected = expected_pool((SMALL_RECV, 2), [(SMALL_SEND, 1, local, remote)])
    assert_pool_equal(snapshot(d0), expected)


def test_a_layer_range_writes_only_those_layers(peers):
    p0, d0 = peers["p0"], peers["d0"]
    open_agent(p0, SMALL_SEND, seed=1)
    open_agent(d0, SMALL_RECV, seed=2)
    receiver = connect(p0, d0)
    local, remote = [5, 6, 7], [30, 31, 32]

    p0.ok("write", peer=receiver, local=local, remote=remote, layers=[1, 2])

    expected = expected_pool((SMALL_RECV, 2), [(SMALL_SEND, 1, local, remote)], layers=[1, 2])
    assert_pool_equal(snapshot(d0), expected)


# ---- notifications and streaming -------------------------------------------


def test_prefill_done_arrives_after_the_pages_and_old_epochs_are_stale(peers):
    p0, d0 = peers["p0"], peers["d0"]
    layout = llama8b("float16", 48)
    open_agent(p0, layout, seed=5)
    open_agent(d0, layout, seed=6)
    receiver = connect(p0, d0)
    local, remote = mapping("runs", 16, 48, 48, seed=3)
    expected = expected_pool((layout, 6), [(layout, 5, local, remote)])
    old = PrefillDone("req-1", epoch=1, first_token_id=9, first_token_logprob=-1.5, num_tokens_written=250)
    new = PrefillDone("req-1", epoch=2, first_token_id=9, first_token_logprob=-1.5, num_tokens_written=256)

    d0.send("collect", count=2, timeout_s=WRITE_TIMEOUT_S, digest_blocks=remote)
    for message in (old, new):
        p0.ok("write", peer=receiver, local=local, remote=remote, notify=message.encode())
    collected = d0.receive()

    assert collected["digest_at_first"] == blocks_digest(expected, remote)
    assert [n["sender"] for n in collected["notifications"]] == [p0.info["name"]] * 2
    received = [decode_prefill_done(n["payload"]) for n in collected["notifications"]]
    assert received == [old, new]
    assert [m.epoch for m in received] == [1, 2]


def test_layer_stream_notifies_once_after_the_last_layer(peers):
    p0, d0 = peers["p0"], peers["d0"]
    layout = llama8b("float16", 48)
    open_agent(p0, layout, seed=7)
    open_agent(d0, layout, seed=8)
    receiver = connect(p0, d0)
    local, remote = mapping("scattered", 16, 48, 48, seed=5)
    done = PrefillDone("req-2", epoch=0, first_token_id=3, first_token_logprob=None, num_tokens_written=256)
    expected = expected_pool((layout, 8), [(layout, 7, local, remote)])

    d0.send("collect", count=1, timeout_s=WRITE_TIMEOUT_S, digest_blocks=remote)
    streamed = p0.ok("stream", peer=receiver, local=local, remote=remote, notify=done.encode())
    first = d0.receive()
    extra = d0.ok("collect", count=1, timeout_s=0.3)

    assert streamed["layers_done"] == list(range(32))
    assert [decode_prefill_done(n["payload"]) for n in first["notifications"]] == [done]
    assert first["digest_at_first"] == blocks_digest(expected, remote)  # every layer was in place
    assert extra["notifications"] == []


def test_layer_stream_with_an_unwritten_layer_sends_no_notification(peers):
    p0, d0 = peers["p0"], peers["d0"]
    open_agent(p0, SMALL_SEND, seed=1)
    open_agent(d0, SMALL_RECV, seed=2)
    receiver = connect(p0, d0)

    refused = p0.call("stream", peer=receiver, local=[1, 2], remote=[3, 4], notify=b"done",
                      skip_layers=[2])
    silence = d0.ok("collect", count=1, timeout_s=0.3)

    assert (refused["ok"], refused["error"]) == (False, "KVTransferError")
    assert "layers [2] were never written" in refused["message"]
    assert silence["notifications"] == []


def test_two_senders_write_into_one_receiver_concurrently(peers):
    p0, p1, d0 = peers["p0"], peers["p1"], peers["d0"]
    send_layout, recv_layout = llama8b("float16", 32), llama8b("float16", 48)
    open_agent(p0, send_layout, seed=10)
    open_agent(p1, send_layout, seed=11)
    open_agent(d0, recv_layout, seed=12)
    receiver = connect(p0, d0)
    assert connect(p1, d0) == receiver
    targets = np.random.default_rng(1).permutation(48)
    local0, remote0 = list(range(20)), targets[:20].tolist()
    local1, remote1 = list(range(31, 11, -1)), targets[20:40].tolist()

    d0.send("collect", count=2, timeout_s=WRITE_TIMEOUT_S)
    p0.send("write", peer=receiver, local=local0, remote=remote0, notify=b"from-p0")
    p1.send("write", peer=receiver, local=local1, remote=remote1, notify=b"from-p1")
    replies = [p0.receive(), p1.receive(), d0.receive()]

    assert all(r["ok"] for r in replies), replies
    notes = {(n["sender"], n["payload"]) for n in replies[2]["notifications"]}
    assert notes == {(p0.info["name"], b"from-p0"), (p1.info["name"], b"from-p1")}
    expected = expected_pool(
        (recv_layout, 12), [(send_layout, 10, local0, remote0), (send_layout, 11, local1, remote1)]
    )
    assert_pool_equal(snapshot(d0), expected)


# ---- failures -------------------------------------------------------------


def test_layout_mismatch_is_raised_before_any_transfer(peers):
    p0, p1 = peers["p0"], peers["p1"]
    open_agent(p0, SMALL_SEND, seed=1)
    other = KVLayout("tiny-llama", "float16", num_layers=3, num_blocks=40, block_size=4,
                     num_kv_heads=2, head_dim=16)
    open_agent(p1, other, seed=2)

    refused = p0.call("add_peer", info=p1.info)
    write = p0.call("write", peer=p1.info["name"], local=[0], remote=[0])

    assert (refused["ok"], refused["error"], refused["field"]) == (False, "LayoutMismatchError", "head_dim")
    assert (write["ok"], write["error"]) == (False, "UnknownPeerError")
    assert_pool_equal(snapshot(p1), seeded_pool(other, 2))


def test_writes_to_a_removed_peer_are_refused(peers):
    p0, d0 = peers["p0"], peers["d0"]
    open_agent(p0, SMALL_SEND, seed=1)
    open_agent(d0, SMALL_RECV, seed=2)
    receiver = connect(p0, d0)

    assert p0.ok("remove_peer", name=receiver)["removed"] is True
    refused = p0.call("write", peer=receiver, local=[0], remote=[0])

    assert (refused["ok"], refused["error"]) == (False, "UnknownPeerError")
    connect(p0, d0)  # the lease came back: usable again
    p0.ok("write", peer=receiver, local=[0], remote=[0])


def test_oversize_notification_is_refused_before_posting(peers):
    p0, d0 = peers["p0"], peers["d0"]
    open_agent(p0, SMALL_SEND, seed=1)
    open_agent(d0, SMALL_RECV, seed=2)
    receiver = connect(p0, d0)

    refused = p0.call("write", peer=receiver, local=[0], remote=[0], notify=b"x" * 1025)

    assert (refused["ok"], refused["error"]) == (False, "ValueError")
    assert_pool_equal(snapshot(d0), seeded_pool(SMALL_RECV, 2))


def test_killed_receiver_fails_the_write_and_the_sender_keeps_working(peers, spawn_ctx):
    p0, d0 = peers["p0"], peers["d0"]
    layout = llama8b("float16", 48)
    victim = PeerProcess(spawn_ctx, "victim")
    try:
        open_agent(p0, layout, seed=13)
        open_agent(victim, layout, seed=14)
        open_agent(d0, layout, seed=15)
        doomed, survivor = connect(p0, victim), connect(p0, d0)
        local, remote = list(range(32)), list(range(47, 15, -1))
        timeout_s = 5.0

        victim.send("collect", count=10**9, timeout_s=120.0)  # a live decode worker, polling
        p0.send("write_until_error", peer=doomed, local=local, remote=remote,
                timeout_s=timeout_s, max_s=60.0)
        assert p0.receive(reply_timeout_s=30.0) == {"event": "writing"}
        time.sleep(0.2)  # let writes stream; each takes milliseconds, so the kill lands inside one
        victim.kill()
        killed_at = time.monotonic()
        outcome = p0.receive(reply_timeout_s=timeout_s + 30.0)
        error_after_s = time.monotonic() - killed_at

        print(f"sender saw {outcome['error']} {error_after_s * 1e3:.1f} ms after the kill, "
              f"{outcome['writes_ok']} writes ok before: {outcome['message']}")
        assert outcome["ok"] and outcome["error"] in ("TransferError", "TransferTimeoutError"), outcome
        assert error_after_s < timeout_s + 1.0
        assert victim.proc.exitcode == -9
        p0.ok("remove_peer", name=doomed)
        p0.ok("write", peer=survivor, local=local, remote=remote, timeout_s=WRITE_TIMEOUT_S)
        expected = expected_pool((layout, 15), [(layout, 13, local, remote)])
        assert_pool_equal(snapshot(d0), expected)
    finally:
        if victim.proc.is_alive():
            victim.kill()


def test_peer_processes_close_their_agents_and_exit_with_code_zero(peers):
    exit_codes = {label: proc.stop() for label, proc in peers.items()}
    assert exit_codes == {"p0": 0, "p1": 0, "d0": 0}
