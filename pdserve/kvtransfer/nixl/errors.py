"""Typed errors of pdserve.kvtransfer: each says what went wrong and what to change."""

from __future__ import annotations

from pdserve.kvtransfer.transport import TransportError, WriteFailed, WriteTimedOut


class KVTransferError(TransportError):
    """Base class of every error this package raises on purpose (a `TransportError` of the
    handoff's transport contract, kvtransfer/transport.py)."""


class NixlUnavailableError(KVTransferError, ImportError):
    """No importable NIXL Python API (install `nixl-cu12`)."""


class LayoutMismatchError(KVTransferError, ValueError):
    """Two KV pools cannot exchange pages: one layout field differs.

    Raised at first contact (`add_peer`), before any byte moves.
    """

    def __init__(self, field: str, mine: object, theirs: object):
        self.field = field
        self.mine = mine
        self.theirs = theirs
        hint = (" Both roles must run the same engine argument kv_cache_dtype (and, for FP8, the same "
                "k_scale/v_scale per layer: the same checkpoint, and the same calculate_kv_scales and "
                "kv_scale_granularity)." if field in ("kv_cache_dtype", "kv_scales") else "")
        if field == "kv_scales" and isinstance(mine, tuple) and isinstance(theirs, tuple):
            layer = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            what = (f"at layer {layer} this worker has {mine[layer] if layer < len(mine) else 'none'!r}, the peer "
                    f"has {theirs[layer] if layer < len(theirs) else 'none'!r} ({len(mine)} and {len(theirs)} layers)")
        else:
            what = f"this worker has {mine!r}, the peer has {theirs!r}"
        super().__init__(
            f"KV layout field {field!r} differs: {what}. Prefill and decode workers must serve the same model with the same "
            f"dtype, num_layers, block_size, num_kv_heads and head_dim.{hint}"
        )


class TransferError(KVTransferError, WriteFailed):
    """A page write failed (peer gone, NIXL/UCX error) or did not finish in time.

    The agent stays usable: drop the peer (`remove_peer`) or retry elsewhere.
    """


class TransferTimeoutError(TransferError, WriteTimedOut):
    """A wait ran out of time before the transfer completed."""


class UnknownPeerError(TransferError):
    """A write named a peer that was never added or was removed (lease gone)."""


class MalformedMessageError(KVTransferError, ValueError):
    """A peer record passed to `add_peer` is not valid for this version (the handoff's
    notices have their own error, `pdserve.kvtransfer.MalformedNoticeError`)."""
