"""The decode workers a gateway routes to: followed in etcd (their records, role ``decode``),
one gRPC channel each, what this gateway measured on each (gateway/pick.py `WorkerState`),
and, when the workers publish KV events, the cluster's KV index of their prefix caches
(cluster/kvindex/service.py `KVIndexFollower`)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.api.client import Connection
from pdserve.api.v1 import inference_pb2_grpc as pb_grpc
from pdserve.cluster.records import WorkerInfo
from pdserve.cluster.registry import Registry
from pdserve.cluster.watch import MemberWatch

from .pick import ROUTINGS, Pick, WorkerState, choose

if TYPE_CHECKING:
    from pdserve.cluster.kvindex.service import KVIndexFollower

log = logging.getLogger(__name__)

AVOID_AFTER_FAILURE_S = 5.0  # a worker whose stream broke is not picked again for this long


@dataclass(frozen=True)
class WorkerCredentials:
    """How the gateway reaches its decode workers (api/client.py `Connection`): TLS and the
    API key it calls them with (an operator's key when the workers check keys: the gateway
    checked the client's own key already)."""

    api_key: str | None = None
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    tls: bool | None = None
    server_name: str | None = None  # the name the workers' certificates carry, when not their address


class Backends:
    """Live decode workers and their channels."""

    def __init__(self, registry: Registry, creds: WorkerCredentials = WorkerCredentials(), *,
                 kv_index: bool = True, seed: int | None = None, routing: str = "ttft"):
        if routing not in ROUTINGS:
            raise ValueError(f"routing: {routing!r}; use one of {', '.join(ROUTINGS)}")
        self.routing = routing
        self.registry = registry
        self.creds = creds
        self.workers: dict[str, WorkerState] = {}
        self.records: dict[str, WorkerInfo] = {}
        # id -> (connection, its grpc.aio channel, stub)
        self._conns: dict[str, tuple[Connection, Any, pb_grpc.InferenceStub]] = {}
        self.rng = random.Random(seed)
        self._watch: MemberWatch | None = None
        self.follower: KVIndexFollower | None = None
        if kv_index:
            from pdserve.cluster.kvindex.service import KVIndexFollower
            self.follower = KVIndexFollower().start()

    async def start(self, timeout_s: float = 15.0) -> "Backends":
        self._watch = watch = await self.registry.watch_members(self._seen, self._seen, self._gone, role="decode")
        await watch.wait_synced(timeout_s)
        return self

    def _seen(self, info: WorkerInfo) -> None:
        grpc_ep = info.endpoints.get("grpc")
        if not grpc_ep:
            return
        w = self.workers.get(info.worker_id)
        if w is None or w.grpc != grpc_ep:
            if w is not None:
                self._drop_channel(info.worker_id)
            w = self.workers[info.worker_id] = WorkerState(info.worker_id, grpc_ep)
            log.info("gateway: decode worker %s at %s", info.worker_id, grpc_ep)
        w.set_load(dict(info.load or {}))
        w.draining = bool(w.load.get("draining"))
        self.records[info.worker_id] = info
        if self.follower is not None:
            self.follower.member(info)

    def _gone(self, info: WorkerInfo) -> None:
        log.info("gateway: decode worker %s left", info.worker_id)
        self.workers.pop(info.worker_id, None)
        self.records.pop(info.worker_id, None)
        self._drop_channel(info.worker_id)
        if self.follower is not None:
            self.follower.gone(info)

    def _drop_channel(self, worker_id: str) -> None:
        entry = self._conns.pop(worker_id, None)
        if entry is not None:
            # Streams still open on it end with it: the gateway migrates them.
            import asyncio
            asyncio.get_running_loop().create_task(entry[1].close(grace=5.0))

    def stub(self, worker_id: str) -> tuple[pb_grpc.InferenceStub, tuple[tuple[str, str], ...] | None]:
        """(stub, metadata) for calls to a worker."""
        entry = self._conns.get(worker_id)
        if entry is None:
            c = self.creds
            conn = Connection(self.workers[worker_id].grpc, 0.0, c.api_key, c.ca_file, c.client_cert, c.client_key,
                              c.tls, c.server_name)
            channel = conn.channel(aio=True)
            entry = self._conns[worker_id] = (conn, channel, pb_grpc.InferenceStub(channel))
        return entry[2], entry[0].metadata

    def cached(self, token_ids: list[int]) -> dict[str, int]:
        """Tokens of this prompt each decode worker's prefix cache holds (the KV index; {} without)."""
        if self.follower is None or self.follower.index is None:
            return {}
        return self.follower.cached_tokens(token_ids)

    def pick(self, token_ids: list[int], exclude: Set[str] = frozenset(), adapter: str | None = None) -> Pick:
        """The worker for a prompt (gateway/pick.py `choose`). ``adapter``: the request runs under
        this LoRA adapter, so only the workers serving it are scored, and without a prefix-cache
        hint: the KV index knows the blocks by the base model's hashes, and an adapter's blocks
        hash otherwise (engine/lora_request.py), so the base's hits say nothing about it."""
        cached = self.cached(token_ids) if adapter is None else {}
        return choose(list(self.workers.values()), len(token_ids), cached, time.monotonic(),
                      self.rng, exclude, routing=self.routing, adapter=adapter)

    def adapters(self) -> dict[str, list[str]]:
        """Each LoRA adapter some decode worker serves (its record's ``load["lora_adapters"]``),
        with the ids of the workers serving it, sorted. (Called from the tokenizer threads too:
        the workers are copied at once, and a record's load is replaced whole, never changed.)"""
        out: dict[str, list[str]] = {}
        for w in sorted(list(self.workers.values()), key=lambda w: w.worker_id):
            for name in w.adapters():
                out.setdefault(name, []).append(w.worker_id)
        return dict(sorted(out.items()))

    def failed(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.avoid_until = time.monotonic() + AVOID_AFTER_FAILURE_S

    async def close(self) -> None:
        if self._watch is not None:
            await self._watch.close()
        for _, channel, _ in self._conns.values():
            await channel.close(grace=1.0)
        self._conns.clear()
        if self.follower is not None:
            self.follower.close()
