"""The etcd gate: workers reach etcd only through it, and it lets each do only its own part.

etcd's RBAC covers keys, not leases: any authenticated identity may keep alive, inspect or
grant any lease, and compact the store (measured on etcd 3.5; docs/security.md). A worker
that keeps a hung peer's lease alive keeps that peer in the registry. So with `etcd.gate` in
the topology the workers' etcd users get no permissions at all (etcd refuses them
everything directly) and the workers connect here instead, with the same certificates:

- **Who:** the client certificate's common name, checked against the topology's CA
  (mutual TLS): `worker/<cluster>/<id>` (one identity per worker slot) or `worker` (the
  shared worker identity, while the topology lists one). Any other name is refused.
- **Keys:** the same grants etcd would enforce for that identity (`etcd_auth.worker_grants`,
  `etcd_auth.grants`): read the cluster's prefix, write the worker's own record and NIXL
  metadata. Every request is checked before it is forwarded: ranges, puts, deletes, each
  compare and operation of a transaction (nested ones too), each watch it creates.
- **Leases:** a lease is the identity's own when it was granted through the gate by it, or
  when every key attached to it is one the identity may write (asked of etcd once, so a
  restarted gate knows its workers' leases again). Keep-alive, time-to-live and revoke of
  any other lease are refused; listing leases and compaction are refused to every worker.
  A put may attach only the identity's own lease. Live leases per identity are capped.
- **Upstream** the gate acts as the topology's `operator` identity; etcd's RBAC bounds it to
  the cluster's prefix, and the gate never forwards a compaction or an auth change.

A refusal is gRPC PERMISSION_DENIED with "permission denied" in its message, as etcd's own,
so a worker reports it as `EtcdAccessDenied` naming its identity. `pdserve etcd-gate` runs
it (the launcher starts one beside its embedded etcd); `EtcdGate` embeds it (tests).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable

import grpc
from aetcd import rpc

from .etcd_auth import ROLE_OF, WORKER, EtcdTLS, Grant, grants, worker_grants, worker_user

log = logging.getLogger(__name__)

MAX_LEASES_PER_IDENTITY = 16  # a worker holds one (two while it re-registers)
UPSTREAM_TIMEOUT_S = 10.0
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


class GatePolicy:
    """Who may connect and what each may do (pure: no I/O; lease ownership is kept here)."""

    def __init__(self, cluster: str, workers: Iterable[tuple[str, str]] = (), shared_worker: bool = False):
        self.cluster = cluster
        self._identities: dict[str, Identity] = {}
        for role, worker_id in workers:
            user = worker_user(cluster, worker_id)
            self._identities[user] = Identity(user, worker_grants(cluster, role, worker_id))
        if shared_worker:
            self._identities[WORKER] = Identity(WORKER, grants(cluster)[ROLE_OF[WORKER]])

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
        keys `who` may write (so keeping it alive keeps only `who`'s own records)."""
        return bool(keys) and all(who.may_write(k) for k in keys)


class _Upstream:
    """The gate's stubs on etcd, as the operator identity."""

    def __init__(self, endpoint: str, tls: EtcdTLS):
        self.channel = grpc.aio.secure_channel(endpoint, tls.credentials())
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.watch = rpc.WatchStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()


class EtcdGate:
    """The gate's gRPC server (etcd's KV, Watch and Lease services, checked and forwarded)."""

    def __init__(self, policy: GatePolicy, upstream: str, operator: EtcdTLS, *, server_cert: str, server_key: str,
                 ca_file: str, host: str = "127.0.0.1", port: int = 0):
        self.policy = policy
        self.upstream_endpoint = upstream
        self.operator = operator
        self._files = (server_cert, server_key, ca_file)
        self.host, self.port = host, port
        self._server: grpc.aio.Server | None = None
        self._up: _Upstream | None = None
        self.refused = 0  # requests refused (all identities)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> "EtcdGate":
        cert, key, ca = (open(p, "rb").read() for p in self._files)
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        self._up = _Upstream(self.upstream_endpoint, self.operator)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers(self._handlers())
        self.port = self._server.add_secure_port(f"{self.host}:{self.port}", creds)
        if not self.port:
            raise OSError(f"etcd gate: cannot listen on {self.host}:{self.port}")
        await self._server.start()
        log.info("etcd gate for cluster %s on %s, forwarding to %s as %s", self.policy.cluster, self.endpoint,
                 self.upstream_endpoint, self.operator.identity)
        return self

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._up is not None:
            await self._up.close()

    async def wait(self) -> None:
        await self._server.wait_for_termination()

    # -- plumbing ---------------------------------------------------------------------------
    def _handlers(self):
        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                       response_serializer=resp.SerializeToString)

        def stream(fn, req, resp):
            return grpc.stream_stream_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                         response_serializer=resp.SerializeToString)

        return [
            grpc.method_handlers_generic_handler("etcdserverpb.KV", {
                "Range": unary(self._range, rpc.RangeRequest, rpc.RangeResponse),
                "Put": unary(self._put, rpc.PutRequest, rpc.PutResponse),
                "DeleteRange": unary(self._delete, rpc.DeleteRangeRequest, rpc.DeleteRangeResponse),
                "Txn": unary(self._txn, rpc.TxnRequest, rpc.TxnResponse),
                "Compact": unary(self._compact, rpc.CompactionRequest, rpc.CompactionResponse),
            }),
            grpc.method_handlers_generic_handler("etcdserverpb.Watch", {
                "Watch": stream(self._watch, rpc.WatchRequest, rpc.WatchResponse),
            }),
            grpc.method_handlers_generic_handler("etcdserverpb.Lease", {
                "LeaseGrant": unary(self._lease_grant, rpc.LeaseGrantRequest, rpc.LeaseGrantResponse),
                "LeaseRevoke": unary(self._lease_revoke, rpc.LeaseRevokeRequest, rpc.LeaseRevokeResponse),
                "LeaseTimeToLive": unary(self._lease_ttl, rpc.LeaseTimeToLiveRequest, rpc.LeaseTimeToLiveResponse),
                "LeaseLeases": unary(self._lease_list, rpc.LeaseLeasesRequest, rpc.LeaseLeasesResponse),
                "LeaseKeepAlive": stream(self._keep_alive, rpc.LeaseKeepAliveRequest, rpc.LeaseKeepAliveResponse),
            }),
        ]

    async def _who(self, context) -> Identity:
        names = context.auth_context().get("x509_common_name") or [b""]
        name = names[0].decode(errors="replace")
        who = self.policy.identity(name)
        if who is None:
            await self._refuse(context, f"{name or 'a client without a common name'!r} is no worker identity "
                                        f"of cluster {self.policy.cluster}")
        return who

    async def _refuse(self, context, why: str) -> None:
        self.refused += 1
        log.warning("etcd gate refused: %s", why)
        await context.abort(*_denied(why))

    async def _forward(self, context, call):
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")

    async def _owns(self, who: Identity, lease_id: int) -> bool:
        """`lease_id` is `who`'s own (see the module docstring); learnt from etcd once."""
        if lease_id in who.leases:
            return True
        try:
            ttl = await self._up.lease.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True),
                                                       timeout=UPSTREAM_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        if ttl.TTL > 0 and self.policy.owns_by_keys(who, list(ttl.keys)) and len(who.leases) < MAX_LEASES_PER_IDENTITY:
            who.leases.add(lease_id)
            return True
        return False

    # -- KV ---------------------------------------------------------------------------------
    async def _range(self, req, context):
        who = await self._who(context)
        if not who.may_read(req.key, req.range_end):
            await self._refuse(context, f"{who.name} may not read {req.key!r}")
        return await self._forward(context, self._up.kv.Range(req, timeout=UPSTREAM_TIMEOUT_S))

    async def _put(self, req, context):
        who = await self._who(context)
        if req.lease and not await self._owns(who, req.lease):
            await self._refuse(context, f"{who.name} may not attach lease {req.lease:x}, which is not its own")
        why = self.policy.check_put(who, req)
        if why is not None:
            await self._refuse(context, why)
        return await self._forward(context, self._up.kv.Put(req, timeout=UPSTREAM_TIMEOUT_S))

    async def _delete(self, req, context):
        who = await self._who(context)
        if not who.may_write(req.key, req.range_end):
            await self._refuse(context, f"{who.name} may not delete {req.key!r}")
        return await self._forward(context, self._up.kv.DeleteRange(req, timeout=UPSTREAM_TIMEOUT_S))

    async def _txn(self, req, context):
        who = await self._who(context)
        for lease_id in _leases_in(req):
            if not await self._owns(who, lease_id):
                await self._refuse(context, f"{who.name} may not attach lease {lease_id:x}, which is not its own")
        why = self.policy.check_txn(who, req)
        if why is not None:
            await self._refuse(context, why)
        return await self._forward(context, self._up.kv.Txn(req, timeout=UPSTREAM_TIMEOUT_S))

    async def _compact(self, req, context):
        who = await self._who(context)
        await self._refuse(context, f"{who.name} may not compact the store")

    # -- leases -------------------------------------------------------------------------------
    async def _prune(self, who: Identity) -> None:
        """Forget `who`'s leases that etcd no longer holds (expired after a re-registration)."""
        for lease_id in list(who.leases):
            try:
                ttl = await self._up.lease.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id),
                                                           timeout=UPSTREAM_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                continue  # etcd unreachable: keep it (the grant below fails anyway)
            if ttl.TTL <= 0:
                who.leases.discard(lease_id)

    async def _lease_grant(self, req, context):
        who = await self._who(context)
        if len(who.leases) >= MAX_LEASES_PER_IDENTITY:
            await self._prune(who)
        if len(who.leases) >= MAX_LEASES_PER_IDENTITY:
            await self._refuse(context, f"{who.name} holds {len(who.leases)} leases already (the gate's limit)")
        resp = await self._forward(context, self._up.lease.LeaseGrant(req, timeout=UPSTREAM_TIMEOUT_S))
        if not resp.error:
            who.leases.add(resp.ID)
        return resp

    async def _lease_revoke(self, req, context):
        who = await self._who(context)
        if not await self._owns(who, req.ID):
            await self._refuse(context, f"{who.name} may not revoke lease {req.ID:x}, which is not its own")
        resp = await self._forward(context, self._up.lease.LeaseRevoke(req, timeout=UPSTREAM_TIMEOUT_S))
        who.leases.discard(req.ID)
        return resp

    async def _lease_ttl(self, req, context):
        who = await self._who(context)
        if not await self._owns(who, req.ID):
            await self._refuse(context, f"{who.name} may not read lease {req.ID:x}, which is not its own")
        resp = await self._forward(context, self._up.lease.LeaseTimeToLive(req, timeout=UPSTREAM_TIMEOUT_S))
        if resp.TTL <= 0:
            who.leases.discard(req.ID)
        return resp

    async def _lease_list(self, req, context):
        who = await self._who(context)
        await self._refuse(context, f"{who.name} may not list the cluster's leases")

    async def _keep_alive(self, requests: AsyncIterator, context):
        """Each keep-alive names a lease: forwarded on one upstream stream if it is the
        caller's own; the first one that is not ends the stream, refused."""
        who = await self._who(context)
        upstream = self._up.lease.LeaseKeepAlive()
        try:
            async for req in requests:
                if not await self._owns(who, req.ID):
                    await self._refuse(context, f"{who.name} may not keep lease {req.ID:x} alive, "
                                                "which is not its own")
                try:
                    await upstream.write(req)
                    resp = await asyncio.wait_for(upstream.read(), UPSTREAM_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:  # etcd restarting: the worker re-registers
                    await context.abort(exc.code(), exc.details() or "")
                except asyncio.TimeoutError:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "etcd gate: etcd did not answer the keep-alive")
                if resp is grpc.aio.EOF:
                    return
                if resp.TTL <= 0:
                    who.leases.discard(req.ID)
                yield resp
        finally:
            upstream.cancel()

    async def _watch(self, requests: AsyncIterator, context):
        """One upstream watch stream per client stream; every watch it creates is checked."""
        who = await self._who(context)
        upstream = self._up.watch.Watch()
        refused: list[str] = []

        async def pump() -> None:
            async for req in requests:
                if req.WhichOneof("request_union") == "create_request":
                    c = req.create_request
                    if not who.may_read(c.key, c.range_end):
                        refused.append(f"{who.name} may not watch {c.key!r}")
                        break
                await upstream.write(req)
            await upstream.done_writing()

        sender = asyncio.ensure_future(pump())
        try:
            while True:
                read = asyncio.ensure_future(upstream.read())
                await asyncio.wait({read, sender}, return_when=asyncio.FIRST_COMPLETED)
                if refused:
                    read.cancel()
                    await self._refuse(context, refused[0])
                try:
                    resp = await read
                except grpc.aio.AioRpcError as exc:  # etcd restarting: the watch resumes from its revision
                    await context.abort(exc.code(), exc.details() or "")
                if resp is grpc.aio.EOF:
                    return
                yield resp
        finally:
            sender.cancel()
            if sender.done() and not sender.cancelled():
                sender.exception()  # (a client gone mid-write: retrieved, not logged as unretrieved)
            upstream.cancel()


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


# -- the gate as a process (`python -m pdserve.control.etcd_gate`; the launcher starts it) ----
def parse_workers(text: str) -> list[tuple[str, str]]:
    """"prefill:prefill-0,decode:decode-0" -> [(role, worker_id), ...]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        role, sep, worker_id = item.partition(":")
        if not sep or role not in ("prefill", "decode") or not worker_id:
            raise ValueError(f"--workers: {item!r} is not ROLE:WORKER_ID (ROLE prefill or decode)")
        out.append((role, worker_id))
    return out


def main(argv=None) -> int:
    import argparse
    import signal

    from .topology import load_topology

    p = argparse.ArgumentParser(prog="python -m pdserve.control.etcd_gate",
                                description="The etcd gate: workers reach etcd through it, each scoped to its own "
                                            "keys and leases (docs/security.md). `pdserve up` starts it when the "
                                            "topology sets etcd.gate.")
    p.add_argument("--topology", required=True, help="the topology file (etcd.tls: ca, server, operator)")
    p.add_argument("--upstream", required=True, help="etcd endpoint host:port")
    p.add_argument("--workers", default="", help="ROLE:WORKER_ID,... the worker slots with identities of their own")
    p.add_argument("--shared-worker", action="store_true", help="also serve the shared `worker` identity")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    topo = load_topology(args.topology)
    tls = topo.etcd.tls
    if tls is None or tls.server is None:
        p.error("the topology's etcd.tls needs ca and server (the gate's own certificate)")
    policy = GatePolicy(topo.cluster, parse_workers(args.workers), shared_worker=args.shared_worker)

    async def run() -> None:
        gate = await EtcdGate(policy, args.upstream, topo.etcd_tls("operator"),
                              server_cert=str(topo.resolve(tls.server.cert)), server_key=str(topo.resolve(tls.server.key)),
                              ca_file=str(topo.resolve(tls.ca)), host=args.host, port=args.port).start()
        print(f"etcd gate serving on {gate.endpoint}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await gate.stop()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
