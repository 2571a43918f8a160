"""A worker's KV pools beyond its model's own, registered with the same NIXL agent.

A decode worker that speculates with a draft model (engine/spec_draft.py) holds the draft's KV
in a pool of its own. The agent registers such pools beside the model's (``pools={"draft":
(tensor, layout)}``), names them in its record (`PeerInfo.pools`, published with the rest), and
`KVTransferAgent.write_blocks(..., pool="draft")` writes a peer's pool of that name from ours of
the same name: the draft's prompt KV, computed where the target's is, shipped in the same
handoff (docs/kvtransfer.md, "More pools than the model's"). Each pool has its own layout,
checked against the peer's pool of the same name when written, not when the peer is added: a
peer whose draft differs (or that has none) still takes the model's pages.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.kvtransfer.nixl.errors import KVTransferError, LayoutMismatchError, MalformedMessageError
from pdserve.kvtransfer.nixl.layout import KVLayout

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def check_pool(kv: Any, layout: KVLayout) -> None:
    """The tensor is what the layout says, and contiguous (pages are addressed by byte offset)."""
    if tuple(kv.shape) != layout.shape:
        raise ValueError(f"KV pool tensor shape {list(kv.shape)} does not match layout {list(layout.shape)}")
    dtype = str(kv.dtype).removeprefix("torch.")
    if dtype != layout.dtype:
        raise ValueError(f"KV pool tensor dtype {dtype} does not match layout dtype {layout.dtype}")
    if not kv.is_contiguous():
        raise ValueError("the KV pool tensor must be contiguous: pages are addressed by byte offset")


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"pool name {name!r}: lowercase letters, digits and _, starting with a letter, "
                         "at most 32 characters")
    return name


@dataclass(frozen=True)
class PoolRecord:
    """One extra pool as a peer sees it: its layout and where it lives in its owner's memory
    (same memory type and device as the owner's model pool)."""

    layout: KVLayout
    addr: int
    num_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.to_dict(), "addr": self.addr, "num_bytes": self.num_bytes}


def records_from_dict(data: Any) -> tuple[tuple[str, PoolRecord], ...]:
    """The ``pools`` section of a peer record (absent: none); raises MalformedMessageError."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise MalformedMessageError(f"a peer record's pools must be a dict, got {type(data).__name__}")
    out = []
    for name, rec in sorted(data.items()):
        try:
            check_name(name)
        except ValueError as exc:
            raise MalformedMessageError(str(exc)) from None
        if not isinstance(rec, dict):
            raise MalformedMessageError(f"pool {name!r}: a dict expected, got {type(rec).__name__}")
        record = PoolRecord(KVLayout.from_dict(rec["layout"]), rec["addr"], rec["num_bytes"])
        for key, value in (("addr", record.addr), ("num_bytes", record.num_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MalformedMessageError(f"pool {name!r}: {key} must be an int >= 0, got {value!r}")
        if record.num_bytes != record.layout.pool_bytes:
            raise MalformedMessageError(f"pool {name!r} registered {record.num_bytes} bytes but its layout needs "
                                        f"{record.layout.pool_bytes}")
        out.append((name, record))
    return tuple(out)


@dataclass
class _Local:
    tensor: Any  # kept alive as long as the agent
    record: PoolRecord
    registration: Any


class LocalPools:
    """The extra pools one agent registered (``pools``: name -> (tensor, layout))."""

    def __init__(self, nixl: Any, pools: Mapping[str, tuple[Any, KVLayout]], errors: tuple[type[BaseException], ...]):
        self._pools: dict[str, _Local] = {}
        for name, (tensor, layout) in pools.items():
            check_name(name)
            check_pool(tensor, layout)
            try:
                registration = nixl.register_memory(tensor)
            except errors as exc:
                self.deregister(nixl, errors)
                raise KVTransferError(f"NIXL could not register the {name!r} pool ({layout.pool_bytes} bytes): "
                                      f"{exc!r}") from exc
            self._pools[name] = _Local(tensor, PoolRecord(layout, int(tensor.data_ptr()), layout.pool_bytes),
                                       registration)

    def records(self) -> tuple[tuple[str, PoolRecord], ...]:
        return tuple(sorted((name, p.record) for name, p in self._pools.items()))

    def get(self, name: str) -> PoolRecord:
        try:
            return self._pools[name].record
        except KeyError:
            raise ValueError(f"this agent registered no {name!r} pool (it has: {sorted(self._pools)})") from None

    def deregister(self, nixl: Any, errors: tuple[type[BaseException], ...]) -> list[str]:
        """Deregister every pool; the names NIXL refused (logged by the caller)."""
        failed = []
        for name, pool in self._pools.items():
            try:
                nixl.deregister_memory(pool.registration)
            except errors:
                failed.append(name)
        self._pools.clear()
        return failed


def peer_pool(peer_name: str, pools: tuple[tuple[str, PoolRecord], ...], name: str, mine: KVLayout) -> PoolRecord:
    """The peer's pool ``name``, checked against ours; LayoutMismatchError when it has none or
    its layout is not ours (a different draft model, block size or dtype)."""
    found = dict(pools).get(name)
    if found is None:
        raise LayoutMismatchError("pools", name, f"peer {peer_name!r} registered no {name!r} pool")
    mine.check_compatible(found.layout)
    return found
