"""A worker's KV events on the wire: vLLM's ZMQ protocol, so vLLM's subscribers work too.

- PUB socket: one message per batch, frames ``[topic, seq (8 bytes, big-endian), payload]``
  (payload: common/kv_events.py `encode_batch`). PUB never blocks: a subscriber that falls
  ``hwm`` messages behind loses messages, sees the gap in ``seq`` and asks for them again.
- ROUTER socket (replay): a request ``[b"", start_seq]`` (8 bytes) is answered with every
  buffered batch from ``start_seq`` on, each ``[b"", topic, seq, payload]``, then the end
  marker ``[b"", b"", END_SEQ, b""]`` (vLLM's protocol). pdserve adds ``[b"", b"snapshot",
  b""]``: the worker's whole cache as one batch (AllBlocksCleared, then BlockStored) whose
  seq frame is the first batch number after it, then the end marker: a subscriber that joins late, or finds a
  gap the buffer no longer covers, starts over from it.

The publisher's thread owns both sockets and takes batches from the engine's `KVEventLog`
every ``interval_s``; the engine thread only appends to the log.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Protocol

# pyzmq's own submodules: the names `import zmq` re-exports by star imports are not seen by
# the type checker, which reads these third-party packages as untyped.
from zmq.constants import LAST_ENDPOINT, LINGER, NOBLOCK, POLLIN, PUB, ROUTER, SNDHWM
from zmq.error import Again, ZMQError
from zmq.sugar.context import Context
from zmq.sugar.poll import Poller
from zmq.sugar.socket import Socket

from pdserve.common.kv_events import KVEventBatch, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT = b"snapshot"
DEFAULT_BUFFER_BATCHES = 10_000
DEFAULT_HWM = 100_000


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class EventSource(Protocol):
    """Where the publisher takes its batches: the engine's `KVEventLog` (engine/kv_events.py)."""

    def take_batch(self) -> tuple[int, KVEventBatch] | None: ...

    def snapshot(self) -> tuple[tuple[int, KVEventBatch] | None, int, KVEventBatch]: ...


class KVEventPublisher:
    def __init__(self, events: EventSource, host: str = "127.0.0.1", port: int = 0, replay_port: int = 0,
                 topic: str = "", buffer_batches: int = DEFAULT_BUFFER_BATCHES, hwm: int = DEFAULT_HWM,
                 interval_s: float = 0.005):
        self.events, self.interval_s = events, interval_s
        self.topic = topic.encode()
        self._ctx = Context()
        self._pub = self._ctx.socket(PUB)
        self._pub.setsockopt(SNDHWM, hwm)
        self._pub.setsockopt(LINGER, 0)
        self._router = self._ctx.socket(ROUTER)
        self._router.setsockopt(LINGER, 0)
        try:
            self.endpoint = _bind(self._pub, host, port)
            self.replay_endpoint = _bind(self._router, host, replay_port)
        except ZMQError:
            self._close_sockets()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.published = self.replays = self.snapshots = self.bad_requests = 0

    def start(self) -> "KVEventPublisher":
        self._thread.start()
        log.info("KV events: publishing on %s, replay and snapshots on %s", self.endpoint, self.replay_endpoint)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def __enter__(self) -> "KVEventPublisher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the publisher's thread -------------------------------------------------------------
    def _run(self) -> None:
        poller = Poller()
        poller.register(self._router, POLLIN)
        while not self._stop.is_set():
            try:
                self._publish_pending()
                if poller.poll(int(self.interval_s * 1e3)):  # (ms; pyzmq truncates a float the same way)
                    self._serve()
            except Exception:  # noqa: BLE001  (logged; the engine goes on, subscribers resync)
                log.exception("KV events: publishing failed")
                self._stop.wait(0.1)
        self._publish_pending()

    def _publish_pending(self) -> None:
        taken = self.events.take_batch()
        if taken is not None:
            self._publish(*taken)

    def _publish(self, seq: int, batch: KVEventBatch) -> None:
        payload = encode_batch(batch)
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, seq_bytes(seq), payload], flags=NOBLOCK)
        except Again:
            pass  # subscribers at their high-water mark: they see the gap and replay
        self.published += 1

    def _serve(self) -> None:
        frames = self._router.recv_multipart(NOBLOCK)
        client = frames[0]
        if len(frames) == 3 and len(frames[2]) == 8:
            start = int.from_bytes(frames[2], "big", signed=True)
            self.replays += 1
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._router.send_multipart([client, b"", self.topic, seq_bytes(seq), payload])
        elif len(frames) == 4 and frames[2] == SNAPSHOT:
            flushed, seq, batch = self.events.snapshot()
            if flushed is not None:
                self._publish(*flushed)
            self.snapshots += 1
            # Its seq frame is the first batch after it (>= 0: never the end marker's -1).
            self._router.send_multipart([client, b"", self.topic, seq_bytes(seq + 1), encode_batch(batch)])
        else:
            self.bad_requests += 1
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
        self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()


def _bind(sock: Socket, host: str, port: int) -> str:
    """Bind ``host:port`` (0: a free port); the endpoint bound (a subscriber's address)."""
    sock.bind(f"tcp://{host}:{port}")
    return sock.getsockopt_string(LAST_ENDPOINT)


def start_event_publisher(engine, host: str) -> KVEventPublisher | None:
    """The publisher of a worker whose engine records KV events (engine arg ``kv_events``),
    bound on the worker's address at free ports; None when it records none."""
    if getattr(engine, "kv_events", None) is None:
        return None
    return KVEventPublisher(engine.kv_events, host=host).start()


def record_endpoints(pub: KVEventPublisher | None) -> dict[str, str]:
    """The worker record's endpoints for its KV events (cluster/records.py `WorkerInfo`),
    as "host:port" like its others; the index connects to them (cluster/kvindex/service.py)."""
    if pub is None:
        return {}
    return {"kv_events": pub.endpoint.removeprefix("tcp://"),
            "kv_events_replay": pub.replay_endpoint.removeprefix("tcp://")}
