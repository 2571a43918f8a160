"""The queue's wire (queue calls over a socket the Ray actor serves): hostile and broken
clients, TLS, dead callers, the fallback to Ray calls. The API itself is covered for both
transports in test_queue.py."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgpack
import pytest
import ray

from pdserve.certs import make_certs
from pdserve.cluster.security import ClientTLS
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.kvtransfer import PrefillTask
from pdserve.cluster.queue import QueueClient, get_or_create_queue, open_queue
from pdserve.cluster.queue.client import QueueCallError, QueueUnavailableError
from pdserve.cluster.queue.core import QueueCore
from pdserve.cluster.queue.frames import MAX_FRAME_BYTES, MAX_HELLO_BYTES, WireError, pack_frame, read_frame, to_wire
from pdserve.cluster.queue.server import WireServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def handle(ray_local):
    h = get_or_create_queue(f"w-{uuid.uuid4().hex[:8]}", "pdserve-tests", capacity=16)
    yield h
    ray.kill(h)


def task(request_id: str, num_tokens: int = 8, target: str = "d0") -> PrefillTask:
    return PrefillTask(request_id=request_id, epoch=0, token_ids=list(range(num_tokens)), cached_len=0,
                       target_worker_id=target, target_block_ids=[0])


async def raw_connect(endpoint: dict, token: str | None = None):
    """A hand-written client: hello with `token` (default: the right one)."""
    reader, writer = await asyncio.open_connection(endpoint["host"], endpoint["port"])
    writer.write(pack_frame({"hello": endpoint["token"] if token is None else token, "v": 1}))
    return reader, writer, await asyncio.wait_for(read_frame(reader), 10)


async def test_the_wire_listens_on_loopback_only_and_wants_the_token(handle):
    endpoint = await handle.wire_endpoint.remote()
    assert endpoint["host"] == "127.0.0.1"
    reader, writer, reply = await raw_connect(endpoint, token="0" * 32)
    assert reply["ok"] is False and reply["error"]["type"] == "PermissionError"
    assert await reader.read() == b""  # and the connection is closed
    writer.close()
    # A client with the token is served.
    client = QueueClient(handle, "wire")
    assert (await client.put(task("a"))).ok and client.in_use == "wire"
    await client.close()


async def test_a_huge_first_frame_is_refused_from_its_length_before_any_body_is_read(handle):
    """Without the token, a peer gets the server to read 4 bytes: a 60 MiB length prefix closes
    the connection at once (the server does not wait for, read or allocate the body)."""
    endpoint = await handle.wire_endpoint.remote()
    reader, writer = await asyncio.open_connection(endpoint["host"], endpoint["port"])
    writer.write((60 << 20).to_bytes(4, "big") + b"\x00" * 1024)  # the header and a little of the "body"
    await writer.drain()
    # Well within HELLO_TIMEOUT_S (10 s), which is what a server waiting for the body would take.
    reply = await asyncio.wait_for(read_frame(reader), 3)
    assert reply["ok"] is False and reply["error"]["type"] == "WireError"
    assert f"MAX_HELLO_BYTES={MAX_HELLO_BYTES}" in reply["error"]["message"]
    assert await asyncio.wait_for(reader.read(), 3) == b""
    writer.close()
    counters = (await handle.stats.remote()).counters
    assert counters["wire_bad_hello"] == 1 and counters["wire_connections"] == 0


async def test_malformed_frames_close_that_connection_and_nothing_else(handle):
    endpoint = await handle.wire_endpoint.remote()
    good = QueueClient(handle, "wire")
    assert (await good.put(task("a"))).ok
    # A length beyond the limit, then bytes that are not msgpack: each connection is dropped with a reason.
    for junk in [(MAX_FRAME_BYTES + 1).to_bytes(4, "big"), (3).to_bytes(4, "big") + b"\xc1\xc1\xc1"]:
        reader, writer, reply = await raw_connect(endpoint)
        assert reply["ok"] is True
        writer.write(junk)
        closing = await asyncio.wait_for(read_frame(reader), 10)
        assert closing["ok"] is False and closing["error"]["type"] == "WireError"
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    # Requests that decode but make no sense get a typed error and the connection stays up.
    reader, writer, _ = await raw_connect(endpoint)
    for request, expect in [
        ({"id": 1, "m": "drop_all_tables", "a": []}, "unknown method 'drop_all_tables'"),
        ({"id": 2, "m": "put", "a": [{"request_id": "x", "bogus": 1}]}, "unknown field(s) ['bogus']"),
        ({"id": 3, "m": "put", "a": [dict(to_wire(task("y")), cached_len=99)]}, "cached_len=99"),
        ({"id": 4, "m": "get_batch", "a": ["p0", "lots"]}, "max_tokens must be an int"),
        ({"id": 5, "m": "stats", "a": "not-a-list"}, "'a' must be a list"),
    ]:
        writer.write(pack_frame(request))
        reply = await asyncio.wait_for(read_frame(reader), 10)
        assert reply["id"] == request["id"] and reply["ok"] is False, reply
        assert expect in reply["error"]["message"], reply
    writer.close()
    # The queue is intact: the good client's task is still there, nothing else got in.
    stats = await good.stats()
    assert stats.depth == 1 and stats.counters["put"] == 1
    assert [t.request_id for t in await good.get_batch("p0", 100)] == ["a"]
    await good.close()


async def test_bad_arguments_raise_typed_errors_through_the_client(handle):
    client = QueueClient(handle, "wire")
    with pytest.raises(QueueCallError, match="max_wait_ms must be a number") as err:
        await client.get_batch("p0", 100, -5)
    assert err.value.type == "ValueError"
    with pytest.raises(QueueCallError, match="worker_id must be a non-empty string"):
        await client.get_batch("", 100)
    assert (await client.put(task("still-fine"))).ok  # the connection survived both
    await client.close()


@ray.remote(num_cpus=0)
class Poller:
    """A prefill worker stand-in: long-polls get_batch over the wire."""

    def __init__(self, queue):
        self.client = QueueClient(queue, "wire")

    async def connect(self) -> str:
        await self.client.stats()
        return self.client.in_use

    async def poll(self, worker_id: str, wait_ms: float) -> list[str]:
        return [t.request_id for t in await self.client.get_batch(worker_id, 100, wait_ms)]


async def test_a_killed_pollers_long_poll_ends_with_its_connection(handle):
    """Over Ray, a poll outlives its killed caller until the registry reports it gone;
    over the wire, the closed socket ends it at once, so the next task is not lost."""
    poller = Poller.remote(handle)
    assert await poller.connect.remote() == "wire"
    pending = poller.poll.remote("p-doomed", 30_000)
    client = QueueClient(handle, "wire")
    await asyncio.sleep(0.5)  # the poll is waiting in the queue actor
    ray.kill(poller)
    with pytest.raises(ray.exceptions.RayActorError):
        await pending
    await asyncio.sleep(0.3)  # the queue sees the socket close
    assert (await client.put(task("after-kill"))).ok
    assert [t.request_id for t in await client.get_batch("p-live", 100, 1000)] == ["after-kill"]
    assert (await client.stats()).in_flight == {"p-live": 1}
    await client.close()


async def test_a_batch_that_could_not_be_sent_goes_back_to_its_place():
    """The race the wire server guards: the batch is taken just as its connection closes."""

    class Target:  # a queue whose get_batch finishes even when its caller is gone
        def __init__(self):
            self.core = QueueCore(capacity=8)
            self.release = asyncio.Event()

        async def get_batch(self, worker_id, max_tokens, *rest):
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                pass  # deliberately: the take below happens after the connection closed
            return self.core.take(worker_id, max_tokens)

    target = Target()
    target.core.put(task("first"))
    target.core.put(task("second"))
    server = WireServer(target, on_undelivered=target.core.untake)
    host, port = await server.start("127.0.0.1")
    reader, writer, reply = await raw_connect({"host": host, "port": port, "token": server.token})
    writer.write(pack_frame({"id": 1, "m": "get_batch", "a": ["p0", 100]}))
    await asyncio.sleep(0.2)
    writer.close()
    for _ in range(100):  # bounded: up to 5 s
        if server.counters["undelivered"]:
            break
        await asyncio.sleep(0.05)
    assert server.counters["undelivered"] == 2
    stats = target.core.stats()
    assert stats.depth == 2 and stats.in_flight == {} and stats.counters["returned_undelivered"] == 2
    assert [t.request_id for t in target.core.take("p1", 100)] == ["first", "second"]  # same order
    await server.close()


async def test_a_dead_queue_fails_pending_calls_instead_of_hanging(ray_local):
    h = get_or_create_queue(f"w-{uuid.uuid4().hex[:8]}", "pdserve-tests", capacity=4)
    client = QueueClient(h, "wire")
    await client.stats()
    waiting = asyncio.ensure_future(client.get_batch("p0", 100, 60_000))
    await asyncio.sleep(0.3)
    ray.kill(h)
    started = time.monotonic()
    with pytest.raises(QueueUnavailableError):
        await asyncio.wait_for(waiting, 20)
    assert time.monotonic() - started < 20
    with pytest.raises((ray.exceptions.RayActorError, QueueUnavailableError)):
        await client.stats()  # the reconnect finds the actor gone
    await client.close()


async def test_auto_uses_ray_calls_when_the_queue_serves_no_wire(ray_local):
    h = get_or_create_queue(f"w-{uuid.uuid4().hex[:8]}", "pdserve-tests", capacity=4, wire_bind="off")
    try:
        auto = QueueClient(h)
        assert (await auto.put(task("a"))).ok and auto.in_use == "ray"
        assert [t.request_id for t in await auto.get_batch("p0", 100)] == ["a"]
        with pytest.raises(QueueUnavailableError, match="queue.transport: ray|serves no wire"):
            await QueueClient(h, "wire").stats()
    finally:
        ray.kill(h)


async def test_a_client_stays_on_its_event_loop(handle):
    client = QueueClient(handle, "wire")
    await client.stats()

    def elsewhere():
        return asyncio.run(client.stats())

    with pytest.raises(RuntimeError, match="one client per event loop"):
        await asyncio.to_thread(elsewhere)
    await client.close()


def test_tasks_cross_the_wire_as_plain_msgpack_unchanged():
    t = PrefillTask(request_id="r", epoch=3, token_ids=[5, 2**31 - 1, 0], cached_len=1, target_worker_id="d",
                    target_block_ids=[7, 9], sampling_params={"temperature": 0.5, "stop": ["x"]}, priority="high",
                    deadline=123.5, arrival_time=100.25, origin="d2")
    frame = pack_frame({"id": 1, "m": "put", "a": [to_wire(t)]})
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    body = msgpack.unpackb(frame[4:], raw=False)  # any msgpack reader can decode it
    assert PrefillTask(**body["a"][0]) == t


# -- TLS --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and certificates for 127.0.0.1 (the loopback wire), and a CA that signed none of them."""
    root = tmp_path_factory.mktemp("pki")
    return make_certs(root / "ours", ["127.0.0.1"]), make_certs(root / "theirs", ["127.0.0.1"])


def tls_queue(pki, client_ca: bool = False, name: str | None = None):
    ours = pki[0]
    return get_or_create_queue(name or f"w-{uuid.uuid4().hex[:8]}", "pdserve-tests", capacity=16, wire_tls={
        "cert": str(ours["queue"]), "key": str(ours["queue-key"]), "client_ca": str(ours["ca"]) if client_ca else None})


async def test_a_tls_wire_serves_clients_with_the_ca_and_refuses_plaintext_ones(ray_local, pki):
    ours, theirs = pki
    name = f"w-{uuid.uuid4().hex[:8]}"
    h = tls_queue(pki, name=name)
    try:
        endpoint = await h.wire_endpoint.remote()
        assert endpoint["tls"] is True
        # What a worker opens from its config (the topology's queue.tls, as launch_config passes it).
        good = open_queue(WorkerConfig(model="m", queue_name=name, queue_namespace="pdserve-tests",
                                       queue_transport="wire", queue_tls={"ca_file": str(ours["ca"])}), "a test")
        assert (await good.put(task("a"))).ok and good.in_use == "wire"
        # pdserve's own client without TLS settings: refused, naming the setting, in "auto" too (no silent
        # fallback to Ray calls: the topology is wrong and should be fixed).
        for transport in ("wire", "auto"):
            with pytest.raises(QueueUnavailableError, match="requires TLS.*set queue.tls"):
                await QueueClient(h, transport).stats()
        # A hand-written plaintext client: its hello is not TLS, the handshake fails, it is never served.
        reader, writer = await asyncio.open_connection(endpoint["host"], endpoint["port"])
        writer.write(pack_frame({"hello": endpoint["token"], "v": 1}))
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError, WireError)):
            await asyncio.wait_for(read_frame(reader), 10)  # EOF, a reset, or a TLS alert (not a frame)
        writer.close()
        # A CA that did not sign the queue's certificate: the client refuses the server.
        with pytest.raises(QueueUnavailableError, match="certificate verify failed.*queue.tls.ca"):
            await QueueClient(h, "wire", tls=ClientTLS(ca_file=str(theirs["ca"]))).stats()
        stats = await good.stats()
        assert stats.depth == 1 and stats.counters["wire_connections"] == 1
        assert stats.counters["wire_bad_hello"] == 0  # nobody else got as far as a hello
        await good.close()
    finally:
        ray.kill(h)


async def test_mutual_tls_wants_a_client_certificate_from_the_ca(ray_local, pki):
    ours, theirs = pki
    h = tls_queue(pki, client_ca=True)
    try:
        with pytest.raises(QueueUnavailableError):  # the server's CA is right, but no client certificate
            await QueueClient(h, "wire", tls=ClientTLS(ca_file=str(ours["ca"]))).stats()
        foreign = ClientTLS(ca_file=str(ours["ca"]), cert_file=str(theirs["client"]), key_file=str(theirs["client-key"]))
        with pytest.raises(QueueUnavailableError):
            await QueueClient(h, "wire", tls=foreign).stats()
        good = QueueClient(h, "wire", tls=ClientTLS(ca_file=str(ours["ca"]), cert_file=str(ours["client"]),
                                                    key_file=str(ours["client-key"])))
        assert (await good.put(task("a"))).ok and good.in_use == "wire"
        await good.close()
    finally:
        ray.kill(h)


async def test_a_client_expecting_tls_refuses_a_plaintext_wire(handle, pki):
    with pytest.raises(QueueUnavailableError, match="plaintext but this client expects TLS"):
        await QueueClient(handle, "auto", tls=ClientTLS(ca_file=str(pki[0]["ca"]))).stats()
