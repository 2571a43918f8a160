"""`PeerTable`: the peers one agent writes to, by name, from their `local_info()` records.

Checks a record before NIXL hears of the peer (not the agent itself, a
compatible layout), loads the peer's NIXL metadata (which must name the same
agent) and starts the connection early, and forgets a peer again. It has no
lock and holds no NIXL agent: `KVTransferAgent` (kvtransfer/nixl/agent.py) calls it
under its own lock, passes its NIXL agent in, and fails a removed peer's
writes in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pdserve.kvtransfer.nixl.errors import MalformedMessageError, TransferError, UnknownPeerError
from pdserve.kvtransfer.nixl.layout import KVLayout
from pdserve.kvtransfer.nixl.peer import PeerInfo

log = logging.getLogger(__name__)


class PeerTable:
    """The known peers of agent `owner` (whose pool has `layout`), by name."""

    def __init__(self, owner: str, layout: KVLayout, errors: tuple[type[BaseException], ...]):
        self._owner = owner
        self._layout = layout
        self._errors = errors  # NIXL's exception classes
        self._peers: dict[str, PeerInfo] = {}

    def names(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def check(self, info: Mapping[str, Any] | PeerInfo) -> tuple[PeerInfo, PeerInfo | None]:
        """The record, checked before NIXL hears of the peer, and the entry known under its
        name (None: a new peer). Raises LayoutMismatchError or MalformedMessageError."""
        peer = info if isinstance(info, PeerInfo) else PeerInfo.from_dict(dict(info))
        if peer.name == self._owner:
            raise ValueError(f"agent {self._owner!r} cannot add itself as a peer")
        self._layout.check_compatible(peer.layout)
        return peer, self._peers.get(peer.name)

    def load(self, nixl: Any, peer: PeerInfo) -> None:
        """Load the peer's NIXL metadata, enter it in the table and start connecting to it."""
        try:
            loaded = nixl.add_remote_agent(peer.nixl_metadata)
        except self._errors as exc:
            raise TransferError(f"NIXL rejected the metadata of peer {peer.name!r}: {exc!r}") from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != peer.name:
            if loaded_name not in self._peers:
                nixl.remove_remote_agent(loaded_name)
            raise MalformedMessageError(
                f"peer record names {peer.name!r} but its NIXL metadata is for {loaded_name!r}"
            )
        self._peers[peer.name] = peer
        try:  # start UCX wireup now (asynchronous) so the first write does not pay all of it
            nixl.make_connection(peer.name)
        except self._errors as exc:
            log.warning("NIXL could not pre-connect to peer %s (the first write will): %r", peer.name, exc)

    def pop(self, name: str) -> PeerInfo | None:
        """Take the peer out of the table (None if unknown); `unload` then tells NIXL."""
        return self._peers.pop(name, None)

    def unload(self, nixl: Any, name: str) -> None:
        """Make NIXL forget a peer taken out of the table."""
        try:
            nixl.remove_remote_agent(name)
        except self._errors as exc:  # a dead peer may already be half torn down
            log.warning("NIXL could not invalidate peer %s cleanly: %r", name, exc)

    def get(self, name: str) -> PeerInfo:
        try:
            return self._peers[name]
        except KeyError:
            raise UnknownPeerError(
                f"peer {name!r} is not known to agent {self._owner!r} (never added, or removed "
                f"when its lease expired); known peers: {sorted(self._peers)}"
            ) from None
