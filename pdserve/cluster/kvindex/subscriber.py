"""Follow one worker's KV events (cluster/kvindex/publisher.py) into a `WorkerKVView`.

Sequence numbers keep the view exact: a batch arriving after a gap makes the subscriber
ask the publisher's replay socket for the missing ones; if the publisher no longer has
them (its buffer moved on, or the engine dropped events: engine/kv_events.py), or when the
subscriber has just joined, it starts over from a snapshot. Every request has a timeout; a
publisher that does not answer leaves the view marked unsynced, retried on the next poll.
"""

from __future__ import annotations

import time

# pyzmq's own submodules, as in publisher.py (the type checker sees no star-imported names).
from zmq.constants import DEALER, LINGER, RCVHWM, SUB, SUBSCRIBE
from zmq.sugar.context import Context
from zmq.sugar.socket import Socket

from pdserve.common.kv_events import KVEventDecodeError, decode_batch

from pdserve.cluster.kvindex.publisher import END_SEQ, SNAPSHOT, seq_bytes
from pdserve.cluster.kvindex.view import WorkerKVView


class KVEventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", request_timeout_s: float = 5.0,
                 rcvhwm: int = 100_000, idle_check_s: float = 1.0):
        self.request_timeout_s, self.idle_check_s = request_timeout_s, idle_check_s
        self._last_heard = time.monotonic()
        self._ctx = Context()
        self._sub = self._ctx.socket(SUB)
        self._sub.setsockopt(LINGER, 0)
        self._sub.setsockopt(RCVHWM, rcvhwm)
        self._sub.setsockopt(SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._dealer: Socket | None = None  # the replay socket, made when first needed
        self.view = WorkerKVView()
        self.next_seq: int | None = None  # None: not synced (joined, or a request timed out)
        self.gaps = self.replayed = self.snapshots = self.decode_errors = 0

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "KVEventSubscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def poll(self, timeout_s: float) -> int:
        """Apply what arrives within ``timeout_s``; the number of batches applied."""
        applied = 0
        deadline = time.monotonic() + timeout_s
        if self.next_seq is None:
            applied += self._resync()
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sub.poll(int(left * 1e3)):  # (ms; pyzmq truncates a float the same way)
                if self.next_seq is not None and time.monotonic() - self._last_heard > self.idle_check_s:
                    applied += self._check_idle()
                return applied
            self._last_heard = time.monotonic()
            _, raw_seq, payload = self._sub.recv_multipart()
            seq = int.from_bytes(raw_seq, "big", signed=True)
            if self.next_seq is None:
                applied += self._resync()
            if self.next_seq is None or seq < self.next_seq:
                continue  # already in the view (a snapshot or a replay covered it)
            if seq > self.next_seq:
                self.gaps += 1
                applied += self._catch_up(seq)
                if self.next_seq is None or seq < self.next_seq:
                    continue
            applied += self._apply(seq, payload)

    # -- recovery ---------------------------------------------------------------------------
    def _check_idle(self) -> int:
        """Nothing heard for a while: ask for anything from ``next_seq`` on (the last messages
        before a quiet spell can be the ones a full socket dropped, with no later one to show
        the gap); usually the answer is empty."""
        self._last_heard = time.monotonic()
        got = self._request(self._replay_from_next())
        if got is None:
            self.next_seq = None
            return 0
        applied = 0
        for seq, payload in got:
            if self.next_seq is not None and seq == self.next_seq:
                applied += self._apply(seq, payload)
                self.replayed += 1
            elif self.next_seq is not None and seq > self.next_seq:  # the buffer lost some: start over
                self.gaps += 1
                return applied + self._resync()
        return applied

    def _catch_up(self, upto: int) -> int:
        """Replay [next_seq, upto); a snapshot if the publisher lacks any of them."""
        applied = 0
        got = self._request(self._replay_from_next())
        if got is not None:
            for seq, payload in got:
                if seq == self.next_seq:
                    applied += self._apply(seq, payload)
                    self.replayed += 1
            if self.next_seq is not None and self.next_seq >= upto:
                return applied
        return applied + self._resync()

    def _replay_from_next(self) -> list[bytes]:
        """The replay request for every batch from ``next_seq`` on (asked only while synced)."""
        if self.next_seq is None:
            raise RuntimeError("KV events: a replay asked for while not synced")
        return [b"", seq_bytes(self.next_seq)]

    def _resync(self) -> int:
        got = self._request([b"", SNAPSHOT, b""])
        if not got:
            self.next_seq = None
            return 0
        (after, payload), = got  # the snapshot, and the first batch number it does not cover
        self.view = WorkerKVView()
        self.snapshots += 1
        return self._apply(after - 1, payload)

    def _apply(self, seq: int, payload: bytes) -> int:
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError:
            self.decode_errors += 1
            self.next_seq = None  # the view may miss what it carried: start over
            return 0
        self.view.apply(batch)
        self.next_seq = seq + 1
        return 1

    def _request(self, frames: list[bytes]) -> list[tuple[int, bytes]] | None:
        """Send a replay or snapshot request; its (seq, payload) replies, None on a timeout
        (the socket is then replaced, so a late answer cannot be taken for the next one's)."""
        dealer = self._dealer
        if dealer is None:
            dealer = self._dealer = self._ctx.socket(DEALER)
            dealer.setsockopt(LINGER, 0)
            dealer.connect(self._replay_endpoint)
        dealer.send_multipart(frames)
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not dealer.poll(int(left * 1e3)):  # (ms, truncated as pyzmq does)
                dealer.close(linger=0)
                self._dealer = None
                return None
            _, _, raw_seq, payload = dealer.recv_multipart()
            if raw_seq == END_SEQ:
                return out
            out.append((int.from_bytes(raw_seq, "big", signed=True), payload))
