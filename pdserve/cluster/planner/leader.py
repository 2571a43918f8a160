"""The planner's election: one planner per cluster, by a leased leader key in etcd.

`Leadership` holds the `Planner` methods that take, keep and give up the leader key
(`planner/leader`, bound to a lease the planner refreshes): a second planner waits
for the holder's lease to end. A planner that loses its lease stops acting. The
planner provides `registry`, `keys`, `id`, `cluster`, `clock`, `leader_ttl_s` and
`metrics_address`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Callable

from pdserve.cluster.records import TRANSIENT_ERRORS, short_error

if TYPE_CHECKING:
    from pdserve.cluster.keys import Keyspace
    from pdserve.cluster.registry import Registry

log = logging.getLogger(__name__)


class Leadership:
    """The election half of `Planner` (see the module docstring)."""

    # The Planner's (declared here for the checker; no value is set)
    registry: Registry
    keys: Keyspace
    id: str
    cluster: str
    clock: Callable[[], float]
    leader_ttl_s: int
    _keepalive: asyncio.Task[None] | None
    if TYPE_CHECKING:
        @property
        def metrics_address(self) -> str | None: ...

    async def acquire(self, timeout_s: float | None = None) -> bool:
        """Become the cluster's planner: create the leased leader key, or wait for the current
        holder's lease to end (`timeout_s` None: wait for ever). True once leader."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        client = self.registry.client()
        key, waited = self.keys.planner_leader(), False
        while True:
            try:
                lease = await client.lease(self.leader_ttl_s)
                value = json.dumps({"planner": self.id, "host": socket.gethostname(), "pid": os.getpid(),
                                    "since": self.clock(), "metrics": self.metrics_address}).encode()
                ok, _ = await client.transaction(compare=[client.transactions.create(key) == 0],
                                                 success=[client.transactions.put(key, value, lease=lease.id)],
                                                 failure=[])
                if ok:
                    self._lease, self.leader = lease.id, True
                    self._keepalive = asyncio.get_running_loop().create_task(self._keep_leadership())
                    log.info("planner %s is the planner of cluster %s", self.id, self.cluster)
                    return True
                await client.revoke_lease(lease.id)
            except TRANSIENT_ERRORS as exc:
                log.warning("planner: etcd unreachable while electing (%s)", short_error(exc))
            if not waited:
                holder = await self.leader_record()
                log.info("planner %s: cluster %s already has a planner (%s); waiting for it to go",
                         self.id, self.cluster, holder)
                waited = True
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(1.0)

    async def leader_record(self) -> dict | None:
        reply = await self.registry.client().get(self.keys.planner_leader())
        return None if reply is None else json.loads(reply.value)

    async def _keep_leadership(self) -> None:
        client = self.registry.client()
        while True:
            await asyncio.sleep(self.leader_ttl_s / 3)
            try:
                reply = await client.refresh_lease(self._lease)
            except TRANSIENT_ERRORS as exc:
                log.warning("planner: leader lease refresh failed (%s)", short_error(exc))
                continue
            if reply is None or reply.TTL <= 0:
                log.error("planner %s lost its leader lease; it stops acting", self.id)
                self.leader = False
                return

    async def _resign(self) -> None:
        """Stop refreshing the leader lease and revoke it (the key goes with it)."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
        if self._lease is not None and self.leader:
            try:
                await self.registry.client().revoke_lease(self._lease)
            except TRANSIENT_ERRORS:
                pass
        self.leader = False
