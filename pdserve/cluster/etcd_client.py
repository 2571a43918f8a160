"""One process's connection to the cluster's etcd: the client, endpoint failover, backoff.

`EtcdConnection` is the base of `Registry` (registry.py): the leased registration
(registration.py) and the self-healing watches (watch.py) use only what is here
to reach etcd, fail over to the next endpoint and space out their retries.
Given an `EtcdTLS` (etcd_auth.py), it connects over TLS with a client certificate
(`TlsClient`); without one, plaintext as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import aetcd
import grpc
from aetcd import rpc, watcher

from pdserve.cluster.etcd_auth import EtcdTLS, access_denied, denied_error
from pdserve.cluster.keys import Keyspace, parse_endpoints

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # closing a client or cancelling a watch stream: never waited on longer

# gRPC reconnects with exponential backoff up to 120 s by default; etcd restarts
# take a second, so cap it low. Keep-alive pings notice a dead peer without
# traffic; etcd refuses pings more often than every 5 s (--grpc-keepalive-min-time).
CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


class TlsClient(aetcd.Client):
    """An aetcd client over TLS with a client certificate: aetcd itself only opens plaintext
    channels, so `connect` builds the same stubs on a secure channel. etcd takes the user
    from the certificate (no username/password, no token)."""

    _is_connecting: bool  # aetcd.Client's (aetcd is read as Any): declared for the checker only

    def __init__(self, host: str, port: int, tls: EtcdTLS, **kwargs):
        super().__init__(host, port, **kwargs)
        self.tls = tls

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self.tls.credentials(),
                                                   options=list(self._options.items()))
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=None)
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdConnection:
    """The etcd client of one cluster's keyspace, created on first use.

    With several endpoints, a failure moves to the next one (`connection_failed`);
    retries wait `backoff_s(attempt)`: exponential, capped, half jittered. `tls`: connect
    over TLS as that identity (None: plaintext).
    """

    def __init__(
        self,
        endpoints: str | list[str],
        cluster: str,
        *,
        tls: EtcdTLS | dict | None = None,
        request_timeout_s: float = 5.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
    ):
        self.endpoints = parse_endpoints(endpoints)
        self.tls = EtcdTLS.of(tls)
        self.keys = Keyspace(cluster)
        self.request_timeout_s = request_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._endpoint_index = 0
        self._client: aetcd.Client | None = None

    def client(self) -> aetcd.Client:
        """The current etcd client, created on first use."""
        if self._client is None:
            host, port = self.endpoints[self._endpoint_index]
            if self.tls is None:
                self._client = aetcd.Client(host, port, timeout=self.request_timeout_s, options=dict(CHANNEL_OPTIONS))
            else:
                self._client = TlsClient(host, port, self.tls, timeout=self.request_timeout_s,
                                         options=dict(CHANNEL_OPTIONS))
        return self._client

    def connection_failed(self, client: aetcd.Client) -> None:
        """Move to the next endpoint after a failure on `client` (several endpoints only)."""
        if len(self.endpoints) < 2 or client is not self._client:
            return
        assert client is not None  # it is self._client, the one self.client() made
        self._endpoint_index = (self._endpoint_index + 1) % len(self.endpoints)
        self._client = None
        asyncio.get_running_loop().create_task(client.close())
        log.warning("etcd: switching to endpoint %s:%d", *self.endpoints[self._endpoint_index])

    @contextlib.contextmanager
    def refused_as_error(self, key: bytes, verb: str = "writing"):
        """Inside: etcd refusing this identity (RBAC) raises EtcdAccessDenied naming the key,
        the identity and its setting, instead of a generic (and, to the retry loops,
        transient-looking) client error."""
        try:
            yield
        except aetcd.ClientError as exc:
            if access_denied(exc):
                raise denied_error(self.tls, f"{verb} {key.decode(errors='replace')}", exc) from exc
            raise

    def backoff_s(self, attempt: int) -> float:
        """Delay before retry `attempt` (1-based): exponential, capped, half jittered."""
        base = min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, attempt - 1))
        return base / 2 + random.uniform(0, base / 2)

    async def close_client(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:  # (bounded: a channel that does not close must not hold a shutdown)
                await asyncio.wait_for(client.close(), CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.warning("the etcd client did not close within %.0f s; left to the garbage collector",
                            CLOSE_TIMEOUT_S)
