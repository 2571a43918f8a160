"""The notices a prefill worker sends a decode worker over the transport, and their codec.

`PrefillDone` rides behind the last page write of an attempt; `PrefillFailed`
says that an attempt will never be written, so the decode worker prefills
locally at once instead of waiting out its remote deadline.

Wire format (inside a transport notification, never pickle):

    b"PDKV" | version (1 byte) | msgpack map of the fields     PrefillDone
    b"PDKF" | version (1 byte) | msgpack map of the fields     PrefillFailed

The whole payload is at most MAX_NOTIFICATION_BYTES (the transport's
contract, kvtransfer/transport.py: notifications ride on small active messages).
`decode_notification` reads either; anything else is a `MalformedNoticeError`.
The failure kinds a `PrefillFailed` may carry are the table's
(kvtransfer/outcomes.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from pdserve.kvtransfer.outcomes import PREFILL_FAILURE_KINDS
from pdserve.kvtransfer.transport import MAX_NOTIFICATION_BYTES


class MalformedNoticeError(ValueError):
    """A notice from another process is not valid for this version (the receiver counts and
    drops it)."""


MAGIC = b"PDKV"
PREFILL_DONE_VERSION = 1

_HEADER_BYTES = len(MAGIC) + 1
# Sent only when non-zero; a reader that lacks them keeps the defaults.
_OPTIONAL_FIELDS = ("queue_wait_ms", "prefill_ms", "sent_at", "prefill_worker", "batch_tokens",
                    "first_top_logprobs", "lora_name", "lora_int_id", "lora_load_ms", "draft_tokens")
MAX_TOP_LOGPROBS = 20  # the engine's own bound on logprobs
_FIELDS = (
    "request_id",
    "epoch",
    "first_token_id",
    "first_token_logprob",
    "num_tokens_written",
)


@dataclass(frozen=True)
class PrefillDone:
    """KV pages of one request attempt are in place on the decode worker.

    `epoch` numbers the attempt: the decode worker's handoff table ignores a
    message for an attempt it no longer awaits (kvtransfer/decode_side.py).

    `sent_at` (unix time on the prefill host) is when the write that carries
    this message was posted: the prompt's KV was complete and leaving. The
    decode worker's ``transfer_ms`` is its arrival time minus `sent_at`: the
    transfer the request waited for (pages streamed during the forward pass
    overlap it and are not counted). Across hosts it includes their clock
    offset (NTP keeps it to about a millisecond), like ``queue_wait_ms``.

    `lora_name` and `lora_int_id` name the LoRA adapter the KV was computed under ("" and 0:
    the base model); the decode worker refuses pages computed under another adapter than the
    task it signed (kvtransfer/decode_side.py `check_adapter`). `lora_load_ms`: what loading
    that adapter took the prefill worker for this task (0: it held it), for the router's cost
    model. Sent only when set: a base-model notice reads as before.
    """

    request_id: str
    epoch: int
    first_token_id: int
    first_token_logprob: float | None
    num_tokens_written: int
    # Optional facts for the decode worker's per-request breakdown.
    queue_wait_ms: float = 0.0  # enqueue (decode clock) -> taken (prefill clock)
    prefill_ms: float = 0.0  # prefill compute of this request's batch
    sent_at: float = 0.0  # unix time the last write (with this message) was posted; 0 = unknown
    prefill_worker: str = ""
    batch_tokens: int = 0  # tokens the prefill batch computed in prefill_ms (for cost calibration)
    # The first token's most likely alternatives, (token id, logprob) pairs, when the request
    # asked for logprobs: the decode side's first logprobs entry equals the local path's.
    first_top_logprobs: tuple[tuple[int, float], ...] = ()
    lora_name: str = ""
    lora_int_id: int = 0
    lora_load_ms: float = 0.0
    # Prompt positions of the speculative draft model's KV written into the task's
    # draft_block_ids before this notice (0: none; the decode worker's draft computes them).
    draft_tokens: int = 0
    version: int = PREFILL_DONE_VERSION

    def __post_init__(self) -> None:
        problem = _field_problem(self)
        if problem:
            raise ValueError(f"invalid PrefillDone: {problem}")
        if isinstance(self.first_token_logprob, int):  # a caller passed 0 for 0.0
            object.__setattr__(self, "first_token_logprob", float(self.first_token_logprob))
        # msgpack gives lists back; keep one hashable, comparable form.
        object.__setattr__(self, "first_top_logprobs",
                           tuple((int(t), float(lp)) for t, lp in self.first_top_logprobs))

    def encode(self) -> bytes:
        return encode_prefill_done(self)


def encode_prefill_done(msg: PrefillDone) -> bytes:
    """Serialize to the versioned wire format; raises ValueError if it would exceed the size cap."""
    if msg.version != PREFILL_DONE_VERSION:
        raise ValueError(
            f"this build writes PrefillDone version {PREFILL_DONE_VERSION}, not {msg.version}"
        )
    fields = {name: getattr(msg, name) for name in _FIELDS}
    fields.update((name, getattr(msg, name)) for name in _OPTIONAL_FIELDS if getattr(msg, name))
    return _frame(MAGIC, msg.version, fields, "PrefillDone")


def _frame(magic: bytes, version: int, fields: dict, name: str) -> bytes:
    """magic | version | msgpack(fields), refused over the notification cap."""
    payload = magic + bytes([version]) + msgpack.packb(fields, use_bin_type=True)
    if len(payload) > MAX_NOTIFICATION_BYTES:
        raise ValueError(f"{name} encodes to {len(payload)} bytes, over the {MAX_NOTIFICATION_BYTES}-byte "
                         "notification cap; shorten request_id")
    return payload


def decode_prefill_done(payload: bytes) -> PrefillDone:
    """Parse a notification payload; raises MalformedNoticeError on anything but a valid message."""
    return _decode(payload, PrefillDone, MAGIC, PREFILL_DONE_VERSION, _FIELDS, _FIELDS + _OPTIONAL_FIELDS)


def _field_problem(msg: PrefillDone) -> str | None:
    """Why the message's fields are invalid, or None when they are fine."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(msg.request_id, str) or not msg.request_id:
        return f"request_id must be a non-empty str, got {msg.request_id!r}"
    for name in ("epoch", "first_token_id", "num_tokens_written", "draft_tokens"):
        value = getattr(msg, name)
        if not is_int(value) or value < 0:
            return f"{name} must be an int >= 0, got {value!r}"
    logprob = msg.first_token_logprob
    if logprob is not None:
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            return f"first_token_logprob must be a float or None, got {logprob!r}"
        if math.isnan(logprob) or logprob > 0:
            return f"first_token_logprob must be <= 0 (a log-probability), got {logprob!r}"
    for name in ("queue_wait_ms", "prefill_ms", "sent_at", "lora_load_ms"):
        value = getattr(msg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            return f"{name} must be a number >= 0, got {value!r}"
    top = msg.first_top_logprobs
    if not isinstance(top, (list, tuple)) or len(top) > MAX_TOP_LOGPROBS or not all(
            isinstance(e, (list, tuple)) and len(e) == 2 and is_int(e[0]) and e[0] >= 0
            and isinstance(e[1], (int, float)) and not isinstance(e[1], bool) and not math.isnan(e[1]) and e[1] <= 0
            for e in top):
        return (f"first_top_logprobs must be at most {MAX_TOP_LOGPROBS} (token id >= 0, logprob <= 0) "
                f"pairs, got {top!r}"[:300])
    if not is_int(msg.batch_tokens) or msg.batch_tokens < 0:
        return f"batch_tokens must be an int >= 0, got {msg.batch_tokens!r}"
    if not isinstance(msg.prefill_worker, str):
        return f"prefill_worker must be a str, got {msg.prefill_worker!r}"
    if not isinstance(msg.lora_name, str):
        return f"lora_name must be a str, got {msg.lora_name!r}"
    if not is_int(msg.lora_int_id) or msg.lora_int_id < 0:
        return f"lora_int_id must be an int >= 0, got {msg.lora_int_id!r}"
    if not is_int(msg.version):
        return f"version must be an int, got {msg.version!r}"
    return None


# -- PrefillFailed -------------------------------------------------------------------------
FAILED_MAGIC = b"PDKF"
PREFILL_FAILED_VERSION = 1
MAX_FAILURE_DETAIL_CHARS = 300  # the detail is for logs and the breakdown; the cap keeps it one message

_FAILED_FIELDS = ("request_id", "epoch", "kind", "detail", "prefill_worker", "writes_settled")


@dataclass(frozen=True)
class PrefillFailed:
    """Attempt `epoch` of `request_id` will not be written: prefill it locally now.

    `writes_settled` is True when no page write of this attempt can still land
    (none was posted, or every posted one finished or failed): the decode
    worker may reuse the reserved blocks at once. False (a write timed out and
    NIXL could not cancel it) means: quarantine them as for any abandoned write.
    """

    request_id: str
    epoch: int
    kind: str
    detail: str = ""
    prefill_worker: str = ""
    writes_settled: bool = True
    version: int = PREFILL_FAILED_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.detail, str) and len(self.detail) > MAX_FAILURE_DETAIL_CHARS:
            object.__setattr__(self, "detail", self.detail[: MAX_FAILURE_DETAIL_CHARS - 3] + "...")
        problem = _failed_problem(self)
        if problem:
            raise ValueError(f"invalid PrefillFailed: {problem}")

    def encode(self) -> bytes:
        if self.version != PREFILL_FAILED_VERSION:
            raise ValueError(f"this build writes PrefillFailed version {PREFILL_FAILED_VERSION}, not {self.version}")
        return _frame(FAILED_MAGIC, self.version, {name: getattr(self, name) for name in _FAILED_FIELDS},
                      "PrefillFailed")


def _failed_problem(msg: PrefillFailed) -> str | None:
    if not isinstance(msg.request_id, str) or not msg.request_id:
        return f"request_id must be a non-empty str, got {msg.request_id!r}"
    if isinstance(msg.epoch, bool) or not isinstance(msg.epoch, int) or msg.epoch < 0:
        return f"epoch must be an int >= 0, got {msg.epoch!r}"
    if msg.kind not in PREFILL_FAILURE_KINDS:
        return f"kind must be one of {list(PREFILL_FAILURE_KINDS)}, got {msg.kind!r}"
    for name in ("detail", "prefill_worker"):
        if not isinstance(getattr(msg, name), str):
            return f"{name} must be a str, got {getattr(msg, name)!r}"
    if not isinstance(msg.writes_settled, bool):
        return f"writes_settled must be a bool, got {msg.writes_settled!r}"
    if isinstance(msg.version, bool) or not isinstance(msg.version, int):
        return f"version must be an int, got {msg.version!r}"
    return None


def decode_prefill_failed(payload: bytes) -> PrefillFailed:
    """Parse a PrefillFailed payload; MalformedNoticeError on anything but a valid message."""
    return _decode(payload, PrefillFailed, FAILED_MAGIC, PREFILL_FAILED_VERSION, ("request_id", "epoch", "kind"),
                   _FAILED_FIELDS)


def _decode(payload, cls, magic: bytes, version: int, required: tuple, allowed: tuple):
    """``magic | version | msgpack map`` into ``cls``, or MalformedNoticeError saying why."""
    name = cls.__name__
    payload = _checked_bytes(payload)
    if len(payload) < _HEADER_BYTES or not payload.startswith(magic):
        raise MalformedNoticeError(f"payload does not start with {magic!r}: {payload[:8]!r}")
    got = payload[len(magic)]
    if got != version:
        raise MalformedNoticeError(
            f"{name} version {got} is not supported (this build reads version {version}); upgrade the older worker")
    try:
        body = msgpack.unpackb(payload[_HEADER_BYTES:], raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise MalformedNoticeError(f"{name} body is not valid msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise MalformedNoticeError(f"{name} body must be a map, got {type(body).__name__}")
    missing = [f for f in required if f not in body]
    unknown = sorted(str(key) for key in body if key not in allowed)
    if missing or unknown:
        raise MalformedNoticeError(f"{name} fields: missing {missing}, unknown {unknown}")
    try:
        return cls(version=got, **body)
    except ValueError as exc:
        raise MalformedNoticeError(str(exc)) from exc


def decode_notification(payload: bytes) -> PrefillDone | PrefillFailed:
    """Either message, told apart by its magic; MalformedNoticeError for anything else."""
    payload = _checked_bytes(payload)
    if payload.startswith(FAILED_MAGIC):
        return decode_prefill_failed(payload)
    return decode_prefill_done(payload)


def _checked_bytes(payload) -> bytes:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise MalformedNoticeError(f"payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    if len(payload) > MAX_NOTIFICATION_BYTES:
        raise MalformedNoticeError(f"payload is {len(payload)} bytes, over the {MAX_NOTIFICATION_BYTES}-byte cap")
    return payload
