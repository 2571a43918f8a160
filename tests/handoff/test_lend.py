"""Lending a cached prefix (kvtransfer/lend.py, engine/kv_connector.py): the messages, the
holder's loans, and the engine calls on both sides, token-exact. The NIXL read itself is
tests/kvtransfer/test_transfer.py; the whole exchange across processes, tests/e2e."""

from __future__ import annotations

import random
import struct

import msgpack
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv_connector import kv_block_checksums
from pdserve.kvtransfer.lend import (
    LEND_VERSION,
    MAX_LEND_BLOCKS,
    MAX_LEND_ID,
    MAX_VERIFIED_BLOCKS,
    OLD_VERSION,
    LendConfirm,
    LendGrant,
    LendRelease,
    LendRequest,
    LendTable,
    MalformedLendError,
    OldLendVersionError,
    decode_lend,
    is_lend_message,
    new_epoch,
    reader_deadline,
)
from pdserve.kvtransfer.transport import MAX_NOTIFICATION_BYTES

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


TOP = (1 << 64) - 1  # the largest epoch and checksum


def test_messages_round_trip_and_the_largest_grant_fits_one_notification():
    longest = "l" * MAX_LEND_ID
    big_ids = tuple(range(1 << 30, (1 << 30) + MAX_LEND_BLOCKS))  # (5-byte msgpack ints would not matter: bytes)
    for msg in (LendRequest("l-1", b"\x07" * 32, 12, 3000), LendRequest(longest, b"\x07" * 64, MAX_VERIFIED_BLOCKS,
                                                                        60_000, verify=True),
                LendGrant(longest, big_ids, epoch=TOP),
                LendGrant(longest, big_ids[:MAX_VERIFIED_BLOCKS], epoch=TOP, sums=(TOP,) * MAX_VERIFIED_BLOCKS),
                LendGrant("l-1", (), "gone"), LendRelease("l-1"), LendRelease(longest, TOP),
                LendConfirm(longest, True, TOP), LendConfirm("l-1", False, 7)):
        wire = msg.encode()
        assert is_lend_message(wire) and len(wire) <= MAX_NOTIFICATION_BYTES, (msg, len(wire))
        assert wire[4] == LEND_VERSION
        assert decode_lend(wire) == msg
    assert not LendGrant("x", (), "busy").granted and LendGrant("x", (3,), epoch=1).granted
    assert new_epoch() != new_epoch() and 0 < new_epoch() <= TOP


def _confirm_wire(fields: dict, version: int = LEND_VERSION) -> bytes:
    return b"PDLC" + bytes([version]) + msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize("bad", [
    b"PDKV\x01", b"PDLQ\x09\x80", b"PDLQ\x02\xc1", b"PDLQ\x02" + b"\x81\xa1a\x01",
    LendRequest("l", b"h", 1).encode()[:-3],
    # Confirms: an unknown version, a cut body, a missing or ill-typed field, no epoch.
    _confirm_wire({"lend_id": "l", "ok": True, "epoch": 5}, version=LEND_VERSION + 1),
    _confirm_wire({"lend_id": "l", "ok": True, "epoch": 5}, version=1),
    LendConfirm("l", True, 5).encode()[:-2],
    _confirm_wire({"lend_id": "l", "ok": True}),
    _confirm_wire({"lend_id": "l", "epoch": 5}),
    _confirm_wire({"lend_id": "l", "ok": 1, "epoch": 5}),
    _confirm_wire({"lend_id": "l", "ok": True, "epoch": 0}),
    _confirm_wire({"lend_id": "l", "ok": True, "epoch": -3}),
    _confirm_wire({"lend_id": "l", "ok": True, "epoch": "5"}),
    _confirm_wire({"lend_id": "", "ok": True, "epoch": 5}),
    _confirm_wire({"lend_id": "l" * (MAX_LEND_ID + 1), "ok": True, "epoch": 5}),
    _confirm_wire(["l", True, 5]),
    # A grant of blocks without its holder's epoch, or with checksums that do not match its blocks.
    b"PDLG\x02" + msgpack.packb({"lend_id": "l", "ids": struct.pack("<2i", 1, 2), "reason": "", "epoch": 0,
                                  "sums": b""}),
    b"PDLG\x02" + msgpack.packb({"lend_id": "l", "ids": struct.pack("<2i", 1, 2), "reason": "", "epoch": 9,
                                  "sums": struct.pack("<Q", 1)}),
    b"PDLG\x02" + msgpack.packb({"lend_id": "l", "ids": struct.pack("<2i", 1, 2), "reason": "", "epoch": 9,
                                  "sums": b"\x00" * 15}),
    # A release without an epoch field, a verified request for more blocks than a verified grant holds.
    b"PDLR\x02" + msgpack.packb({"lend_id": "l"}),
    b"PDLQ\x02" + msgpack.packb({"lend_id": "l", "tail_hash": b"h", "blocks": MAX_VERIFIED_BLOCKS + 1,
                                  "lease_ms": 100, "verify": True}),
])
def test_malformed_messages_are_refused_with_a_typed_error(bad):
    with pytest.raises(MalformedLendError):
        decode_lend(bad)


def test_a_version_1_request_is_answered_with_a_version_1_refusal():
    """A borrower of version 1 would use its read without waiting for a confirm: it is not
    trusted. Its request is refused in its own version, so it computes at once; a version 1
    message of another kind is just malformed here."""
    v1 = b"PDLQ\x01" + msgpack.packb({"lend_id": "old-1", "tail_hash": b"h", "blocks": 3, "lease_ms": 4000})
    with pytest.raises(OldLendVersionError) as err:
        decode_lend(v1)
    answer = err.value.answer
    assert answer[:5] == b"PDLG\x01" and len(answer) <= MAX_NOTIFICATION_BYTES
    assert msgpack.unpackb(answer[5:]) == {"lend_id": "old-1", "ids": b"", "reason": OLD_VERSION}
    v1_release = b"PDLR\x01" + msgpack.packb({"lend_id": "old-1"})
    with pytest.raises(MalformedLendError) as err:
        decode_lend(v1_release)
    assert not isinstance(err.value, OldLendVersionError)


def test_block_checksums_see_every_changed_word_and_agree_on_copies():
    torch.manual_seed(0)
    kv = torch.randn(3, 6, 2, 16, 2, 8, dtype=torch.bfloat16)  # [layers, blocks, K/V, ...]
    sums = kv_block_checksums(kv, [0, 1, 5])
    assert len(set(sums)) == 3 and all(0 <= s < 1 << 64 for s in sums)
    copy = kv.clone()
    assert kv_block_checksums(copy, [5, 0]) == [sums[2], sums[0]]
    copy[2, 5, 1, 7, 1, 3] += 1  # one element of one layer of block 5
    assert kv_block_checksums(copy, [0, 1, 5]) == sums[:2] + [kv_block_checksums(copy, [5])[0]]
    assert kv_block_checksums(copy, [5])[0] != sums[2]
    assert kv_block_checksums(kv, []) == []


def test_requests_out_of_bounds_are_refused():
    with pytest.raises(MalformedLendError, match="blocks must be"):
        LendRequest("l", b"h", MAX_LEND_BLOCKS + 1)
    with pytest.raises(MalformedLendError, match="lease_ms"):
        LendRequest("l", b"h", 1, 0)
    with pytest.raises(MalformedLendError, match="lend_id"):
        LendRequest("", b"h", 1)


def test_the_holders_table_ends_loans_on_release_on_lease_end_and_with_their_borrower():
    table = LendTable(max_blocks=10)
    table.add("r1", LendRequest("a", b"h", 4, 1000), (1, 2, 3, 4), now=100.0)
    table.add("r2", LendRequest("b", b"h", 4, 5000), (5, 6, 7, 8), now=100.0)
    assert table.lent_blocks == 8 and table.has_room(2) and not table.has_room(3)
    assert table.release("r2", "a") is None  # another borrower's id names nothing of r2's
    assert table.take_expired(100.5) == []
    assert [loan.block_ids for loan in table.take_expired(101.0)] == [(1, 2, 3, 4)]
    assert table.release("r1", "a") is None  # expired already: nothing to unpin twice (and confirmed stale)
    assert [loan.block_ids for loan in table.take_borrower("r2")] == [(5, 6, 7, 8)]
    assert table.lent_blocks == 0 and (table.granted, table.expired) == (2, 1)
    # The borrower gives up at half the lease, before the holder's lease (which starts later) ends.
    assert reader_deadline(10.0, 4000) == 12.0


@pytest.fixture(scope="module")
def engines(llama_dir):
    made = {name: LLM(llama_dir, num_gpu_blocks_override=40) for name in ("holder", "reader")}
    made["reference"] = LLM(llama_dir, enable_prefix_caching=False)
    yield made
    for llm in made.values():
        llm.close()


def test_a_lent_prefix_copied_into_the_borrowers_blocks_is_its_cached_prefix_token_exact(engines):
    holder, reader = engines["holder"].engine, engines["reader"].engine
    rng = random.Random(5)
    shared = [rng.randrange(5, 500) for _ in range(160)]  # 10 blocks
    prompt = shared + [rng.randrange(5, 500) for _ in range(30)]
    engines["holder"].generate([shared + [1, 2, 3]], GREEDY)  # the holder caches the shared prefix
    engines["reader"].generate([shared[:48] + [9] * 20], GREEDY)  # the reader holds its first 3 blocks itself
    borrow = reader.connector.begin_borrow(prompt, 10)
    assert borrow is not None and borrow.first == 3 and len(borrow.block_ids) == 7
    lent = holder.connector.lend_chain(borrow.hashes[9], 10)
    assert lent is not None and len(lent) == 10
    free_while_lent = holder.kv.pool.num_free
    # What the NIXL read does, here by hand: the lent blocks the reader lacks into its targets.
    reader.runner.kv_cache[:, borrow.block_ids] = holder.runner.kv_cache[:, lent[borrow.first:]]
    holder.connector.unlend(lent)
    assert holder.kv.pool.num_free == free_while_lent + 10
    assert reader.connector.end_borrow(borrow, ok=True) == 160
    out = engines["reader"].generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 160
    assert out.token_ids == engines["reference"].generate([prompt], GREEDY)[0].token_ids
    assert reader.kv.pool.num_free == reader.kv.pool.num_blocks


def test_a_chain_not_cached_whole_or_not_from_a_first_block_is_not_lent(engines):
    holder = engines["holder"].engine
    rng = random.Random(8)
    prompt = [rng.randrange(5, 500) for _ in range(100)]
    engines["holder"].generate([prompt], GREEDY)
    reader = engines["reader"].engine
    borrow = reader.connector.begin_borrow(prompt, 6)
    hashes = borrow.hashes
    reader.connector.end_borrow(borrow, ok=False)  # nothing read: nothing registered
    assert reader.connector.cached_prefix_len(prompt) == 0
    before = holder.kv.pool.num_free
    assert holder.connector.lend_chain(hashes[5], 5) is None  # 6 blocks end there, not 5
    assert holder.connector.lend_chain(b"\x00" * 32, 1) is None
    assert holder.kv.pool.num_free == before  # a refusal pins nothing
    assert reader.kv.pool.num_free == reader.kv.pool.num_blocks


def test_an_abandoned_read_keeps_its_blocks_until_freed(engines):
    reader = engines["reader"].engine
    rng = random.Random(9)
    prompt = [rng.randrange(5, 500) for _ in range(70)]
    borrow = reader.connector.begin_borrow(prompt, 4)
    reader.connector.abandon_borrow(borrow, "lend-quarantine-1")
    assert reader.kv.pool.num_free == reader.kv.pool.num_blocks - 4
    reader.connector.free("lend-quarantine-1")
    assert reader.kv.pool.num_free == reader.kv.pool.num_blocks


def test_when_the_tier_copies_fail_before_ids_leave_nothing_is_lent_or_borrowed_and_nothing_stays_taken(
        engines, monkeypatch):
    """At TP>1 the copies the other ranks must make before block ids leave the engine go by a
    control call, which can fail (a rank cannot open its tier file): the grant and the borrow
    are given up, with every pin let go, rather than raise into the worker's poll."""
    holder, reader = engines["holder"].engine, engines["reader"].engine
    rng = random.Random(11)
    prompt = [rng.randrange(5, 500) for _ in range(100)]
    engines["holder"].generate([prompt], GREEDY)
    borrow = reader.connector.begin_borrow(prompt, 6)
    hashes = borrow.hashes
    reader.connector.end_borrow(borrow, ok=False)

    class Failing:
        def flush(self, now=True):
            raise RuntimeError("tier: rank 1: no room for the tier file")

    for eng in (holder, reader):
        monkeypatch.setattr(eng, "tier", Failing())
    free = holder.kv.pool.num_free
    assert holder.connector.lend_chain(hashes[5], 6) is None
    assert holder.kv.pool.num_free == free and all(holder.kv.pool.cached[h].ref_cnt == 0 for h in hashes)
    assert reader.connector.begin_borrow(prompt, 6) is None
    assert reader.kv.pool.num_free == reader.kv.pool.num_blocks
