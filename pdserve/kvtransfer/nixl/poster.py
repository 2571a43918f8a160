"""Posting a layer's page write only once the device has computed that layer.

On a GPU the engine thread runs ahead of the device: when the model's layer hook
fires for layer l, the kernels that write layer l's K and V may not have run yet.
A NIXL write posted then would read pages the kernels have not written (garbage
in the peer's pool, silently). So a layer comes with a *readiness* object
(`Ready`): the engine records a CUDA event on the compute stream right after the
layer (engine/kv_ready.py), and the write is posted only after the event has
completed. On CPU the kernels ran before the hook returned, so the object is
already ready and the write is posted at once, on the caller's thread.

A layer that is not ready yet goes to the agent's `LayerPoster`: one thread that
waits for each readiness in order and then posts the write, so the engine thread
never blocks on the device. `LayerStream.finish()` waits for its layers' posts.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.kvtransfer.nixl.stream import LayerStream

# How long the poster waits for one layer's readiness before it gives the layer up
# (the stream's finish() then fails): a device that has not finished a layer in
# this long is hung, not slow.
READY_TIMEOUT_S = 30.0
_IDLE_POLL_S = 0.5  # the poster's idle wake-up, to notice close()


class Ready(Protocol):
    """Readiness of one layer's KV in the pool (engine/kv_ready.py makes them)."""

    def query(self) -> bool:
        """True once the layer's pages hold their final bytes (never blocks)."""

    def wait(self, timeout_s: float) -> bool:
        """Block until ready or `timeout_s` passes; True if ready."""


class LayerPoster:
    """One thread that posts layer writes in order, each once its layer is ready."""

    def __init__(self, name: str, ready_timeout_s: float = READY_TIMEOUT_S):
        self._queue: queue.Queue = queue.Queue()
        self._ready_timeout_s = ready_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-poster-{name}", daemon=True)
        self._thread.start()

    def submit(self, stream: LayerStream, layer: int, ready: Ready) -> None:
        self._queue.put((stream, layer, ready))

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stream, layer, ready = self._queue.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                continue
            try:
                ok = ready.wait(self._ready_timeout_s)
            except Exception as exc:  # noqa: BLE001  (e.g. a CUDA error: reported by finish())
                stream._deferred_failed(layer, f"waiting for layer {layer}'s KV failed: {exc!r}")
                continue
            if ok:
                stream._deferred_post(layer)
            else:
                stream._deferred_failed(layer, f"layer {layer}'s KV was not ready within "
                                               f"{self._ready_timeout_s} s (the device is hung)")
        while True:  # closed: nothing more is posted; streams still waiting learn it now
            try:
                stream, layer, _ = self._queue.get_nowait()
            except queue.Empty:
                return
            stream._deferred_failed(layer, "the transfer agent was closed before the layer was sent")
