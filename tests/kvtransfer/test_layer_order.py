"""A layer's page write is posted only after that layer's KV is ready (issue: the GPU path).

On a GPU the engine thread runs ahead of the device, so a layer's pages may still be
unwritten when the layer hook fires; the hook passes a readiness object (a CUDA event
there, engine/kv_ready.py) and the stream must not post the layer's NIXL write before
it completes. Here the readiness is a gate the test opens, the same interface a CUDA
event offers (`query`, `wait`), and the sender's pool gets each layer's final bytes
only just before its gate opens, as a late kernel would write them: posting early
would send stale bytes, and the spy on the agent's post sees it first.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.engine.kv_ready import HOST_READY, layer_ready
from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV, KVLayout, KVTransferAgent
from pdserve.kvtransfer.nixl.errors import TransferError

LAYOUT = KVLayout("tiny", "float32", num_layers=4, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
LOCAL, REMOTE = [1, 2, 5], [6, 0, 3]


class Gate:
    """A readiness the test opens by hand."""

    def __init__(self):
        self.opened = threading.Event()

    def query(self) -> bool:
        return self.opened.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self.opened.wait(timeout_s)


def _pool(fill: float) -> torch.Tensor:
    shape = (LAYOUT.num_layers, LAYOUT.num_blocks, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.full(shape, fill, dtype=torch.float32)


@pytest.fixture(scope="module")
def agents():
    sent_kv, recv_kv = _pool(1.0), _pool(0.0)
    sender = KVTransferAgent("order-s", sent_kv, LAYOUT, ucx_env=LOOPBACK_UCX_ENV)
    receiver = KVTransferAgent("order-r", recv_kv, LAYOUT, ucx_env=LOOPBACK_UCX_ENV)
    sender.add_peer(receiver.local_info())
    stop = threading.Event()

    def keep_polling():  # the target must progress for wireup and notifications
        while not stop.is_set():
            notes = receiver.poll().notifications
            receiver.notes.extend(notes)
            time.sleep(0.001)

    receiver.notes = []
    poller = threading.Thread(target=keep_polling, daemon=True)
    poller.start()
    yield sender, receiver, sent_kv, recv_kv
    stop.set()
    poller.join(5)
    sender.close()
    receiver.close()


def _spy_posts(sender, gates, monkeypatch) -> list[tuple[int, bool]]:
    """(layer, was its gate open) for every write the sender posts."""
    posts = []
    real = sender._post

    def spy(peer, plan, notify):
        posts.append((plan.layers[0], gates[plan.layers[0]].query()))
        return real(peer, plan, notify)

    monkeypatch.setattr(sender, "_post", spy)
    return posts


def _wait_note(receiver, payload: bytes, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(n.payload == payload for n in receiver.notes):
        assert time.monotonic() < deadline, f"notification {payload!r} never arrived"
        time.sleep(0.005)


def test_each_layer_is_posted_only_after_its_readiness(agents, monkeypatch):
    sender, receiver, sent_kv, recv_kv = agents
    gates = [Gate() for _ in range(LAYOUT.num_layers)]
    posts = _spy_posts(sender, gates, monkeypatch)
    stream = sender.begin_stream("order-r", LOCAL, REMOTE)
    for layer in range(LAYOUT.num_layers):
        assert stream.write_layer(layer, gates[layer]) is None  # not ready: deferred
    time.sleep(0.05)
    assert posts == [], "a layer was posted before its KV was ready"
    for layer in range(LAYOUT.num_layers):  # the "device" finishes each layer, then signals
        sent_kv[layer, LOCAL] = 10.0 + layer
        gates[layer].opened.set()
    stream.finish(10.0, notify=b"order-1")
    _wait_note(receiver, b"order-1")

    assert [layer for layer, _ in posts] == list(range(LAYOUT.num_layers))
    assert all(opened for _, opened in posts), f"posted before ready: {posts}"
    for layer in range(LAYOUT.num_layers):
        got = recv_kv[layer, REMOTE]
        assert torch.equal(got, torch.full_like(got, 10.0 + layer)), f"layer {layer} carries stale KV"


def test_ready_layers_post_at_once_and_a_layer_never_ready_fails_finish(agents, monkeypatch):
    sender, receiver, _, _ = agents
    gates = [Gate() for _ in range(LAYOUT.num_layers)]
    for gate in gates[:-1]:
        gate.opened.set()
    posts = _spy_posts(sender, gates, monkeypatch)
    stream = sender.begin_stream("order-r", LOCAL, REMOTE)
    handles = [stream.write_layer(layer, gates[layer]) for layer in range(LAYOUT.num_layers)]
    assert all(h is not None for h in handles[:-1]) and handles[-1] is None
    assert [layer for layer, _ in posts] == [0, 1, 2]

    with pytest.raises(TransferError, match="not ready"):
        stream.finish(0.3, notify=b"never")
    assert stream.settle_posts(5.0)
    gates[-1].opened.set()  # too late: an aborted stream posts nothing more
    time.sleep(0.05)
    assert [layer for layer, _ in posts] == [0, 1, 2]
    assert not any(n.payload == b"never" for n in receiver.notes)


def test_the_engine_hands_each_layer_its_readiness(llama_dir):
    """CPU: the model calls hook(l, ready) for every layer in order, each ready at once."""
    assert layer_ready(torch.device("cpu")) is HOST_READY and HOST_READY.query() and HOST_READY.wait(0)
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(llama_dir, kv_cache_memory_bytes=4 << 20)
    seen = []
    llm.engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=1), request_id="r")
    llm.engine.step(layer_hook=lambda layer, ready: seen.append((layer, ready.query())))
    layers = llm.engine.model_config.num_layers
    assert seen == [(layer, True) for layer in range(layers)] and layers >= 2


@pytest.mark.gpu
def test_gpu_layer_writes_carry_what_the_kernels_wrote():
    """VRAM pools: each layer's bytes are written by a kernel queued behind a long device
    sleep when the hook fires; the page write must wait for the layer's CUDA event."""
    layout = KVLayout("tiny", "float16", num_layers=4, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    shape = (4, 8, 2, 4, 2, 8)
    sent_kv = torch.zeros(shape, dtype=torch.float16, device="cuda")
    recv_kv = torch.zeros(shape, dtype=torch.float16, device="cuda")
    sender = KVTransferAgent("order-gs", sent_kv, layout, ucx_env=LOOPBACK_UCX_ENV)
    receiver = KVTransferAgent("order-gr", recv_kv, layout, ucx_env=LOOPBACK_UCX_ENV)
    stop = threading.Event()
    notes = []

    def keep_polling():
        while not stop.is_set():
            notes.extend(receiver.poll().notifications)
            time.sleep(0.001)

    poller = threading.Thread(target=keep_polling, daemon=True)
    poller.start()
    try:
        sender.add_peer(receiver.local_info())
        stream = sender.begin_stream("order-gr", LOCAL, REMOTE)
        # Each layer's final bytes, made beforehand: the fill below is a plain device copy, which
        # never waits for the host (an indexed fill may).
        final = torch.zeros_like(sent_kv)
        for layer in range(layout.num_layers):
            final[layer, LOCAL] = float(layer + 1)
        torch.cuda.synchronize()
        posted_at_once = []
        for layer in range(layout.num_layers):
            torch.cuda._sleep(200_000_000)  # ~0.1 s busy: the copy below runs much later
            sent_kv[layer].copy_(final[layer], non_blocking=True)
            posted_at_once.append(stream.write_layer(layer, layer_ready(torch.device("cuda"))) is not None)
        assert not posted_at_once[0], "layer 0 was ready at once: the device did not lag, the test proves nothing"
        stream.finish(30.0, notify=b"gpu-order")
        deadline = time.monotonic() + 10
        while not any(n.payload == b"gpu-order" for n in notes):
            assert time.monotonic() < deadline, "no notification"
            time.sleep(0.005)
        torch.cuda.synchronize()
        for layer in range(layout.num_layers):
            got = recv_kv[layer, REMOTE]
            assert torch.equal(got, torch.full_like(got, layer + 1)), f"layer {layer} carries stale KV"
    finally:
        stop.set()
        poller.join(5)
        sender.close()
        receiver.close()
