"""One process's connection to the cluster's etcd: the client, endpoint failover, backoff.

`EtcdConnection` is the base of `Registry` (registry.py): the leased registration
(registration.py) and the self-healing watches (watch.py) use only what is here
to reach etcd, fail over to the next endpoint and space out their retries.
"""

from __future__ import annotations

import asyncio
import logging
import random

import aetcd

from .keys import Keyspace, parse_endpoints

log = logging.getLogger(__name__)

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


class EtcdConnection:
    """The etcd client of one cluster's keyspace, created on first use.

    With several endpoints, a failure moves to the next one (`connection_failed`);
    retries wait `backoff_s(attempt)`: exponential, capped, half jittered.
    """

    def __init__(
        self,
        endpoints: str | list[str],
        cluster: str,
        *,
        request_timeout_s: float = 5.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
    ):
        self.endpoints = parse_endpoints(endpoints)
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
            self._client = aetcd.Client(
                host, port, timeout=self.request_timeout_s, options=dict(CHANNEL_OPTIONS)
            )
        return self._client

    def connection_failed(self, client: aetcd.Client) -> None:
        """Move to the next endpoint after a failure on `client` (several endpoints only)."""
        if len(self.endpoints) < 2 or client is not self._client:
            return
        self._endpoint_index = (self._endpoint_index + 1) % len(self.endpoints)
        self._client = None
        asyncio.get_running_loop().create_task(client.close())
        log.warning("etcd: switching to endpoint %s:%d", *self.endpoints[self._endpoint_index])

    def backoff_s(self, attempt: int) -> float:
        """Delay before retry `attempt` (1-based): exponential, capped, half jittered."""
        base = min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, attempt - 1))
        return base / 2 + random.uniform(0, base / 2)

    async def close_client(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
