"""Worker membership in etcd: leased records, keep-alive, re-registration.

A worker calls `Registry.register(info, nixl_metadata)` once. Its record and
NIXL metadata are written in one transaction under a lease, and a keep-alive
task refreshes that lease every `ttl_s / 3`. If the lease is lost (the process
stalled past its TTL, or etcd came back without its data) the task writes the
record again under a new lease, retrying with jittered exponential backoff
until etcd answers. Peers follow membership with `watch_members` (see
`pdserve.cluster.watch`), which re-lists after every reconnect so the view
converges whatever happened while the stream was down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import random
from typing import Any, Callable

import aetcd

from .keys import Keyspace, check_policy_kind, parse_endpoints
from .records import TRANSIENT_ERRORS, WorkerInfo, decode_members, short_error
from .watch import DrainWatch, MemberWatch, PolicyWatch

__all__ = [
    "Registry",
    "RegistrationState",
    "WorkerIdConflictError",
    "WorkerInfo",
    "MemberWatch",
    "PolicyWatch",
    "parse_endpoints",
]

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


class RegistrationState(enum.Enum):
    """Where this process's own registration stands."""

    UNREGISTERED = "unregistered"  # register() not called yet
    REGISTERED = "registered"  # lease refreshed within the last interval
    RECOVERING = "recovering"  # etcd unreachable or lease lost: retrying
    CONFLICT = "conflict"  # another live worker holds our worker_id: gave up
    DEREGISTERED = "deregistered"  # deregister() revoked the lease


class WorkerIdConflictError(RuntimeError):
    """Another live worker is registered under the same worker_id."""


class Registry:
    """A process's handle on the cluster's etcd: its own registration and views.

    One per process. Owns the etcd client, the lease and keep-alive task of
    the registered worker (if any), and every watch started from it; `close()`
    stops them all. All methods are coroutines on the caller's event loop.
    """

    def __init__(
        self,
        endpoints: str | list[str],
        cluster: str,
        ttl_s: float = 10.0,
        *,
        request_timeout_s: float = 5.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
    ):
        self.endpoints = parse_endpoints(endpoints)
        self.keys = Keyspace(cluster)
        self.ttl_s = float(ttl_s)
        # etcd leases are whole seconds; its floor is ~2 s with default election settings.
        self._lease_ttl = max(2, math.ceil(self.ttl_s))
        self.request_timeout_s = request_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._endpoint_index = 0
        self._client: aetcd.Client | None = None
        self._info: WorkerInfo | None = None
        self._nixl_metadata: bytes | None = None
        self._lease_id: int | None = None
        self._dirty = False  # a record update that has not reached etcd yet
        self._keepalive_task: asyncio.Task | None = None
        self._watches: set[MemberWatch | PolicyWatch] = set()
        self.state = RegistrationState.UNREGISTERED
        self.reregistrations = 0  # times the record was rewritten under a new lease

    # -- plumbing ---------------------------------------------------------

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

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    @property
    def info(self) -> WorkerInfo | None:
        """The record as last given to register()/update() (a copy; edit it and call update())."""
        return self._info

    # -- own registration -------------------------------------------------

    async def register(self, info: WorkerInfo, nixl_metadata: bytes | None = None, *,
                       replace_stale: bool = False) -> None:
        """Write the record (+ NIXL metadata) under a new lease and start keep-alive.

        Raises WorkerIdConflictError if a live worker already holds the id, and
        a transient etcd error if etcd is unreachable (the caller decides
        whether to retry the first registration). ``replace_stale``: the record
        under this id is known to be this worker's own earlier incarnation (a
        supervisor restarted the dead process before its lease expired): its
        lease is revoked and the id taken over.
        """
        if self._keepalive_task is not None:
            raise RuntimeError(f"worker {self._info.worker_id if self._info else '?'} is already registered")
        self._info, self._nixl_metadata = dataclasses.replace(info), nixl_metadata
        try:
            await self._grant_and_put()
        except WorkerIdConflictError:
            if not replace_stale:
                raise
            current = await self.client().get(self.keys.worker(info.role, info.worker_id))
            if current is not None and current.lease:
                log.warning("worker %s: revoking the lease of its earlier incarnation (lease %x) to register again",
                            info.worker_id, current.lease)
                await self.client().revoke_lease(current.lease)
            await self._grant_and_put()
        self.state = RegistrationState.REGISTERED
        self._keepalive_task = asyncio.get_running_loop().create_task(
            self._keepalive_loop(), name=f"pdserve-keepalive-{info.worker_id}"
        )

    async def _grant_and_put(self) -> None:
        assert self._info is not None
        info, client = self._info, self.client()
        lease = await client.lease(self._lease_ttl)
        worker_key = self.keys.worker(info.role, info.worker_id)
        ops = [client.transactions.put(worker_key, info.to_json(), lease=lease.id)]
        if self._nixl_metadata is not None:
            nixl_key = self.keys.nixl(info.worker_id)
            ops.append(client.transactions.put(nixl_key, self._nixl_metadata, lease=lease.id))
        # Create only if absent: two live processes must never share one id.
        ok, _ = await client.transaction(
            compare=[client.transactions.create(worker_key) == 0], success=ops, failure=[]
        )
        if not ok:
            # The key may still be ours, under the lease we are replacing.
            current = await client.get(worker_key)
            if current is not None and self._lease_id is not None and current.lease == self._lease_id:
                ok, _ = await client.transaction(
                    compare=[client.transactions.mod(worker_key) == current.mod_revision],
                    success=ops,
                    failure=[],
                )
        if not ok:
            await client.revoke_lease(lease.id)
            raise WorkerIdConflictError(
                f"worker_id {info.worker_id!r} is already registered in cluster "
                f"{self.keys.cluster!r} by a live worker (key {worker_key.decode()})"
            )
        self._lease_id = lease.id
        self._dirty = self._info is not info  # update() ran while we were writing

    async def _keepalive_loop(self) -> None:
        interval_s = self.ttl_s / 3
        delay_s, failures = interval_s, 0
        while True:
            await asyncio.sleep(delay_s)
            client = self.client()
            try:
                reply = await client.refresh_lease(self._lease_id)
            except TRANSIENT_ERRORS as exc:
                failures += 1
                self.state = RegistrationState.RECOVERING
                delay_s = min(self.backoff_s(failures), interval_s)
                log.warning("etcd keep-alive failed (%s); retry in %.2f s", short_error(exc), delay_s)
                self.connection_failed(client)
                continue
            failures, delay_s = 0, interval_s
            if reply is not None and reply.TTL > 0:
                self.state = RegistrationState.REGISTERED
                if self._dirty:
                    await self._publish()
                continue
            # The lease is gone: it expired while we were cut off, or etcd lost its data.
            log.warning("lease %x of worker %s lost; re-registering", self._lease_id or 0, self._info.worker_id)
            self.state = RegistrationState.RECOVERING
            if not await self._reregister():
                return

    async def _reregister(self) -> bool:
        attempt, old_lease = 0, self._lease_id
        while True:
            client = self.client()
            try:
                await self._grant_and_put()
            except WorkerIdConflictError as exc:
                self.state = RegistrationState.CONFLICT
                log.error("giving up re-registration: %s", exc)
                return False
            except TRANSIENT_ERRORS as exc:
                attempt += 1
                delay_s = self.backoff_s(attempt)
                log.warning("re-registration failed (%s); retry in %.2f s", short_error(exc), delay_s)
                self.connection_failed(client)
                await asyncio.sleep(delay_s)
                continue
            self.state = RegistrationState.REGISTERED
            self.reregistrations += 1
            log.info("worker %s re-registered under lease %x", self._info.worker_id, self._lease_id)
            if old_lease is not None and old_lease != self._lease_id:
                # Usually gone already; if it was merely unconfirmed, it holds no keys now.
                try:
                    await client.revoke_lease(old_lease)
                except TRANSIENT_ERRORS:
                    pass
            return True

    async def update(self, info: WorkerInfo) -> bool:
        """Replace the published record (same lease). False if it is only queued.

        A record that cannot be written now (etcd down, lease being replaced)
        is kept and written by the keep-alive task as soon as etcd answers.
        """
        if self._info is None or (info.worker_id, info.role) != (self._info.worker_id, self._info.role):
            raise ValueError("update() must keep the registered worker_id and role")
        # A copy: the caller may mutate its object (even the one `info` returned) for the next update.
        self._info = dataclasses.replace(info)
        self._dirty = True
        if self.state is not RegistrationState.REGISTERED:
            return False
        return await self._publish()

    async def _publish(self) -> bool:
        info, client = self._info, self.client()
        try:
            await client.put(self.keys.worker(info.role, info.worker_id), info.to_json(), lease=self._lease_id)
        except TRANSIENT_ERRORS as exc:
            log.warning("record update of %s deferred: %s", info.worker_id, short_error(exc))
            return False
        self._dirty = self._info is not info
        return True

    async def deregister(self) -> None:
        """Stop keep-alive and revoke the lease: peers see the worker leave now."""
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            await asyncio.gather(self._keepalive_task, return_exceptions=True)
            self._keepalive_task = None
        if self._lease_id is not None:
            try:
                await self.client().revoke_lease(self._lease_id)
            except TRANSIENT_ERRORS as exc:
                log.warning("lease revoke failed (%s); it expires within %d s", short_error(exc), self._lease_ttl)
            self._lease_id = None
        if self.state is not RegistrationState.UNREGISTERED:
            self.state = RegistrationState.DEREGISTERED

    # -- reading the cluster ----------------------------------------------

    async def members(self, role: str | None = None) -> dict[str, WorkerInfo]:
        """One consistent read of the registered workers (all roles if None)."""
        reply = await self.client().get_prefix(self.keys.workers_prefix(role))
        return dict(decode_members(self.keys, reply))

    async def get_nixl_metadata(self, worker_id: str) -> bytes | None:
        reply = await self.client().get(self.keys.nixl(worker_id))
        return None if reply is None else reply.value

    async def watch_members(
        self,
        on_add: Callable[[WorkerInfo], Any] | None = None,
        on_update: Callable[[WorkerInfo], Any] | None = None,
        on_remove: Callable[[WorkerInfo], Any] | None = None,
        *,
        role: str | None = None,
    ) -> MemberWatch:
        """Start a live, self-healing view of the members; see MemberWatch.

        Callbacks may be plain functions or coroutines; `on_remove` gets the
        last record seen. Returns once the task is started; await
        `watch.wait_synced()` to wait for the first listing.
        """
        watch = MemberWatch(self, role, on_add, on_update, on_remove)
        self._track(watch)
        return watch

    # -- policy distribution ----------------------------------------------

    async def put_policy(self, kind: str, yaml_text: str) -> int:
        """Publish a policy document (not leased: it outlives workers). Returns its revision."""
        reply = await self.client().put(self.keys.policy(kind), yaml_text.encode())
        return reply.header.revision

    async def get_policy(self, kind: str) -> str | None:
        reply = await self.client().get(self.keys.policy(check_policy_kind(kind)))
        return None if reply is None else reply.value.decode()

    async def watch_policy(
        self,
        kind: str,
        validate: Callable[[str], Any],
        on_change: Callable[[Any], Any] | None = None,
        on_reject: Callable[[Any], Any] | None = None,
    ) -> PolicyWatch:
        """Follow one policy key; see PolicyWatch for the validate/swap contract."""
        watch = PolicyWatch(self, check_policy_kind(kind), validate, on_change, on_reject)
        self._track(watch)
        return watch

    # -- draining ---------------------------------------------------------

    async def watch_drain(self, worker_id: str, on_drain: Callable[[str], Any]) -> DrainWatch:
        """Call `on_drain(reason)` once an operator asks this worker to drain."""
        watch = DrainWatch(self, worker_id, on_drain)
        self._track(watch)
        return watch

    async def request_drain(self, worker_id: str, reason: str = "drain requested") -> bool:
        """Ask a worker to drain: write its drain key, then revoke its lease so
        peers stop sending it work now. Returns False if it is not registered."""
        await self.client().put(self.keys.drain(worker_id), reason.encode())
        members = await self.members()
        if worker_id not in members:
            return False
        reply = await self.client().get(self.keys.worker(members[worker_id].role, worker_id))
        if reply is not None and reply.lease:
            try:
                await self.client().revoke_lease(reply.lease)
            except TRANSIENT_ERRORS as exc:
                log.warning("drain %s: lease revoke failed (%s); it expires within its TTL", worker_id, exc)
        return True

    async def clear_drain(self, worker_id: str) -> None:
        """Forget a drain request (before starting a worker under the same id again)."""
        await self.client().delete(self.keys.drain(worker_id))

    def _track(self, watch) -> None:
        self._watches.add(watch)
        watch.start()

    # -- lifecycle --------------------------------------------------------

    async def close(self, *, deregister: bool = True) -> None:
        """Stop every watch, deregister (unless told not to) and close the client."""
        for watch in list(self._watches):
            await watch.close()
        self._watches.clear()
        if deregister:
            await self.deregister()
        elif self._keepalive_task is not None:
            self._keepalive_task.cancel()
            await asyncio.gather(self._keepalive_task, return_exceptions=True)
            self._keepalive_task = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def __aenter__(self) -> "Registry":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
