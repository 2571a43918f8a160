"""Lending a cached prefix to another worker, which reads its pages with NIXL.

The cluster's KV index (kvindex/) says worker H holds the first ``n`` blocks of a prompt
that worker R is about to compute. When reading them beats computing them, R borrows
them:

    R -> H  LendRequest(lend_id, tail_hash, blocks, lease_ms)    b"PDLQ"
    H       finds the chain ending at tail_hash (n blocks, from the prompt's first block),
            pins it for lease_ms
    H -> R  LendGrant(lend_id, block_ids) or a refusal (reason)    b"PDLG"
    R       READs the blocks it lacks from H's pool into its own (kvtransfer read_blocks);
            the read's notification is
    R -> H  LendRelease(lend_id)                                   b"PDLR"
    H       unpins: on the release, or when the lease ends (R died, its read hangs)

The tail hash names the whole chain: a block's hash covers its parent's
(common/block_hash.py), so H walks parents back from it and checks that the chain
starts at a prompt's first block. Nothing else about the prompt crosses.

**Why R's pages are never half-read.** H reuses the blocks only when the lease ends, and
R uses what it read only if its read completed before R's own deadline, which is half
the lease after R sent the request (before H granted it, so before H's lease started).
A read past that deadline is abandoned: R frees nothing it read into until the read can
no longer land (its quarantine), and computes the prefix instead. A refusal, a missing
holder or a failed read likewise fall back to computing: slower, never wrong.

Wire format: magic | version (1 byte) | msgpack map, inside one transport notification
(at most 1 KiB, handoff/transport.py); block ids travel as little-endian int32 bytes, so
a grant holds at most MAX_LEND_BLOCKS. Pure: no engine, no transport.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack

from .transport import MAX_NOTIFICATION_BYTES

LEND_VERSION = 1
REQUEST_MAGIC, GRANT_MAGIC, RELEASE_MAGIC = b"PDLQ", b"PDLG", b"PDLR"
MAGICS = (REQUEST_MAGIC, GRANT_MAGIC, RELEASE_MAGIC)
MAX_LEND_BLOCKS = 224  # 4 bytes each: a grant stays well under the 1 KiB notification cap
DEFAULT_LEASE_MS = 4000
MAX_LEASE_MS = 60_000

# Why a holder refuses (LendGrant.reason).
GONE = "gone"  # the chain is no longer (wholly) cached
TOO_MANY = "too_many"  # more blocks than one grant carries
BUSY = "busy"  # the holder lends too much already
NO_TIER = "unsupported"  # the holder cannot lend (no prefix cache)


# The key a worker's etcd record sets in its `capacity` when it answers loan requests (both
# roles; a borrower asks only such a worker).
LENDS_CAPACITY_KEY = "lends_prefixes"


def lends(capacity) -> bool:
    """Whether a worker whose record's capacity is ``capacity`` answers loan requests."""
    return bool((capacity or {}).get(LENDS_CAPACITY_KEY))


class MalformedLendError(ValueError):
    """A lend message that is not valid for this version (the receiver counts and drops it)."""


@dataclass(frozen=True)
class LendRequest:
    lend_id: str
    tail_hash: bytes
    blocks: int
    lease_ms: int = DEFAULT_LEASE_MS

    def __post_init__(self) -> None:
        if not isinstance(self.lend_id, str) or not 0 < len(self.lend_id) <= 128:
            raise MalformedLendError(f"lend_id must be a str of 1..128 characters, got {self.lend_id!r}")
        if not isinstance(self.tail_hash, bytes) or not 0 < len(self.tail_hash) <= 64:
            raise MalformedLendError("tail_hash must be 1..64 bytes")
        if not isinstance(self.blocks, int) or isinstance(self.blocks, bool) or not 0 < self.blocks <= MAX_LEND_BLOCKS:
            raise MalformedLendError(f"blocks must be in 1..{MAX_LEND_BLOCKS}, got {self.blocks!r}")
        if not isinstance(self.lease_ms, int) or not 0 < self.lease_ms <= MAX_LEASE_MS:
            raise MalformedLendError(f"lease_ms must be in 1..{MAX_LEASE_MS}, got {self.lease_ms!r}")

    def encode(self) -> bytes:
        return _frame(REQUEST_MAGIC, {"lend_id": self.lend_id, "tail_hash": self.tail_hash, "blocks": self.blocks,
                                      "lease_ms": self.lease_ms})


@dataclass(frozen=True)
class LendGrant:
    lend_id: str
    block_ids: tuple[int, ...] = ()  # the chain's blocks in the holder's pool, first block first
    reason: str = ""  # set when refused (no block ids)

    @property
    def granted(self) -> bool:
        return bool(self.block_ids)

    def encode(self) -> bytes:
        ids = struct.pack(f"<{len(self.block_ids)}i", *self.block_ids)
        return _frame(GRANT_MAGIC, {"lend_id": self.lend_id, "ids": ids, "reason": self.reason})


@dataclass(frozen=True)
class LendRelease:
    lend_id: str

    def encode(self) -> bytes:
        return _frame(RELEASE_MAGIC, {"lend_id": self.lend_id})


LendMessage = LendRequest | LendGrant | LendRelease


def is_lend_message(payload: bytes) -> bool:
    return payload[:4] in MAGICS


def _frame(magic: bytes, fields: dict) -> bytes:
    payload = magic + bytes([LEND_VERSION]) + msgpack.packb(fields, use_bin_type=True)
    if len(payload) > MAX_NOTIFICATION_BYTES:
        raise ValueError(f"lend message of {len(payload)} bytes is over the {MAX_NOTIFICATION_BYTES}-byte cap")
    return payload


def decode_lend(payload: bytes) -> LendMessage:
    """Parse a lend notification; MalformedLendError on anything else."""
    if not isinstance(payload, bytes) or len(payload) < 6 or payload[:4] not in MAGICS:
        raise MalformedLendError("not a lend message")
    if payload[4] != LEND_VERSION:
        raise MalformedLendError(f"lend message version {payload[4]}, this build reads {LEND_VERSION}")
    try:
        fields = msgpack.unpackb(payload[5:], raw=False)
    except Exception as exc:  # noqa: BLE001  (msgpack's errors vary by version)
        raise MalformedLendError(f"lend message body is not msgpack: {exc}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("lend_id"), str):
        raise MalformedLendError("lend message without a lend_id")
    magic = payload[:4]
    try:
        if magic == REQUEST_MAGIC:
            return LendRequest(fields["lend_id"], fields["tail_hash"], fields["blocks"], fields["lease_ms"])
        if magic == GRANT_MAGIC:
            ids = fields["ids"]
            if not isinstance(ids, bytes) or len(ids) % 4:
                raise MalformedLendError("grant block ids must be int32 bytes")
            block_ids = struct.unpack(f"<{len(ids) // 4}i", ids)
            if any(i < 0 for i in block_ids):
                raise MalformedLendError("grant block ids must be >= 0")
            return LendGrant(fields["lend_id"], block_ids, str(fields.get("reason", "")))
        return LendRelease(fields["lend_id"])
    except KeyError as exc:
        raise MalformedLendError(f"lend message without {exc.args[0]!r}") from None


@dataclass
class Loan:
    lend_id: str
    borrower: str
    block_ids: tuple[int, ...]
    expires_at: float


@dataclass
class LendTable:
    """The holder's loans: which pinned blocks each borrower may read, until when. Bounded:
    at most ``max_blocks`` blocks lent at once (a busy holder refuses, BUSY)."""

    max_blocks: int = 4096
    loans: dict[tuple[str, str], Loan] = field(default_factory=dict)  # (borrower, lend_id) -> loan
    granted: int = 0
    refused: int = 0
    released: int = 0
    expired: int = 0

    @property
    def lent_blocks(self) -> int:
        return sum(len(loan.block_ids) for loan in self.loans.values())

    def has_room(self, blocks: int) -> bool:
        return self.lent_blocks + blocks <= self.max_blocks

    def add(self, borrower: str, req: LendRequest, block_ids: tuple[int, ...], now: float) -> None:
        self.loans[(borrower, req.lend_id)] = Loan(req.lend_id, borrower, block_ids, now + req.lease_ms / 1e3)
        self.granted += 1

    def release(self, borrower: str, lend_id: str) -> Loan | None:
        """The borrower is done (its read's notification): the loan, to unpin; None if unknown
        (expired already, or never granted)."""
        loan = self.loans.pop((borrower, lend_id), None)
        if loan is not None:
            self.released += 1
        return loan

    def take_expired(self, now: float) -> list[Loan]:
        """Loans whose lease ended without a release (their borrower died or hangs): to unpin."""
        gone = [key for key, loan in self.loans.items() if loan.expires_at <= now]
        self.expired += len(gone)
        return [self.loans.pop(key) for key in gone]

    def take_borrower(self, borrower: str) -> list[Loan]:
        """Every loan of a borrower that left the cluster."""
        gone = [key for key in self.loans if key[0] == borrower]
        return [self.loans.pop(key) for key in gone]


def reader_deadline(sent_at: float, lease_ms: int) -> float:
    """The latest a borrower may finish its read and use what it read (monotonic seconds,
    from when it sent the request): half the lease, so that it ends before the holder's
    lease, which starts later."""
    return sent_at + lease_ms / 2e3
