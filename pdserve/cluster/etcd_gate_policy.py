"""The etcd gate's rules: who may connect, and what each identity may do, request by request.

Pure (no I/O): the gate's server (etcd_gate_server.py) asks `GatePolicy` which identity a
client certificate names (a worker's own, the shared `worker`, or the read-only `reader`)
and whether each range, put, delete, transaction (nested ones too) and watch is within that
identity's grants (cluster/etcd_auth.py); an `Identity` keeps the leases known to be its
own. Asking etcd whose a lease is stays with the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import grpc
from aetcd import rpc

from pdserve.cluster.etcd_auth import READER, ROLE_OF, WORKER, Grant, grants, worker_grants, worker_user

MAX_LEASES_PER_IDENTITY = 16  # a worker holds one (two while it re-registers)
ALL_KEYS = b"\x00"  # etcd's range_end for "every key from `key` on"


def _denied(why: str) -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.PERMISSION_DENIED, f"etcdserver: permission denied (etcd gate: {why})"


def _within(key: bytes, range_end: bytes, grant: Grant) -> bool:
    """Is the request range [key, range_end) (range_end b"": key alone) inside `grant`?"""
    _, g_key, g_end = grant
    if not g_end:  # an exact key
        return not range_end and key == g_key
    if range_end == ALL_KEYS:
        return False
    end_ok = (not range_end) or range_end <= g_end
    return g_key <= key < g_end and end_ok


@dataclass
class Identity:
    """What one client identity may do: its grants, and the leases known to be its own."""

    name: str
    grants: list[Grant]
    leases: set[int] = field(default_factory=set)

    def may_read(self, key: bytes, range_end: bytes = b"") -> bool:
        return any(_within(key, range_end, g) for g in self.grants)

    def may_write(self, key: bytes, range_end: bytes = b"") -> bool:
        return any(g[0] == "READWRITE" and _within(key, range_end, g) for g in self.grants)

    @property
    def writes_nothing(self) -> bool:
        """A read-only identity (the reader): no key it could attach a lease to, so no use for
        a lease of its own, and none of anyone else's is ever its own."""
        return not any(g[0] == "READWRITE" for g in self.grants)


class GatePolicy:
    """Who may connect and what each may do (pure: no I/O; lease ownership is kept here)."""

    def __init__(self, cluster: str, workers: Iterable[tuple[str, str]] = (), shared_worker: bool = False,
                 reader: bool = True):
        """`workers`: (role, worker_id) of each slot with an identity of its own; `shared_worker`:
        also the shared `worker`; `reader`: the read-only `reader` (gateways, the KV index),
        which a gated cluster's RBAC grants nothing directly, so the gate serves it by default."""
        self.cluster = cluster
        self._identities: dict[str, Identity] = {}
        for role, worker_id in workers:
            user = worker_user(cluster, worker_id)
            self._identities[user] = Identity(user, worker_grants(cluster, role, worker_id))
        if shared_worker:
            self._identities[WORKER] = Identity(WORKER, grants(cluster)[ROLE_OF[WORKER]])
        if reader:
            self._identities[READER] = Identity(READER, grants(cluster)[ROLE_OF[READER]])

    def identity(self, common_name: str | None) -> Identity | None:
        return self._identities.get(common_name or "")

    def check_request_op(self, who: Identity, op: "rpc.RequestOp") -> str | None:
        """Why `op` (one operation of a transaction) is refused, or None."""
        kind = op.WhichOneof("request")
        if kind == "request_range":
            r = op.request_range
            return None if who.may_read(r.key, r.range_end) else f"{who.name} may not read {r.key!r}"
        if kind == "request_put":
            return self.check_put(who, op.request_put)
        if kind == "request_delete_range":
            d = op.request_delete_range
            return None if who.may_write(d.key, d.range_end) else f"{who.name} may not delete {d.key!r}"
        if kind == "request_txn":
            return self.check_txn(who, op.request_txn)
        return f"unknown transaction operation {kind!r}"

    def check_put(self, who: Identity, put: "rpc.PutRequest") -> str | None:
        if not who.may_write(put.key):
            return f"{who.name} may not write {put.key!r}"
        if put.lease and put.lease not in who.leases:
            return f"{who.name} may not attach lease {put.lease:x}, which is not its own"
        return None

    def check_txn(self, who: Identity, txn: "rpc.TxnRequest") -> str | None:
        for c in txn.compare:
            if not who.may_read(c.key, c.range_end):
                return f"{who.name} may not read {c.key!r}"
        for op in [*txn.success, *txn.failure]:
            why = self.check_request_op(who, op)
            if why is not None:
                return why
        return None

    def owns_by_keys(self, who: Identity, keys: list[bytes]) -> bool:
        """A lease with these keys attached is `who`'s: it holds at least one key and only
        keys `who` may write (so keeping it alive keeps only `who`'s own records). Never a
        read-only identity's: it may write no key."""
        return bool(keys) and all(who.may_write(k) for k in keys)


def _leases_in(txn: "rpc.TxnRequest") -> set[int]:
    """Every lease a transaction's puts attach (nested transactions too)."""
    out: set[int] = set()
    for op in [*txn.success, *txn.failure]:
        kind = op.WhichOneof("request")
        if kind == "request_put" and op.request_put.lease:
            out.add(op.request_put.lease)
        elif kind == "request_txn":
            out |= _leases_in(op.request_txn)
    return out
