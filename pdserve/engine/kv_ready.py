"""Readiness of one layer's KV: what a page write waits for before it reads the pool.

The model's layer hook (`CausalLM.forward(layer_hook=...)`) is called as
``layer_hook(l, ready)`` right after layer ``l`` was issued. On CUDA the kernels
that write the layer's K/V may still be queued when the hook runs, so ``ready``
is a CUDA event recorded on the compute stream after the layer: whoever reads
those pages from outside the stream (a NIXL write) must wait for it first
(kvtransfer/nixl/poster.py). On CPU every op has run when the hook is called, so
``ready`` is `HOST_READY`, which is always ready.
"""

from __future__ import annotations

import time

import torch

_SPIN_SLEEP_S = 100e-6  # between event queries in wait(): a layer takes about this long or more


class HostReady:
    """The pages were written synchronously (CPU): always ready."""

    def query(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True

    def __repr__(self) -> str:
        return "HostReady()"


HOST_READY = HostReady()


class CudaReady:
    """A CUDA event recorded on the stream that computed the layer."""

    def __init__(self, stream: torch.cuda.Stream):
        self.device = stream.device
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def query(self) -> bool:
        with torch.cuda.device(self.device):  # another thread's current device may be GPU 0
            return self.event.query()

    def wait(self, timeout_s: float) -> bool:
        """Poll the event (a CUDA event cannot be waited on with a deadline) until it
        completes; False if `timeout_s` passes first. Sleeps between polls, releasing the
        GIL to the engine thread that is launching the next layers."""
        deadline = time.monotonic() + timeout_s
        with torch.cuda.device(self.device):
            while not self.event.query():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(_SPIN_SLEEP_S)
        return True


def layer_ready(device: torch.device) -> HostReady | CudaReady:
    """The readiness of everything issued so far on ``device``'s current stream."""
    if device.type == "cuda":
        return CudaReady(torch.cuda.current_stream(device))
    return HOST_READY
