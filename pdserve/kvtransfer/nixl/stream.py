"""`LayerStream`: write a request's pages layer by layer while the model computes the next layer."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from pdserve.kvtransfer.nixl.descriptors import WritePlan
from pdserve.kvtransfer.nixl.errors import KVTransferError, TransferError, TransferTimeoutError

if TYPE_CHECKING:
    from pdserve.kvtransfer.nixl.agent import KVTransferAgent
    from pdserve.kvtransfer.nixl.poster import Ready
    from pdserve.kvtransfer.nixl.transfer import TransferHandle


class LayerStream:
    """The pages of one request, streamed to one peer a layer at a time.

    `write_layer(l, ready)` hands over layer l's pages right after the model
    computed the layer; the write (no notification) is posted once ``ready``
    says the device has written them (kvtransfer/nixl/poster.py: at once on CPU,
    from the agent's poster thread on a GPU). `finish()` waits for every
    layer's write and only then sends the notification, so the peer never
    sees it before the last page. Created by `KVTransferAgent.begin_stream`.
    """

    def __init__(self, agent: KVTransferAgent, peer: str, plan: WritePlan, notify: bytes | None):
        self._agent = agent
        self.peer = peer
        self._plan = plan
        self._notify = notify
        self.handles: dict[int, TransferHandle] = {}
        self.finished = False
        self._claimed: set[int] = set()  # layers handed to write_layer
        self._deferred: set[int] = set()  # claimed, waiting in the poster for readiness
        self._errors: dict[int, str] = {}  # deferred layers that could not be posted
        self._cond = threading.Condition()

    @property
    def layers(self) -> tuple[int, ...]:
        return self._plan.layers

    @property
    def pending_layers(self) -> tuple[int, ...]:
        """Layers not handed to `write_layer` yet."""
        return tuple(layer for layer in self._plan.layers if layer not in self._claimed)

    def write_layer(self, layer: int, ready: Ready | None = None) -> TransferHandle | None:
        """Write layer `layer`'s pages once ``ready`` (None: they are final now); each layer
        exactly once. Returns the handle when posted at once, None when deferred."""
        if self.finished:
            raise KVTransferError("this stream is finished; begin a new one")
        if layer in self._claimed:
            raise ValueError(f"layer {layer} was already written in this stream")
        self._claimed.add(layer)
        if ready is None or ready.query():
            return self._post_now(layer)
        with self._cond:
            self._deferred.add(layer)
        self._agent._layer_poster().submit(self, layer, ready)
        return None

    def _post_now(self, layer: int) -> TransferHandle:
        handle = self._agent._post(self._agent._peer(self.peer), self._plan.for_layer(layer), None)
        with self._cond:
            self.handles[layer] = handle
        return handle

    # -- called by the poster thread -------------------------------------------------------
    def _deferred_post(self, layer: int) -> None:
        """Post a deferred layer now that it is ready (unless the stream was aborted)."""
        with self._cond:
            if self._aborted:
                self._deferred.discard(layer)
                self._cond.notify_all()
                return
            self._posting = layer
        error = None
        try:
            self._post_now(layer)
        except Exception as exc:  # noqa: BLE001  (reported by finish())
            error = f"{exc.__class__.__name__}: {exc}"
        self._settle_deferred(layer, error)

    def _deferred_failed(self, layer: int, reason: str) -> None:
        self._settle_deferred(layer, reason)

    def _settle_deferred(self, layer: int, error: str | None) -> None:
        with self._cond:
            if error is not None:
                self._errors[layer] = error
            self._deferred.discard(layer)
            if self._posting == layer:
                self._posting = None
            self._cond.notify_all()

    _aborted = False
    _posting: int | None = None  # the deferred layer the poster is posting right now

    def settle_posts(self, timeout_s: float) -> bool:
        """Wait until no layer waits in the poster (each is posted or given up); after `abort()`,
        only until no post is under way. True: no write of this stream will be posted any more
        (or, without abort, every layer is posted or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._deferred or (self._aborted and self._posting is None), timeout_s)

    def finish(self, timeout_s: float, notify: bytes | None = None) -> list[TransferHandle]:
        """Wait for every layer's write, then send the notification (if any).

        ``notify`` replaces the payload given to `begin_stream` (a prefill
        worker knows the first token only after the forward pass).

        Raises TransferError (and sends nothing) if a layer failed or the
        deadline passes; KVTransferError if layers were never written.
        """
        if self.finished:
            raise KVTransferError("this stream is already finished")
        missing = self.pending_layers
        if missing:
            raise KVTransferError(
                f"layers {list(missing)} were never written; call write_layer for each before finish"
            )
        self.finished = True
        deadline = time.monotonic() + timeout_s
        if not self.settle_posts(timeout_s):
            self.abort()
            raise TransferTimeoutError(
                f"layers {sorted(self._deferred)} were not ready to send within {timeout_s} s")
        if self._errors:
            layer = min(self._errors)
            raise TransferError(f"layer {layer} was not written: {self._errors[layer]}")
        handles = [self.handles[layer] for layer in self._plan.layers]
        for handle in handles:
            self._agent.wait(handle, max(deadline - time.monotonic(), 0.0))
        payload = notify if notify is not None else self._notify
        if payload is not None:
            self._agent.send_notification(self.peer, payload)
        return handles

    def abort(self) -> None:
        """Give up on the stream: no notification will be sent and layers still waiting for
        readiness are not posted (`settle_posts` waits for one being posted right now).
        Writes already posted still finish."""
        with self._cond:
            self.finished = True
            self._aborted = True
