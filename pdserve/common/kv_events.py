"""KV cache events: what a worker's pool stored, removed or cleared, as the cluster's KV
index and outside indexers read them.

The wire format is vLLM's (``vllm/distributed/kv_events.py``, msgspec msgpack), so an
indexer written for vLLM (llm-d's, Dynamo's) can read a pdserve worker's events, and
pdserve's index can read vLLM's: a batch is the array ``[ts, events, data_parallel_rank]``,
each event a map tagged by ``type``:

- ``BlockStored``: ``block_hashes`` (a chain, oldest first), ``parent_block_hash`` (of the
  block before the first; nil at a prompt's start), ``token_ids`` (of all the blocks, in
  order), ``block_size``, ``lora_id``, ``medium``, ``lora_name``;
- ``BlockRemoved``: ``block_hashes``, ``medium``;
- ``AllBlocksCleared``.

pdserve's block hashes are the prefix cache's (engine/block_manager.py: sha256 chained on
the parent, 32 bytes). ``medium`` names the tier: ``GPU`` (a pool in device memory),
``CPU`` (a pool, or a second tier, in host memory), ``STORAGE`` (a file-backed tier).
Pure: no sockets (cluster/kvindex/ moves the batches), no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import msgpack

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)


class KVEventDecodeError(ValueError):
    """A payload that is not a batch of KV events (the message says what is wrong)."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None

    def to_wire(self) -> dict:
        return {"type": "BlockStored", "block_hashes": list(self.block_hashes),
                "parent_block_hash": self.parent_block_hash, "token_ids": list(self.token_ids),
                "block_size": self.block_size, "lora_id": self.lora_id, "medium": self.medium,
                "lora_name": self.lora_name}


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str | None = None

    def to_wire(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium}


@dataclass(frozen=True)
class AllBlocksCleared:
    def to_wire(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: tuple[KVEvent, ...] = field(default_factory=tuple)
    data_parallel_rank: int | None = None


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch in vLLM's wire format (byte for byte what its msgspec encoder writes)."""
    return msgpack.packb([batch.ts, [e.to_wire() for e in batch.events], batch.data_parallel_rank],
                         use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from the wire (pdserve's or vLLM's); KVEventDecodeError when malformed.
    Fields this module does not know (vLLM's later additions) are ignored."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001  (msgpack raises several types)
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise KVEventDecodeError("a batch is [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, (int, float)) or (rank is not None and not isinstance(rank, int)):
        raise KVEventDecodeError("ts must be a number and data_parallel_rank an int or nil")
    return KVEventBatch(float(ts), tuple(_event(e) for e in events), rank)


def _event(e: Any) -> KVEvent:
    if not isinstance(e, dict):
        raise KVEventDecodeError(f"an event is a map, got {type(e).__name__}")
    kind = e.get("type")
    try:
        if kind == "BlockStored":
            return BlockStored(_hashes(e["block_hashes"]), _hash_or_none(e.get("parent_block_hash")),
                               tuple(int(t) for t in e["token_ids"]), int(e["block_size"]), e.get("medium"),
                               e.get("lora_id"), e.get("lora_name"))
        if kind == "BlockRemoved":
            return BlockRemoved(_hashes(e["block_hashes"]), e.get("medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError, ValueError) as exc:
        raise KVEventDecodeError(f"{kind}: {exc!r}") from exc
    raise KVEventDecodeError(f"unknown event type {kind!r}")


def _hash_or_none(h: Any) -> bytes | None:
    return None if h is None else _hashes([h])[0]


def _hashes(hs: Any) -> tuple[bytes, ...]:
    """Block hashes: bytes (pdserve's, vLLM's sha256) or ints (vLLM's builtin hash), as bytes."""
    out = []
    for h in hs:
        if isinstance(h, bytes):
            out.append(h)
        elif isinstance(h, int) and not isinstance(h, bool):
            out.append(h.to_bytes(max(8, (h.bit_length() + 8) // 8), "big", signed=True))
        else:
            raise TypeError(f"a block hash is bytes or an int, got {type(h).__name__}")
    return tuple(out)
