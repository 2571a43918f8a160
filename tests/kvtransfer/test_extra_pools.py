"""A pool beyond the model's (kvtransfer/nixl/pools.py: a draft model's), registered with the same
NIXL agent and written by name: real agents in spawned processes (conftest.py), every byte of
both of the receiver's pools predicted and compared."""

from __future__ import annotations

import numpy as np
import pytest
from kvt_peer import assert_pool_equal, expected_pool, mapping, seeded_pool

from pdserve.kvtransfer.nixl import KVLayout, LayoutMismatchError, MalformedMessageError, PeerInfo

SEND = KVLayout("tiny-llama", "float16", num_layers=3, num_blocks=24, block_size=4, num_kv_heads=2, head_dim=8)
RECV = KVLayout("tiny-llama", "float16", num_layers=3, num_blocks=40, block_size=4, num_kv_heads=2, head_dim=8)
# The draft: another model (one layer, one KV head of 16), its own block counts.
DRAFT_SEND = KVLayout("tiny-draft", "float16", num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=16)
DRAFT_RECV = KVLayout("tiny-draft", "float16", num_layers=1, num_blocks=30, block_size=4, num_kv_heads=1, head_dim=16)
OTHER_DRAFT = KVLayout("other-draft", "float16", num_layers=1, num_blocks=30, block_size=4, num_kv_heads=1,
                       head_dim=16)
TIMEOUT_S = 10.0
_names = iter(range(10_000))


def _open(proc, layout: KVLayout, seed: int, pools: dict | None = None) -> dict:
    """A fresh agent (never reused: its pools differ from test to test)."""
    pools = {k: (lay.to_dict(), s) for k, (lay, s) in (pools or {}).items()}
    proc.info = proc.ok("open", name=f"{proc.label}-pools-{next(_names)}", layout=layout.to_dict(), seed=seed,
                        pools=pools)["info"]
    proc.layout = None  # (kvt_peer.open_agent must not reuse it)
    return proc.info


def _snapshot(proc, layout: KVLayout, pool: str | None = None) -> np.ndarray:
    data = proc.ok("snapshot", pool=pool)["data"]
    return np.frombuffer(data, dtype=np.uint8).reshape(layout.num_layers, layout.num_blocks, -1)


def test_the_draft_pool_is_written_by_name_and_the_model_pool_untouched(peers):
    p0, d0 = peers["p0"], peers["d0"]
    _open(p0, SEND, 1, {"draft": (DRAFT_SEND, 11)})
    info = _open(d0, RECV, 2, {"draft": (DRAFT_RECV, 12)})
    assert set(info["pools"]) == {"draft"} and info["pools"]["draft"]["num_bytes"] == DRAFT_RECV.pool_bytes
    receiver = p0.ok("add_peer", info=d0.info)["name"]
    assert p0.ok("has_pool", peer=receiver, pool="draft")["has"]
    local, remote = mapping("runs", 9, DRAFT_SEND.num_blocks, DRAFT_RECV.num_blocks, seed=3)
    reply = p0.ok("write", peer=receiver, local=local, remote=remote, timeout_s=TIMEOUT_S, pool="draft")
    assert reply["num_bytes"] == 9 * DRAFT_RECV.block_bytes
    assert_pool_equal(_snapshot(d0, DRAFT_RECV, "draft"), expected_pool((DRAFT_RECV, 12), [(DRAFT_SEND, 11, local,
                                                                                            remote)]))
    assert_pool_equal(_snapshot(d0, RECV), seeded_pool(RECV, 2))  # the model's pool: not a byte moved
    # And the model's pages as before, beside it.
    local, remote = mapping("scattered", 7, SEND.num_blocks, RECV.num_blocks, seed=4)
    p0.ok("write", peer=receiver, local=local, remote=remote, timeout_s=TIMEOUT_S)
    assert_pool_equal(_snapshot(d0, RECV), expected_pool((RECV, 2), [(SEND, 1, local, remote)]))


def test_a_peer_without_the_pool_or_with_another_draft_still_takes_the_model_pages(peers):
    """The draft pool is checked when written, not when the peer is added: a receiver with no
    draft pool, or another draft model's, is refused for the draft's pages only."""
    p0, d0 = peers["p0"], peers["d0"]
    _open(p0, SEND, 5, {"draft": (DRAFT_SEND, 15)})
    for pools, field in (({}, "pools"), ({"draft": (OTHER_DRAFT, 16)}, "model_id")):
        _open(d0, RECV, 6, pools)
        receiver = p0.ok("add_peer", info=d0.info)["name"]
        assert not p0.ok("has_pool", peer=receiver, pool="draft")["has"]
        reply = p0.call("write", peer=receiver, local=[0], remote=[0], timeout_s=TIMEOUT_S, pool="draft")
        assert (reply["ok"], reply["error"], reply["field"]) == (False, "LayoutMismatchError", field), reply
        local, remote = mapping("runs", 5, SEND.num_blocks, RECV.num_blocks, seed=7)
        p0.ok("write", peer=receiver, local=local, remote=remote, timeout_s=TIMEOUT_S)
        assert_pool_equal(_snapshot(d0, RECV), expected_pool((RECV, 6), [(SEND, 5, local, remote)]))
        p0.ok("remove_peer", name=receiver)


def test_peer_records_carry_the_pools_and_older_records_still_read():
    base = {"format": "pdserve.kvtransfer.nixl.peer/1", "name": "d0", "nixl_metadata": "AAAA",
            "layout": RECV.to_dict(), "pool": {"addr": 4096, "num_bytes": RECV.pool_bytes, "mem_type": "DRAM",
                                               "device_id": 0}}
    assert PeerInfo.from_dict(base).pools == ()  # a record of a worker without pools (or an older one)
    draft = {"layout": DRAFT_RECV.to_dict(), "addr": 1 << 20, "num_bytes": DRAFT_RECV.pool_bytes}
    info = PeerInfo.from_dict({**base, "pools": {"draft": draft}})
    assert dict(info.pools)["draft"].layout == DRAFT_RECV
    assert PeerInfo.from_dict(info.to_dict()) == info and "pools" not in PeerInfo.from_dict(base).to_dict()
    for bad, why in (({"Draft!": draft}, "pool name"), ({"draft": {**draft, "num_bytes": 7}}, "bytes but its layout"),
                     ({"draft": {**draft, "addr": -1}}, "addr must be")):
        with pytest.raises(MalformedMessageError, match=why):
            PeerInfo.from_dict({**base, "pools": bad})
    with pytest.raises(LayoutMismatchError, match="model_id"):
        from pdserve.kvtransfer.nixl.pools import peer_pool

        peer_pool("d0", info.pools, "draft", OTHER_DRAFT)


def test_the_task_carries_the_draft_blocks_signed_and_the_notice_says_what_was_written():
    """A task's draft_block_ids (where the decode worker's draft wants its prompt KV) travel on
    the wire and through the queue's frames, are covered by the signature, and are left out of
    both when empty (a task without them reads and signs as before); the PrefillDone says how
    many prompt positions of the draft's KV were written (left out when none)."""
    import dataclasses
    import time

    import msgpack

    from pdserve.cluster.queue.frames import from_wire, pack_frame, to_wire
    from pdserve.cluster.queue.signing import BAD_SIGNATURE, SIGNATURE_CONTEXT, TaskSigner, signed_message, verify_task
    from pdserve.kvtransfer import PrefillDone, PrefillTask, decode_notification
    from pdserve.kvtransfer.task import task_from_wire, task_to_wire

    def task(**fields) -> PrefillTask:
        return PrefillTask(request_id="r1", epoch=1, token_ids=list(range(3, 40)), cached_len=16,
                           target_worker_id="decode-0", target_block_ids=[4, 5, 6], deadline=time.time() + 60,
                           sampling_params={"temperature": 0.0}, **fields)

    t = task(draft_block_ids=[9, 2, 7])
    assert task_from_wire(task_to_wire(t)).draft_block_ids == [9, 2, 7]
    framed = msgpack.unpackb(pack_frame(to_wire(t))[4:], raw=False)
    assert from_wire(PrefillTask, framed, "task").draft_block_ids == [9, 2, 7]
    assert "draft_block_ids" not in task_to_wire(task())
    with pytest.raises(ValueError, match="draft_block_ids"):
        task(draft_block_ids=[1, -2])
    signer = TaskSigner()
    signer.sign(t)
    assert verify_task(t, signer.public_key) is None
    for change in ([9, 2, 8], []):  # another write target, or none: the signature no longer holds
        forged = dataclasses.replace(t, draft_block_ids=change)
        forged.signature = t.signature
        assert verify_task(forged, signer.public_key) == BAD_SIGNATURE, change
    assert len(msgpack.unpackb(signed_message(task())[len(SIGNATURE_CONTEXT):])) == 11  # as before
    done = decode_notification(PrefillDone("r1", 1, 42, -0.5, 21, draft_tokens=37).encode())
    assert done.draft_tokens == 37
    assert b"draft" not in PrefillDone("r1", 1, 42, -0.5, 21).encode()
    with pytest.raises(ValueError, match="draft_tokens"):
        PrefillDone("r1", 1, 42, -0.5, 21, draft_tokens=-1)
