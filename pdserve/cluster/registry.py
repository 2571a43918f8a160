"""A process's handle on the cluster's etcd: its own registration and its views.

`Registry` is one object per process. What it is made of, by concern:

- ``etcd_client.EtcdConnection``: the client, endpoint failover, retry backoff;
- ``registration.Registration``: this worker's leased record + NIXL metadata,
  keep-alive and re-registration after a lost lease (`register`, `update`,
  `deregister`);
- this module: reading the cluster (`members`, `get_nixl_metadata`), the
  self-healing watches (`watch_members`, `watch_policy`, `watch_drain`; see
  `pdserve.cluster.watch`, which re-lists after every reconnect so a view
  converges whatever happened while the stream was down), policy distribution
  and drain requests, and `close()`, which stops all of it.

Import the public names from here (`Registry`, `WorkerInfo`, `RegistrationState`,
`WorkerIdConflictError`, ...): the split above is an implementation detail.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import aetcd

from pdserve.cluster.etcd_auth import EtcdAccessDenied, access_denied
from pdserve.cluster.etcd_client import CHANNEL_OPTIONS
from pdserve.cluster.keys import check_policy_kind, parse_endpoints
from pdserve.cluster.records import TRANSIENT_ERRORS, WorkerInfo, decode_members
from pdserve.cluster.registration import Registration, RegistrationState, WorkerIdConflictError
from pdserve.cluster.watch import DrainWatch, MemberWatch, PolicyWatch

__all__ = [
    "Registry",
    "RegistrationState",
    "WorkerIdConflictError",
    "WorkerInfo",
    "MemberWatch",
    "PolicyWatch",
    "DrainWatch",
    "CHANNEL_OPTIONS",
    "EtcdAccessDenied",
    "parse_endpoints",
]

log = logging.getLogger(__name__)


class Registry(Registration):
    """A process's handle on the cluster's etcd: its own registration and views.

    One per process. Owns the etcd client, the lease and keep-alive task of
    the registered worker (if any), and every watch started from it; `close()`
    stops them all. All methods are coroutines on the caller's event loop.
    """

    def __init__(self, endpoints: str | list[str], cluster: str, ttl_s: float = 10.0, **connection):
        """``connection``: `EtcdConnection`'s tls (an EtcdTLS: the identity this process acts as),
        request_timeout_s, backoff_initial_s, backoff_max_s."""
        super().__init__(endpoints, cluster, ttl_s, **connection)
        self._watches: set[MemberWatch | PolicyWatch | DrainWatch] = set()

    # -- reading the cluster ----------------------------------------------

    async def members(self, role: str | None = None) -> dict[str, WorkerInfo]:
        """One consistent read of the registered workers (all roles if None)."""
        reply = await self.client().get_prefix(self.keys.workers_prefix(role))
        return dict(decode_members(self.keys, reply))

    async def member(self, role: str, worker_id: str) -> WorkerInfo | None:
        """One worker's record as etcd holds it now (None: not registered); ValueError if malformed."""
        reply = await self.client().get(self.keys.worker(role, worker_id))
        return None if reply is None else WorkerInfo.from_json(reply.value)

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
        key = self.keys.policy(kind)
        with self.refused_as_error(key):
            reply = await self.client().put(key, yaml_text.encode())
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

    async def watch_drain(self, worker_id: str, on_drain: Callable[[str], Any], *,
                          ignore_through_revision: int = 0) -> DrainWatch:
        """Call `on_drain(reason)` once an operator asks this worker to drain. A request whose
        etcd mod_revision is at most `ignore_through_revision` is an old one (`clear_drain`)."""
        watch = DrainWatch(self, worker_id, on_drain, ignore_through_revision)
        self._track(watch)
        return watch

    async def request_drain(self, worker_id: str, reason: str = "drain requested", *,
                            revoke_lease: bool = True) -> bool:
        """Ask a worker to drain: write its drain key, then (by default) revoke its lease so
        peers stop sending it work now. Without `revoke_lease` the worker stays visible while
        it finishes what it holds (its peers keep its NIXL agent for in-flight transfers) and
        leaves the registry when done: the planner's drain. False if it is not registered."""
        key = self.keys.drain(worker_id)
        with self.refused_as_error(key):
            await self.client().put(key, reason.encode())
        members = await self.members()
        if worker_id not in members:
            return False
        if not revoke_lease:
            return True
        reply = await self.client().get(self.keys.worker(members[worker_id].role, worker_id))
        if reply is not None and reply.lease:
            try:
                await self.client().revoke_lease(reply.lease)
            except TRANSIENT_ERRORS as exc:
                log.warning("drain %s: lease revoke failed (%s); it expires within its TTL", worker_id, exc)
        return True

    async def clear_drain(self, worker_id: str) -> int:
        """Forget a drain request (before starting a worker under the same id again). Returns 0,
        or, when this identity may not delete it (etcd RBAC: a worker cannot write drain/), the
        mod_revision of the request left in place (0 if none): pass it to `watch_drain`."""
        key = self.keys.drain(worker_id)
        try:
            await self.client().delete(key)
        except aetcd.ClientError as exc:
            if not access_denied(exc):
                raise
            reply = await self.client().get(key)
            return 0 if reply is None else reply.mod_revision
        return 0

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
        else:
            await self._stop_keepalive()
        await self.close_client()

    async def __aenter__(self) -> "Registry":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
