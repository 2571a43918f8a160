"""What the handoff needs from the KV data plane: the transport interface both workers use.

The prefill side posts page writes into blocks the decode worker reserved
and lets a notice ride behind the last one; the decode side polls what
arrived. Neither side names NIXL: `prefill/batch.py` and `decode/kv_arrival.py`
hold a `KVSender` / `KVReceiver`, and `pdserve.kvtransfer.KVTransferAgent`
is the implementation (NIXL over UCX). A test checks that it satisfies both
(tests/handoff/test_transport.py), so the contract here and the agent cannot
drift apart.

The errors are the contract's too: a transport raises `TransportError`
subclasses, so the workers catch them without importing the transport.

    post          write_blocks(peer, local, remote, notify=) -> WriteHandle
                  begin_stream(peer, local, remote, notify) -> LayerWrites (write per layer, finish)
    settle        wait(handle, timeout_s)   WriteFailed / WriteTimedOut when it did not land
    notify        send_notification(peer, payload)   at most MAX_NOTIFICATION_BYTES
    poll          poll() -> .notifications: [(sender, payload)], and drives progress
    release       a finished handle is forgotten at the next poll(); a stream's
                  abort() posts nothing more
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

# A notice rides on a small active message: every transport carries at least this many bytes
# per notification, and no notice of the protocol (kvtransfer/notices.py) is larger.
MAX_NOTIFICATION_BYTES = 1024


class TransportError(Exception):
    """Something the transport could not do (an unknown peer, a failed post); the request it
    served fails, the worker goes on."""


class WriteFailed(TransportError):
    """A posted page write did not land (peer gone, link error). Nothing more of it will."""


class WriteTimedOut(WriteFailed):
    """A wait ran out of time: the write may still land later (the blocks it targets must not
    be reused until the attempt is over)."""


class WriteHandle(Protocol):
    """One posted write."""

    @property
    def num_bytes(self) -> int: ...

    @property
    def finished(self) -> bool:
        """Landed or failed: nothing more of it is in flight."""


class LayerWrites(Protocol):
    """A request's pages, posted one layer at a time while the model computes the next."""

    @property
    def finished(self) -> bool:
        """Finished or aborted: it posts nothing more."""

    @property
    def handles(self) -> Mapping[int, Any]:
        """Layer -> its WriteHandle, once posted."""

    def write_layer(self, layer: int, ready: Any = None) -> Any:
        """Post layer `layer` once `ready` says its pages are final (None: now)."""

    def finish(self, timeout_s: float, notify: bytes | None = None) -> list:
        """Wait for every layer's write, then send `notify`; WriteFailed if one did not land."""

    def abort(self) -> None:
        """Post nothing more and send no notice; writes already posted still finish."""

    def settle_posts(self, timeout_s: float) -> bool:
        """Wait until no post is under way; False on timeout."""


class Arrival(Protocol):
    @property
    def sender(self) -> str: ...

    @property
    def payload(self) -> bytes: ...


A_co = TypeVar("A_co", bound=Arrival, covariant=True)


class Polled(Protocol[A_co]):
    """What one poll of the transport returned: the notices that arrived, and the transfers
    this side posted that finished or failed since (a worker's prefix reads)."""

    @property
    def notifications(self) -> Sequence[A_co]: ...

    @property
    def completed(self) -> Sequence[Any]: ...

    @property
    def failed(self) -> Sequence[Any]: ...


@runtime_checkable
class KVReceiver(Protocol):
    """The decode side: learns what arrived (and drives the transport's progress)."""

    def poll(self) -> Polled[Arrival]: ...


@runtime_checkable
class KVSender(Protocol):
    """The prefill side: posts page writes into a peer's reserved blocks, then a notice."""

    @property
    def peers(self) -> Iterable[str]:
        """The peers this transport can reach now."""

    def write_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int], *,
                     notify: bytes | None = None) -> WriteHandle: ...

    def begin_stream(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                     notify: bytes | None = None) -> LayerWrites: ...

    def wait(self, handle: WriteHandle, timeout_s: float) -> WriteHandle: ...

    def send_notification(self, peer: str, payload: bytes) -> None: ...

    def poll(self) -> Polled[Arrival]: ...


def check_notification(payload: bytes | None) -> None:
    """Refuse a notification that is not 1..MAX_NOTIFICATION_BYTES bytes (None: no notification)."""
    if payload is None:
        return
    if not isinstance(payload, bytes):
        raise TypeError(f"a notification must be bytes, got {type(payload).__name__}")
    if not payload or len(payload) > MAX_NOTIFICATION_BYTES:
        raise ValueError(
            f"a notification must be 1..{MAX_NOTIFICATION_BYTES} bytes, got {len(payload)}; "
            "send large data as pages, not notifications"
        )
