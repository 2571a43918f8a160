"""The handoff's notices cross processes: PrefillDone and PrefillFailed, their codec and its refusals."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.kvtransfer.notices import (
    FAILED_MAGIC,
    MAGIC,
    MalformedNoticeError,
    PrefillDone,
    PrefillFailed,
    decode_notification,
    decode_prefill_done,
)
from pdserve.kvtransfer.outcomes import PREFILL_FAILURE_KINDS as FAILURE_KINDS
from pdserve.kvtransfer.transport import MAX_NOTIFICATION_BYTES

DONE = PrefillDone("req-42", epoch=3, first_token_id=1234, first_token_logprob=-0.25, num_tokens_written=4096)


def body(**fields) -> bytes:
    return MAGIC + b"\x01" + msgpack.packb(fields)


def test_prefill_done_round_trips_in_a_small_payload():
    payload = DONE.encode()
    assert payload.startswith(b"PDKV\x01") and len(payload) < 128
    assert decode_prefill_done(payload) == DONE


def test_a_missing_logprob_round_trips_as_none():
    done = PrefillDone("r", 0, 7, None, 16)
    assert decode_prefill_done(done.encode()).first_token_logprob is None


def test_first_top_logprobs_round_trip_and_are_checked():
    done = PrefillDone("r", 1, 7, -0.5, 16, first_top_logprobs=[(7, -0.5), (3, -1.25)])
    assert done.first_top_logprobs == ((7, -0.5), (3, -1.25))
    assert decode_prefill_done(done.encode()) == done
    for bad in ([(1, 0.5)], [(-1, -0.5)], [(1, float("nan"))], [(1, -0.1)] * 21, [(1,)]):
        with pytest.raises(ValueError, match="first_top_logprobs"):
            PrefillDone("r", 1, 7, None, 16, first_top_logprobs=bad)


def test_sent_at_round_trips_and_must_be_a_finite_time():
    done = PrefillDone("r", 1, 7, None, 16, sent_at=1_800_000_000.25)
    assert decode_prefill_done(done.encode()).sent_at == 1_800_000_000.25
    for bad in (-1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="sent_at"):
            PrefillDone("r", 1, 7, None, 16, sent_at=bad)


def test_encode_refuses_a_message_over_the_size_cap():
    with pytest.raises(ValueError, match="notification cap"):
        PrefillDone("r" * MAX_NOTIFICATION_BYTES, 0, 1, None, 1).encode()


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"", "does not start with"),
        (b"{\"request_id\": \"r\"}", "does not start with"),
        (b"PDKV\x02" + msgpack.packb({}), "version 2 is not supported"),
        (b"PDKV\x01\xc1garbage", "not valid msgpack"),
        (b"PDKV\x01" + msgpack.packb([1, 2]), "must be a map"),
        (body(request_id="r", epoch=1), "missing"),
        (body(request_id="r", epoch=1, first_token_id=2, first_token_logprob=None,
              num_tokens_written=3, extra=1), "unknown"),
        (body(request_id="r", epoch=-1, first_token_id=2, first_token_logprob=None,
              num_tokens_written=3), "epoch"),
        (body(request_id="r", epoch=1, first_token_id="2", first_token_logprob=None,
              num_tokens_written=3), "first_token_id"),
        (body(request_id="", epoch=1, first_token_id=2, first_token_logprob=None,
              num_tokens_written=3), "request_id"),
        (body(request_id="r", epoch=1, first_token_id=2, first_token_logprob=float("nan"),
              num_tokens_written=3), "log-probability"),
        (MAGIC + b"\x01" + b"x" * MAX_NOTIFICATION_BYTES, "cap"),
    ],
    ids=["empty", "json", "version", "garbage", "list", "missing", "unknown", "negative",
         "wrong-type", "empty-id", "nan", "oversize"],
)
def test_decode_rejects_malformed_payloads(payload, message):
    with pytest.raises(MalformedNoticeError, match=message):
        decode_prefill_done(payload)




def test_prefill_failed_round_trips_and_is_told_apart_from_prefill_done():
    failed = PrefillFailed("req-42", 3, "transfer_error", "UCX endpoint closed", "prefill-0", writes_settled=False)
    payload = failed.encode()
    assert payload.startswith(FAILED_MAGIC + b"\x01") and len(payload) < 160
    assert decode_notification(payload) == failed
    assert decode_notification(DONE.encode()) == DONE


def test_prefill_failed_names_only_known_kinds_and_caps_its_detail():
    with pytest.raises(ValueError, match="kind must be one of"):
        PrefillFailed("r", 1, "oops")
    long = PrefillFailed("r", 1, FAILURE_KINDS[0], "x" * 5000)
    assert len(long.encode()) <= MAX_NOTIFICATION_BYTES and long.detail.endswith("...")


@pytest.mark.parametrize(
    "payload, match",
    [
        (FAILED_MAGIC + b"\x02" + msgpack.packb({"request_id": "r", "epoch": 1, "kind": "bad_task"}), "version 2"),
        (FAILED_MAGIC + b"\x01" + msgpack.packb({"request_id": "r", "epoch": 1}), "missing"),
        (FAILED_MAGIC + b"\x01" + msgpack.packb({"request_id": "r", "epoch": 1, "kind": "bad_task", "x": 1}), "unknown"),
        (FAILED_MAGIC + b"\x01" + msgpack.packb({"request_id": "r", "epoch": -1, "kind": "bad_task"}), "epoch"),
        (FAILED_MAGIC + b"\x01" + msgpack.packb({"request_id": "r", "epoch": 1, "kind": "nope"}), "kind"),
        (FAILED_MAGIC + b"\x01" + msgpack.packb([1, 2]), "map"),
        (FAILED_MAGIC + b"\x01" + b"\xc1", "msgpack"),
        (FAILED_MAGIC + b"\x01" + b"x" * MAX_NOTIFICATION_BYTES, "cap"),
    ],
)
def test_malformed_prefill_failed_payloads_raise_a_typed_error(payload, match):
    with pytest.raises(MalformedNoticeError, match=match):
        decode_notification(payload)
