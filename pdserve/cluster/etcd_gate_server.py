"""The etcd gate's gRPC server: etcd's KV, Watch and Lease services, each request checked
against the gate's rules (etcd_gate_policy.py) and forwarded to etcd as the operator.

`EtcdGate` embeds the gate (tests); etcd_gate.py says what the gate enforces and runs it as
a process. A lease not granted through the gate is asked of etcd once (`_owns`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, NoReturn

import grpc
from aetcd import rpc

from pdserve.cluster.etcd_auth import EtcdTLS
from pdserve.cluster.etcd_gate_policy import MAX_LEASES_PER_IDENTITY, GatePolicy, Identity, _denied, _leases_in

log = logging.getLogger(__name__)

UPSTREAM_TIMEOUT_S = 10.0


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
        if self._server is None:
            raise RuntimeError("etcd gate: wait() before start()")
        await self._server.wait_for_termination()

    @property
    def _upstream(self) -> _Upstream:
        """etcd's stubs; the handlers run only once `start` made them."""
        if self._up is None:
            raise RuntimeError("etcd gate: a request before start()")
        return self._up

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
            await self._refuse(context, f"{name or 'a client without a common name'!r} is no identity this gate "
                                        f"serves for cluster {self.policy.cluster} (a worker's own, the shared "
                                        "worker, the reader); the operator and root reach etcd directly")
        return who

    async def _refuse(self, context, why: str) -> NoReturn:
        self.refused += 1
        log.warning("etcd gate refused: %s", why)
        await context.abort(*_denied(why))
        raise AssertionError("grpc's context.abort returned")  # it raises: the call ends there

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
            ttl = await self._upstream.lease.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True),
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
        return await self._forward(context, self._upstream.kv.Range(req, timeout=UPSTREAM_TIMEOUT_S))

    async def _put(self, req, context):
        who = await self._who(context)
        if req.lease and not await self._owns(who, req.lease):
            await self._refuse(context, f"{who.name} may not attach lease {req.lease:x}, which is not its own")
        why = self.policy.check_put(who, req)
        if why is not None:
            await self._refuse(context, why)
        return await self._forward(context, self._upstream.kv.Put(req, timeout=UPSTREAM_TIMEOUT_S))

    async def _delete(self, req, context):
        who = await self._who(context)
        if not who.may_write(req.key, req.range_end):
            await self._refuse(context, f"{who.name} may not delete {req.key!r}")
        return await self._forward(context, self._upstream.kv.DeleteRange(req, timeout=UPSTREAM_TIMEOUT_S))

    async def _txn(self, req, context):
        who = await self._who(context)
        for lease_id in _leases_in(req):
            if not await self._owns(who, lease_id):
                await self._refuse(context, f"{who.name} may not attach lease {lease_id:x}, which is not its own")
        why = self.policy.check_txn(who, req)
        if why is not None:
            await self._refuse(context, why)
        return await self._forward(context, self._upstream.kv.Txn(req, timeout=UPSTREAM_TIMEOUT_S))

    async def _compact(self, req, context):
        who = await self._who(context)
        await self._refuse(context, f"{who.name} may not compact the store")

    # -- leases -------------------------------------------------------------------------------
    async def _prune(self, who: Identity) -> None:
        """Forget `who`'s leases that etcd no longer holds (expired after a re-registration)."""
        for lease_id in list(who.leases):
            try:
                ttl = await self._upstream.lease.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id),
                                                                timeout=UPSTREAM_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                continue  # etcd unreachable: keep it (the grant below fails anyway)
            if ttl.TTL <= 0:
                who.leases.discard(lease_id)

    async def _lease_grant(self, req, context):
        who = await self._who(context)
        if who.writes_nothing:  # nothing to attach it to: a lease would only be a handle to keep alive
            await self._refuse(context, f"{who.name} writes nothing, so it may not grant a lease")
        if len(who.leases) >= MAX_LEASES_PER_IDENTITY:
            await self._prune(who)
        if len(who.leases) >= MAX_LEASES_PER_IDENTITY:
            await self._refuse(context, f"{who.name} holds {len(who.leases)} leases already (the gate's limit)")
        resp = await self._forward(context, self._upstream.lease.LeaseGrant(req, timeout=UPSTREAM_TIMEOUT_S))
        if not resp.error:
            who.leases.add(resp.ID)
        return resp

    async def _lease_revoke(self, req, context):
        who = await self._who(context)
        if not await self._owns(who, req.ID):
            await self._refuse(context, f"{who.name} may not revoke lease {req.ID:x}, which is not its own")
        resp = await self._forward(context, self._upstream.lease.LeaseRevoke(req, timeout=UPSTREAM_TIMEOUT_S))
        who.leases.discard(req.ID)
        return resp

    async def _lease_ttl(self, req, context):
        who = await self._who(context)
        if not await self._owns(who, req.ID):
            await self._refuse(context, f"{who.name} may not read lease {req.ID:x}, which is not its own")
        resp = await self._forward(context, self._upstream.lease.LeaseTimeToLive(req, timeout=UPSTREAM_TIMEOUT_S))
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
        upstream = self._upstream.lease.LeaseKeepAlive()
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
        upstream = self._upstream.watch.Watch()
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
