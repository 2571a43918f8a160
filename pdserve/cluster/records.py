"""The worker record stored in etcd, and the errors etcd code treats as transient."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

import aetcd
import grpc

from pdserve.cluster.keys import Keyspace, check_name, check_role

log = logging.getLogger(__name__)

RECORD_FORMAT = 1  # bumped only for incompatible changes of the WorkerInfo JSON

# Errors that mean "etcd is unreachable or slow right now": retried, never fatal.
TRANSIENT_ERRORS = (aetcd.ClientError, grpc.aio.AioRpcError, asyncio.TimeoutError, OSError)


@dataclass
class WorkerInfo:
    """One worker's membership record, stored as JSON at its worker key.

    `endpoints` maps a name ("grpc", "http", ...) to "host:port"; `kv_layout`
    carries what two workers must agree on to exchange KV (model id, dtype,
    block_size, num_kv_heads, head_dim); `capacity` is static (KV blocks,
    max batch tokens); `load` is free-form and refreshed with
    `Registry.update()`. `version` is the worker's software version.
    `task_key` (decode workers with remote prefill): the Ed25519 public key
    that signs its prefill tasks (queue/signing.py), base64; prefill workers
    write only into blocks of tasks it signed.
    """

    worker_id: str
    role: str
    endpoints: dict[str, str] = field(default_factory=dict)
    model: str = ""
    kv_layout: dict[str, Any] = field(default_factory=dict)
    capacity: dict[str, Any] = field(default_factory=dict)
    version: str = ""
    load: dict[str, Any] = field(default_factory=dict)
    hostname: str = ""  # the machine the worker runs on (`pdserve status`)
    address: str = ""  # the address its servers bind and advertise (network.bind)
    task_key: str = ""  # public key of its prefill-task signatures (decode; "" = signs none)

    def __post_init__(self) -> None:
        check_name("worker_id", self.worker_id)
        check_role(self.role)

    def to_json(self) -> bytes:
        body = {"format": RECORD_FORMAT, **dataclasses.asdict(self)}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "WorkerInfo":
        """Parse a record; unknown fields are ignored so newer writers stay readable."""
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError("worker record is not a JSON object")
        fmt = body.pop("format", RECORD_FORMAT)
        if not isinstance(fmt, int) or fmt > RECORD_FORMAT:
            raise ValueError(f"worker record format {fmt!r} is newer than this reader ({RECORD_FORMAT})")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in known})


def decode_members(keys: Keyspace, kvs: Iterable) -> list[tuple[str, WorkerInfo]]:
    """(worker_id, WorkerInfo) for each well-formed worker key in `kvs`; others are logged."""
    out = []
    for kv in kvs:
        parsed = keys.parse_worker(kv.key)
        if parsed is None:
            continue
        try:
            info = WorkerInfo.from_json(kv.value)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring malformed worker record %s: %s", kv.key.decode(errors="replace"), exc)
            continue
        out.append((parsed[1], info))
    return out


def short_error(exc: BaseException) -> str:
    """One log-friendly line for an exception (gRPC errors are very long)."""
    text = str(exc).replace("\n", " ") or type(exc).__name__
    return text if len(text) < 160 else text[:157] + "..."
