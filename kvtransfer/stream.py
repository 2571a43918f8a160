"""`LayerStream`: write a request's pages layer by layer while the model computes the next layer."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.kvtransfer.descriptors import WritePlan
from pdserve.kvtransfer.errors import KVTransferError

if TYPE_CHECKING:
    from pdserve.kvtransfer.agent import KVTransferAgent
    from pdserve.kvtransfer.transfer import TransferHandle


class LayerStream:
    """The pages of one request, streamed to one peer a layer at a time.

    `write_layer(l)` posts layer l's pages (no notification) right after the
    layer is computed; `finish()` waits for every layer's write and only then
    sends the notification, so the peer never sees it before the last page.
    Created by `KVTransferAgent.begin_stream`.
    """

    def __init__(self, agent: KVTransferAgent, peer: str, plan: WritePlan, notify: bytes | None):
        self._agent = agent
        self.peer = peer
        self._plan = plan
        self._notify = notify
        self.handles: dict[int, TransferHandle] = {}
        self.finished = False

    @property
    def layers(self) -> tuple[int, ...]:
        return self._plan.layers

    @property
    def pending_layers(self) -> tuple[int, ...]:
        """Layers not written yet."""
        return tuple(layer for layer in self._plan.layers if layer not in self.handles)

    def write_layer(self, layer: int) -> TransferHandle:
        """Post the write of layer `layer`'s pages; each layer exactly once."""
        if self.finished:
            raise KVTransferError("this stream is finished; begin a new one")
        if layer in self.handles:
            raise ValueError(f"layer {layer} was already written in this stream")
        handle = self._agent._post(self._agent._peer(self.peer), self._plan.for_layer(layer), None)
        self.handles[layer] = handle
        return handle

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
        handles = [self.handles[layer] for layer in self._plan.layers]
        for handle in handles:
            self._agent.wait(handle, max(deadline - time.monotonic(), 0.0))
        payload = notify if notify is not None else self._notify
        if payload is not None:
            self._agent.send_notification(self.peer, payload)
        return handles

    def abort(self) -> None:
        """Give up on the stream: no notification will be sent. Writes already posted still finish."""
        self.finished = True

