"""`PeerInfo`: the record a worker publishes (etcd) so that others can write into its pool."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from pdserve.kvtransfer.nixl.errors import MalformedMessageError
from pdserve.kvtransfer.nixl.layout import KVLayout
from pdserve.kvtransfer.nixl.pools import PoolRecord, records_from_dict

PEER_INFO_FORMAT = "pdserve.kvtransfer.nixl.peer/1"
MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class PeerInfo:
    """Agent name, NIXL metadata and the registered pool of one worker.

    `to_dict()` is JSON-serializable (the metadata is base64); nothing here is pickled.
    """

    name: str
    nixl_metadata: bytes
    layout: KVLayout
    pool_addr: int  # address of the registered pool in the owner's address space
    pool_bytes: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    # Pools beyond the model's (kvtransfer/nixl/pools.py: a draft model's), by name; absent in
    # records of workers that have none (and of versions before them: readable both ways).
    pools: tuple[tuple[str, PoolRecord], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        extra = {"pools": {name: rec.to_dict() for name, rec in self.pools}} if self.pools else {}
        return {**extra,
            "format": PEER_INFO_FORMAT,
            "name": self.name,
            "nixl_metadata": base64.b64encode(self.nixl_metadata).decode("ascii"),
            "layout": self.layout.to_dict(),
            "pool": {
                "addr": self.pool_addr,
                "num_bytes": self.pool_bytes,
                "mem_type": self.mem_type,
                "device_id": self.device_id,
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerInfo:
        """Parse and check a record from `to_dict()`; raises MalformedMessageError."""
        try:
            return cls._from_dict(data)
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            if isinstance(exc, MalformedMessageError):
                raise
            raise MalformedMessageError(f"bad peer record: {exc!r}") from exc

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> PeerInfo:
        if not isinstance(data, dict):
            raise MalformedMessageError(f"a peer record must be a dict, got {type(data).__name__}")
        if data.get("format") != PEER_INFO_FORMAT:
            raise MalformedMessageError(
                f"peer record format {data.get('format')!r} is not {PEER_INFO_FORMAT!r}; "
                "both workers must run compatible pdserve versions"
            )
        pool = data["pool"]
        info = cls(
            name=data["name"],
            nixl_metadata=base64.b64decode(data["nixl_metadata"], validate=True),
            layout=KVLayout.from_dict(data["layout"]),
            pool_addr=pool["addr"],
            pool_bytes=pool["num_bytes"],
            mem_type=pool["mem_type"],
            device_id=pool["device_id"],
            pools=records_from_dict(data.get("pools")),
        )
        if not isinstance(info.name, str) or not info.name:
            raise MalformedMessageError(f"peer name must be a non-empty str, got {info.name!r}")
        if info.mem_type not in MEM_TYPES:
            raise MalformedMessageError(f"pool mem_type {info.mem_type!r} is not one of {MEM_TYPES}")
        for key, value in (("addr", info.pool_addr), ("device_id", info.device_id)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MalformedMessageError(f"pool {key} must be an int >= 0, got {value!r}")
        if info.pool_bytes != info.layout.pool_bytes:
            raise MalformedMessageError(
                f"peer {info.name} registered {info.pool_bytes!r} bytes but its layout needs "
                f"{info.layout.pool_bytes}"
            )
        return info
