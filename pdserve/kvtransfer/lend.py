"""Lending a cached prefix to another worker, which reads its pages with NIXL.

The cluster's KV index (cluster/kvindex/) says worker H holds the first ``n`` blocks of a prompt
that worker R is about to compute. When reading them beats computing them, R borrows
them:

    R -> H  LendRequest(lend_id, tail_hash, blocks, lease_ms, verify[, traceparent])  b"PDLQ"
    H       finds the chain ending at tail_hash (n blocks, from the prompt's first block),
            pins it for lease_ms
    H -> R  LendGrant(lend_id, block_ids, epoch[, sums]) or a refusal     b"PDLG"
    R       READs the blocks it lacks from H's pool into its own (kvtransfer read_blocks),
            and uses none of it yet; once the read completed (every rank's, at TP) it sends
    R -> H  LendRelease(lend_id, epoch)                                   b"PDLR"
    H       answers whether the loan was still live, then unpins
    H -> R  LendConfirm(lend_id, ok, epoch)                               b"PDLC"
    R       uses the pages (its prefix cache) only on ok, from this holder life (epoch)

The tail hash names the whole chain: a block's hash covers its parent's
(common/block_hash.py), so H walks parents back from it and checks that the chain
starts at a prompt's first block. Nothing else about the prompt crosses.

**Why R never uses a reused block.** Safety does not rest on clocks, deadlines or how
promptly either side polls; the holder, which alone knows when it lets a block go, says
afterwards whether it did. H pins the chain before it sends the grant and unpins it only
when the loan leaves its `LendTable`: on the release, when the lease ends, or when R
leaves the cluster. R sends the release (carrying the grant's epoch) only after its read
completed: at TP=1 it is the read's NIXL notification, which NIXL sends after the read's
completion (its UCX backend flushes the endpoint first); at TP>1 rank 0 sends it once every
rank reported its read done (kvtransfer/nixl/tp_transport.py `TPRead`). So when H takes the
release out of its table, the loan was live from the grant until after every byte R read
had been read: the blocks were pinned (a pinned cached block is never evicted or written)
for the whole read. H answers ``ok`` exactly then. If the loan had left the table first
(its lease ran out: a paused holder, a slow borrower, a skewed clock), the blocks may have
been reused under the read: H answers not ok ("stale") and R computes the prefix. The
epoch is a random 64-bit id the holder's `Lender` draws when it starts: a holder that
restarted under the same name has a new one and an empty table, so it can never confirm a
loan granted by its previous life (the release carries the epoch R was granted under;
the confirm, the epoch of the life that answers; R needs both equal to the grant's).

So a confirm is the proof, and the deadlines only bound how long R waits. R gives up at
half the lease after it sent the request (`reader_deadline`): with no grant it releases;
with its read completed but no confirm (a lost message, a dead holder) it frees its
target blocks at once, since nothing lands in them any more; with its read still in
flight it keeps the targets taken under a quarantine until the read can no longer land,
since NIXL may still write them. In each of these cases, as after a refusal or a failed
read, R computes the prefix instead: slower, never wrong. None of these times decides
whether a read is used.

**Checksums (debugging, chaos soaks).** A borrower with ``verify`` asks for them
(`LendRequest.verify`): H adds a 64-bit checksum of each lent block's bytes in its pool, as
they are when it grants (`LendGrant.sums`), and R recomputes them over what it read before
using it; a difference (a bug that wrote a pinned block, a transport that corrupted a page)
is refused as ``checksum_mismatch`` and computed. The sums must ride in the grant (computed
later, they would vouch for what the bug wrote), and 12 bytes a block (id and sum) do not
fit the 1 KiB notification for a full grant: a verified loan asks for at most
MAX_VERIFIED_BLOCKS blocks (the rest of the prompt is computed).

Wire format: magic | version (1 byte) | msgpack map, inside one transport notification
(at most 1 KiB, kvtransfer/transport.py); block ids travel as little-endian int32 bytes, sums
as little-endian uint64 bytes, so a grant holds at most MAX_LEND_BLOCKS blocks
(MAX_VERIFIED_BLOCKS with sums), and a lend id at most MAX_LEND_ID characters, so that
the largest grant still fits. Version 2 added the confirm and the epoch; a version 1
peer is not trusted, since it would never confirm: a version 1 request is answered with a
version 1 refusal (`OldLendVersionError.answer`: its borrower computes at once), and a
version 1 holder drops this version's requests as malformed, so the borrower gets no
grant and computes at its deadline.

**Traces.** A borrow for a traced request carries the W3C ``traceparent`` of the borrower's
span in its request (an optional string field: a version 2 peer without it ignores it, and a
request without it reads as before), so the holder's span of the loan joins the borrowing
request's trace (docs/cluster.md, "Tracing"). Pure: no engine, no transport.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import msgpack

from pdserve.kvtransfer.transport import MAX_NOTIFICATION_BYTES

LEND_VERSION = 2  # 2: the confirm (PDLC), the holder's epoch, checksums on request
REQUEST_MAGIC, GRANT_MAGIC, RELEASE_MAGIC, CONFIRM_MAGIC = b"PDLQ", b"PDLG", b"PDLR", b"PDLC"
MAGICS = (REQUEST_MAGIC, GRANT_MAGIC, RELEASE_MAGIC, CONFIRM_MAGIC)
MAX_LEND_BLOCKS = 224  # 4 bytes each: a grant stays well under the 1 KiB notification cap
MAX_VERIFIED_BLOCKS = 64  # 4 + 8 bytes each (id, sum): 768 bytes, room left for the rest of the grant
DEFAULT_LEASE_MS = 4000
MAX_LEASE_MS = 60_000
MAX_LEND_ID = 64
MAX_TRACEPARENT = 128  # "00-<32 hex>-<16 hex>-<2 hex>" is 55; a later W3C version may add fields
_U64 = 1 << 64

# Why a holder refuses (LendGrant.reason).
GONE = "gone"  # the chain is no longer (wholly) cached
TOO_MANY = "too_many"  # more blocks than one grant carries
BUSY = "busy"  # the holder lends too much already
NO_TIER = "unsupported"  # the holder cannot lend (no prefix cache)
OLD_VERSION = "version"  # (to a version 1 borrower) this holder speaks a later version only


# The key a worker's etcd record sets in its `capacity` when it answers loan requests (both
# roles; a borrower asks only such a worker).
LENDS_CAPACITY_KEY = "lends_prefixes"
# And an id its NIXL agent draws at start: a worker restarted under the same id (Ray restarts a
# killed one in seconds, often before its old record expires) has a new agent, and a peer that
# kept the old agent's metadata would send its grants and confirms nowhere.
AGENT_INCARNATION_KEY = "agent_incarnation"


def lends(capacity) -> bool:
    """Whether a worker whose record's capacity is ``capacity`` answers loan requests."""
    return bool((capacity or {}).get(LENDS_CAPACITY_KEY))


class MalformedLendError(ValueError):
    """A lend message that is not valid for this version (the receiver counts and drops it)."""


class OldLendVersionError(MalformedLendError):
    """A version 1 loan request: ``answer`` is the version 1 refusal to send back, so that its
    borrower computes at once instead of waiting out its deadline."""

    def __init__(self, message: str, answer: bytes):
        super().__init__(message)
        self.answer = answer


def new_epoch() -> int:
    """A holder life's epoch: random, never 0 (0 on the wire means "none")."""
    return int.from_bytes(os.urandom(8), "little") or 1


def _check_lend_id(lend_id) -> None:
    # (64 at most: with it the largest grant, ids and epoch, still fits one notification)
    if not isinstance(lend_id, str) or not 0 < len(lend_id) <= MAX_LEND_ID:
        raise MalformedLendError(f"lend_id must be a str of 1..{MAX_LEND_ID} characters, got {lend_id!r}")


def _check_epoch(epoch, what: str, allow_zero: bool) -> None:
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not (0 if allow_zero else 1) <= epoch < _U64:
        raise MalformedLendError(f"{what} epoch must be an int in {0 if allow_zero else 1}..2**64-1, got {epoch!r}")


@dataclass(frozen=True)
class LendRequest:
    lend_id: str
    tail_hash: bytes
    blocks: int
    lease_ms: int = DEFAULT_LEASE_MS
    verify: bool = False  # ask for the blocks' checksums (at most MAX_VERIFIED_BLOCKS blocks)
    traceparent: str = ""  # the borrower's span (W3C), when the request it borrows for is traced

    def __post_init__(self) -> None:
        _check_lend_id(self.lend_id)
        if not isinstance(self.tail_hash, bytes) or not 0 < len(self.tail_hash) <= 64:
            raise MalformedLendError("tail_hash must be 1..64 bytes")
        if not isinstance(self.traceparent, str) or len(self.traceparent) > MAX_TRACEPARENT:
            raise MalformedLendError(f"traceparent must be a str of at most {MAX_TRACEPARENT} characters, "
                                     f"got {self.traceparent!r:.80}")
        if not isinstance(self.verify, bool):
            raise MalformedLendError(f"verify must be a bool, got {self.verify!r}")
        most = MAX_VERIFIED_BLOCKS if self.verify else MAX_LEND_BLOCKS
        if not isinstance(self.blocks, int) or isinstance(self.blocks, bool) or not 0 < self.blocks <= most:
            raise MalformedLendError(f"blocks must be in 1..{most}{' (verified)' if self.verify else ''}, "
                                     f"got {self.blocks!r}")
        if not isinstance(self.lease_ms, int) or not 0 < self.lease_ms <= MAX_LEASE_MS:
            raise MalformedLendError(f"lease_ms must be in 1..{MAX_LEASE_MS}, got {self.lease_ms!r}")

    def encode(self) -> bytes:
        fields = {"lend_id": self.lend_id, "tail_hash": self.tail_hash, "blocks": self.blocks,
                  "lease_ms": self.lease_ms, "verify": self.verify}
        if self.traceparent:  # (left out untraced: the request is what it was)
            fields["traceparent"] = self.traceparent
        return _frame(REQUEST_MAGIC, fields)


@dataclass(frozen=True)
class LendGrant:
    lend_id: str
    block_ids: tuple[int, ...] = ()  # the chain's blocks in the holder's pool, first block first
    reason: str = ""  # set when refused (no block ids)
    epoch: int = 0  # the granting holder life's (`Lender.epoch`); 0 only in a refusal
    sums: tuple[int, ...] = ()  # when asked (verify): each block's checksum as granted, in block_ids' order

    def __post_init__(self) -> None:
        _check_lend_id(self.lend_id)
        _check_epoch(self.epoch, "grant", allow_zero=not self.block_ids)
        if self.sums and len(self.sums) != len(self.block_ids):
            raise MalformedLendError(f"{len(self.sums)} checksums for {len(self.block_ids)} blocks")
        if any(not isinstance(x, int) or not 0 <= x < _U64 for x in self.sums):
            raise MalformedLendError("checksums must be unsigned 64-bit ints")

    @property
    def granted(self) -> bool:
        return bool(self.block_ids)

    def encode(self) -> bytes:
        ids = struct.pack(f"<{len(self.block_ids)}i", *self.block_ids)
        sums = struct.pack(f"<{len(self.sums)}Q", *self.sums)
        return _frame(GRANT_MAGIC, {"lend_id": self.lend_id, "ids": ids, "reason": self.reason, "epoch": self.epoch,
                                    "sums": sums})


@dataclass(frozen=True)
class LendRelease:
    """The borrower is done with a loan. With the grant's ``epoch`` (its read completed): the
    holder answers with a `LendConfirm`. With 0 (it gave up: no grant in time, a failed read):
    the holder only unpins."""

    lend_id: str
    epoch: int = 0

    def __post_init__(self) -> None:
        _check_lend_id(self.lend_id)
        _check_epoch(self.epoch, "release", allow_zero=True)

    def encode(self) -> bytes:
        return _frame(RELEASE_MAGIC, {"lend_id": self.lend_id, "epoch": self.epoch})


@dataclass(frozen=True)
class LendConfirm:
    """The holder's answer to a release: ``ok`` when the loan was still live in its table (so
    the lent blocks stayed pinned from the grant until after the read), else stale; ``epoch``
    is the answering holder life's (the borrower trusts ok only from the life that granted)."""

    lend_id: str
    ok: bool
    epoch: int

    def __post_init__(self) -> None:
        _check_lend_id(self.lend_id)
        if not isinstance(self.ok, bool):
            raise MalformedLendError(f"ok must be a bool, got {self.ok!r}")
        _check_epoch(self.epoch, "confirm", allow_zero=False)

    def encode(self) -> bytes:
        return _frame(CONFIRM_MAGIC, {"lend_id": self.lend_id, "ok": self.ok, "epoch": self.epoch})


LendMessage = LendRequest | LendGrant | LendRelease | LendConfirm


def is_lend_message(payload: bytes) -> bool:
    return payload[:4] in MAGICS


def _frame(magic: bytes, fields: dict, version: int = LEND_VERSION) -> bytes:
    payload = magic + bytes([version]) + msgpack.packb(fields, use_bin_type=True)
    if len(payload) > MAX_NOTIFICATION_BYTES:
        raise ValueError(f"lend message of {len(payload)} bytes is over the {MAX_NOTIFICATION_BYTES}-byte cap")
    return payload


def _old_request(payload: bytes) -> OldLendVersionError | None:
    """A well-formed version 1 request: the error that carries its version 1 refusal."""
    try:
        fields = msgpack.unpackb(payload[5:], raw=False)
        lend_id = fields["lend_id"]
        _check_lend_id(lend_id)
    except Exception:  # noqa: BLE001  (not even a version 1 request: plain malformed)
        return None
    answer = _frame(GRANT_MAGIC, {"lend_id": lend_id, "ids": b"", "reason": OLD_VERSION}, version=1)
    return OldLendVersionError(f"lend request of version 1, this build speaks {LEND_VERSION} only", answer)


def decode_lend(payload: bytes) -> LendMessage:
    """Parse a lend notification; MalformedLendError on anything else (OldLendVersionError for a
    version 1 request, with the refusal to answer it with)."""
    if not isinstance(payload, bytes) or len(payload) < 6 or payload[:4] not in MAGICS:
        raise MalformedLendError("not a lend message")
    if payload[4] != LEND_VERSION:
        old = _old_request(payload) if payload[4] == 1 and payload[:4] == REQUEST_MAGIC else None
        if old is not None:
            raise old
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
            return LendRequest(fields["lend_id"], fields["tail_hash"], fields["blocks"], fields["lease_ms"],
                               fields["verify"], fields.get("traceparent", ""))
        if magic == GRANT_MAGIC:
            ids, sums = fields["ids"], fields["sums"]
            if not isinstance(ids, bytes) or len(ids) % 4:
                raise MalformedLendError("grant block ids must be int32 bytes")
            if not isinstance(sums, bytes) or len(sums) % 8:
                raise MalformedLendError("grant checksums must be uint64 bytes")
            block_ids = struct.unpack(f"<{len(ids) // 4}i", ids)
            if any(i < 0 for i in block_ids):
                raise MalformedLendError("grant block ids must be >= 0")
            reason = fields["reason"]
            if not isinstance(reason, str):
                raise MalformedLendError("grant reason must be a str")
            return LendGrant(fields["lend_id"], block_ids, reason, fields["epoch"],
                             struct.unpack(f"<{len(sums) // 8}Q", sums))
        if magic == RELEASE_MAGIC:
            return LendRelease(fields["lend_id"], fields["epoch"])
        return LendConfirm(fields["lend_id"], fields["ok"], fields["epoch"])
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
        """The borrower is done (its read's notification, or it gave up): the loan, to unpin;
        None if unknown (expired already, or never granted). Whether it was still here is what
        the holder's `LendConfirm` says: a loan found here was pinned until now."""
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
    """How long a borrower waits for its loan (grant, read and confirm; monotonic seconds,
    from when it sent the request): half the lease, so that it usually ends before the
    holder's lease, which starts later. A bound on the wait only: the holder's confirm, not
    this time, decides whether what was read is used."""
    return sent_at + lease_ms / 2e3
