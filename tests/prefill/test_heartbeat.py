"""The prefill worker's heartbeat (prefill/heartbeat.py `Heartbeat.beat`) over the queue's real wire: it
carries the compute thread's progress to a queue that takes it, and to a queue of an earlier
version, which takes the worker id alone, it beats as before instead of falling silent (a
silent worker would have every batch failed back as stalled)."""

from __future__ import annotations

import pytest

from pdserve.cluster.queue import QueueClient
from pdserve.cluster.queue.core import QueueCore
from pdserve.cluster.queue.server import WireServer
from pdserve.common.compute_thread import ComputeProgress
from pdserve.prefill.heartbeat import Heartbeat

pytestmark = pytest.mark.timeout(60)


class Queue:
    """The queue actor's `beat` around a real core, as the wire server calls it."""

    def __init__(self):
        self.core = QueueCore(capacity=8)
        self.calls: list[tuple] = []

    async def beat(self, worker_id, progress=None):
        self.calls.append((worker_id, progress))
        return self.core.beat(worker_id, progress)


class EarlierQueue(Queue):
    """A queue of the version before compute progress: `beat(worker_id)` only."""

    async def beat(self, worker_id):  # noqa: D102  (the earlier signature, on purpose)
        self.calls.append((worker_id,))
        return self.core.beat(worker_id)


class _Endpoint:
    """What a Ray handle's `wire_endpoint.remote()` answers, for a server started here."""

    def __init__(self, endpoint: dict):
        self.endpoint = endpoint

    async def _get(self):
        return self.endpoint

    def remote(self):
        return self._get()


class _Handle:
    def __init__(self, endpoint: dict):
        self.wire_endpoint = _Endpoint(endpoint)


@pytest.fixture
async def served(monkeypatch):
    # The client asks Ray whether a loopback wire is on its own Ray node; here no Ray runs, and
    # the server is on this host by construction.
    monkeypatch.setattr(QueueClient, "_unreachable", staticmethod(lambda endpoint: None))
    servers, clients = [], []

    async def serve(target) -> Heartbeat:
        server = WireServer(target)
        host, port = await server.start("127.0.0.1")
        servers.append(server)
        client = QueueClient(_Handle({"host": host, "port": port, "token": server.token, "tls": False}), "wire")
        clients.append(client)
        return Heartbeat("p0", client, ComputeProgress(), cancel=lambda keys: None)

    yield serve
    for client in clients:
        await client.close()
    for server in servers:
        await server.close()


async def test_the_heartbeat_carries_the_compute_progress(served):
    queue = Queue()
    heartbeat = await served(queue)
    await heartbeat.beat()  # nothing running on the compute thread: no progress to judge
    heartbeat.progress.begin(2.5)
    heartbeat.progress.mark()
    await heartbeat.beat()
    assert queue.calls[0] == ("p0", None)
    (_, sent), = queue.calls[1:]
    assert sent["steps"] == 1 and sent["within_s"] == 2.5 and sent["since_s"] >= 0
    assert queue.core._progress["p0"].steps == 1


async def test_a_queue_of_an_earlier_version_gets_the_beat_it_knows(served):
    queue = EarlierQueue()
    heartbeat = await served(queue)
    heartbeat.progress.begin(1.0)
    beat = await heartbeat.beat()
    assert beat == {"instance": queue.core.instance_id, "cancelled": []}
    assert queue.calls == [("p0",)] and queue.core.live_workers() == 1
    await heartbeat.beat()  # from now on without the progress: no failed call first
    assert queue.calls == [("p0",), ("p0",)]
