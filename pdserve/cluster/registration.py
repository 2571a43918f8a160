"""A worker's own membership record in etcd: the lease, keep-alive, re-registration.

`Registration.register(info, nixl_metadata)` writes the record and the NIXL
metadata in one transaction under a lease, and a keep-alive task refreshes that
lease every `ttl_s / 3`. If the lease is lost (the process stalled past its TTL,
or etcd came back without its data) the task writes the record again under a
new lease, retrying with jittered exponential backoff until etcd answers.
`Registry` (registry.py) is a `Registration` plus the cluster views.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math

from pdserve.cluster.etcd_auth import EtcdAccessDenied
from pdserve.cluster.etcd_client import EtcdConnection
from pdserve.cluster.records import TRANSIENT_ERRORS, WorkerInfo, short_error

log = logging.getLogger(__name__)


class RegistrationState(enum.Enum):
    """Where this process's own registration stands."""

    UNREGISTERED = "unregistered"  # register() not called yet
    REGISTERED = "registered"  # lease refreshed within the last interval
    RECOVERING = "recovering"  # etcd unreachable or lease lost: retrying
    CONFLICT = "conflict"  # another live worker holds our worker_id: gave up
    DENIED = "denied"  # etcd refused this process's identity (RBAC): gave up
    DEREGISTERED = "deregistered"  # deregister() revoked the lease


class WorkerIdConflictError(RuntimeError):
    """Another live worker is registered under the same worker_id."""


class Registration(EtcdConnection):
    """The leased record (+ NIXL metadata) of the one worker this process runs, if any."""

    def __init__(self, endpoints: str | list[str], cluster: str, ttl_s: float = 10.0, **connection):
        super().__init__(endpoints, cluster, **connection)
        self.ttl_s = float(ttl_s)
        # etcd leases are whole seconds; its floor is ~2 s with default election settings.
        self._lease_ttl = max(2, math.ceil(self.ttl_s))
        self._info: WorkerInfo | None = None
        self._nixl_metadata: bytes | None = None
        self._lease_id: int | None = None
        self._dirty = False  # a record update that has not reached etcd yet
        self._keepalive_task: asyncio.Task | None = None
        self.state = RegistrationState.UNREGISTERED
        self.reregistrations = 0  # times the record was rewritten under a new lease

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    @property
    def info(self) -> WorkerInfo | None:
        """The record as last given to register()/update() (a copy; edit it and call update())."""
        return self._info

    def _record(self) -> WorkerInfo:
        """The record being kept registered: register() set it before anything that writes it runs."""
        if self._info is None:
            raise RuntimeError("no worker record: register() was not called")
        return self._info

    async def register(self, info: WorkerInfo, nixl_metadata: bytes | None = None, *,
                       replace_stale: bool = False) -> None:
        """Write the record (+ NIXL metadata) under a new lease and start keep-alive.

        Raises WorkerIdConflictError if a live worker already holds the id,
        EtcdAccessDenied if etcd's RBAC refuses this identity the worker's keys, and
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
        info, client = self._record(), self.client()
        lease = await client.lease(self._lease_ttl)
        worker_key = self.keys.worker(info.role, info.worker_id)
        ops = [client.transactions.put(worker_key, info.to_json(), lease=lease.id)]
        if self._nixl_metadata is not None:
            nixl_key = self.keys.nixl(info.worker_id)
            ops.append(client.transactions.put(nixl_key, self._nixl_metadata, lease=lease.id))
        # Create only if absent: two live processes must never share one id.
        with self.refused_as_error(worker_key):
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
            log.warning("lease %x of worker %s lost; re-registering", self._lease_id or 0, self._record().worker_id)
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
            except EtcdAccessDenied as exc:
                self.state = RegistrationState.DENIED
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
            log.info("worker %s re-registered under lease %x", self._record().worker_id, self._lease_id)
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
        info, client = self._record(), self.client()
        try:
            await client.put(self.keys.worker(info.role, info.worker_id), info.to_json(), lease=self._lease_id)
        except TRANSIENT_ERRORS as exc:
            log.warning("record update of %s deferred: %s", info.worker_id, short_error(exc))
            return False
        self._dirty = self._info is not info
        return True

    async def deregister(self) -> None:
        """Stop keep-alive and revoke the lease: peers see the worker leave now."""
        await self._stop_keepalive()
        if self._lease_id is not None:
            try:
                await self.client().revoke_lease(self._lease_id)
            except TRANSIENT_ERRORS as exc:
                log.warning("lease revoke failed (%s); it expires within %d s", short_error(exc), self._lease_ttl)
            self._lease_id = None
        if self.state is not RegistrationState.UNREGISTERED:
            self.state = RegistrationState.DEREGISTERED

    async def _stop_keepalive(self) -> None:
        """Stop refreshing the lease (it then expires within its TTL unless revoked)."""
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            await asyncio.gather(self._keepalive_task, return_exceptions=True)
            self._keepalive_task = None
