"""`KVTransferAgent`: one NIXL agent per worker process, owning the registered KV pool.

The prefill side WRITEs pages into a decode worker's pool; the decode side only
polls for notifications. Agents run with NIXL's progress thread off (it
busy-polls a core), so progress happens inside `poll()` / `wait()`: the
*target* must keep calling `poll()` (its step loop does), or connection
wireup with a new peer never completes and notifications are not delivered.

One owner (the worker's step loop) drives it; the only other thread is its
`LayerPoster` (kvtransfer/nixl/poster.py), which posts layer writes once the device
has computed them. A lock serialises every call into NIXL between the two.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from pdserve.kvtransfer.transport import check_notification
from pdserve.kvtransfer.nixl.descriptors import WritePlan, plan_block_write, plan_head_write
from pdserve.kvtransfer.nixl.errors import KVTransferError, LayoutMismatchError, TransferError, TransferTimeoutError
from pdserve.kvtransfer.nixl.inflight import InFlightWrites
from pdserve.kvtransfer.nixl.layout import KVLayout
from pdserve.kvtransfer.nixl.nixl_shim import apply_ucx_env, load_nixl
from pdserve.kvtransfer.nixl.peer import PeerInfo
from pdserve.kvtransfer.nixl.peer_table import PeerTable
from pdserve.kvtransfer.nixl.pools import LocalPools, check_pool, peer_pool
from pdserve.kvtransfer.nixl.poster import LayerPoster
from pdserve.kvtransfer.nixl.stream import LayerStream
from pdserve.kvtransfer.nixl.transfer import PollResult, TransferHandle

log = logging.getLogger(__name__)


def _locked(method):
    """Run an agent method under the agent's lock (see the module docstring)."""

    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    run.__name__, run.__doc__, run.__wrapped__ = method.__name__, method.__doc__, method
    return run


class KVTransferAgent:
    """Registers one worker's whole KV pool with NIXL and writes pages into peers' pools.

    Owns: the NIXL agent, the pool registration, the table of known peers
    (added from their `local_info()` records; kvtransfer/nixl/peer_table.py), the
    in-flight writes and the notifications received since the last `poll()`
    (kvtransfer/nixl/inflight.py).
    """

    def __init__(
        self,
        name: str,
        kv_tensor: Any,
        layout: KVLayout,
        backends: Sequence[str] = ("UCX",),
        *,
        ucx_env: Mapping[str, str] | None = None,
        num_threads: int = 0,
        split_batch_size: int = 0,
        pools: Mapping[str, tuple[Any, KVLayout]] | None = None,
    ):
        check_pool(kv_tensor, layout)
        if num_threads < 0 or split_batch_size < 0:
            raise ValueError(f"num_threads={num_threads}, split_batch_size={split_batch_size}: use >= 0")
        self._api = load_nixl()
        self._errors = self._api.errors
        apply_ucx_env(ucx_env)
        config = self._api.config_cls(
            enable_prog_thread=False,  # NIXL's progress thread busy-polls a whole core, even idle
            enable_listen_thread=False,  # metadata travels through etcd, not NIXL's listener
            backends=[],  # created below, with their parameters
        )
        try:
            self._nixl = self._api.agent_cls(name, config)
            before = listening_ports() if num_threads else set()
            for backend in backends:
                self._nixl.create_backend(backend, _backend_params(backend, num_threads, split_batch_size))
            # With posting threads each thread's UCX worker listens on a TCP port of its own, which
            # the NIXL metadata does not carry: the worker lists them all in its record (surfaces).
            self.listen_ports = sorted(listening_ports() - before) if num_threads else []
        except self._errors as exc:
            raise KVTransferError(f"could not create NIXL agent {name!r}: {exc!r}") from exc
        missing = [b for b in backends if b not in self._nixl.backends]
        if missing:
            raise KVTransferError(
                f"NIXL backends {missing} did not start; plugins available here: "
                f"{self._nixl.get_plugin_list()}"
            )
        self.name = name
        self.layout = layout
        # What the operator needs to see when pages take the wrong network (no secrets in UCX_*).
        log.info("NIXL agent %s: backends %s, %d posting threads, %s", name, list(backends), num_threads,
                 {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")} or "UCX defaults")
        self._kv = kv_tensor  # keep the registered memory alive as long as the agent
        self.mem_type = "VRAM" if kv_tensor.is_cuda else "DRAM"
        self._device_id = max(kv_tensor.get_device(), 0)
        self._pool_addr = int(kv_tensor.data_ptr())
        try:
            self._registration = self._nixl.register_memory(kv_tensor)
        except self._errors as exc:
            raise KVTransferError(
                f"NIXL could not register the {self.mem_type} KV pool "
                f"({layout.pool_bytes} bytes): {exc!r}"
            ) from exc
        try:  # (the pools beyond the model's: a draft model's, kvtransfer/nixl/pools.py)
            self._pools = LocalPools(self._nixl, pools or {}, self._errors)
        except BaseException:
            self._nixl.deregister_memory(self._registration)
            raise
        self._peers = PeerTable(name, layout, self._errors)
        self._writes = InFlightWrites(self._errors)
        self._closed = False
        self._lock = threading.RLock()  # NIXL calls: the owner's thread and the layer poster's
        self._poster: LayerPoster | None = None

    # ---- membership -------------------------------------------------------

    @_locked
    def local_info(self) -> dict[str, Any]:
        """JSON-serializable record that a peer passes to `add_peer` (published in etcd)."""
        self._check_open()
        return PeerInfo(
            name=self.name,
            nixl_metadata=self._nixl.get_agent_metadata(),
            layout=self.layout,
            pool_addr=self._pool_addr,
            pool_bytes=self.layout.pool_bytes,
            mem_type=self.mem_type,
            device_id=self._device_id,
            pools=self._pools.records(),
        ).to_dict()

    @property
    def peers(self) -> tuple[str, ...]:
        return self._peers.names()

    @_locked
    def add_peer(self, info: Mapping[str, Any] | PeerInfo) -> str:
        """Check the peer's layout against ours, then load its NIXL metadata. Returns its name.

        Raises LayoutMismatchError (before NIXL hears of the peer) or
        MalformedMessageError for a bad record. Re-adding with new metadata
        (the peer restarted) replaces the old entry.
        """
        self._check_open()
        peer, known = self._peers.check(info)
        if known == peer:
            return peer.name
        if known is not None:
            self.remove_peer(peer.name)
        self._peers.load(self._nixl, peer)
        return peer.name

    @_locked
    def remove_peer(self, name: str) -> bool:
        """Forget a peer (its lease is gone); its in-flight writes fail. False if unknown."""
        self._check_open()
        if self._peers.pop(name) is None:
            return False
        self._writes.fail_all(f"peer {name!r} was removed while the write was in flight", peer=name)
        self._peers.unload(self._nixl, name)
        return True

    # ---- writes -----------------------------------------------------------

    def write_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
        layers: Iterable[int] | None = None,
        notify: bytes | None = None,
        *,
        coalesce: bool = True,
        heads: tuple[int, int, int] | None = None,
        pool: str | None = None,
    ) -> TransferHandle:
        """Write the K and V pages of `local_block_ids` into the peer's `remote_block_ids`.

        All layers, or only `layers`. Runs of consecutive ids (on both sides)
        become one descriptor per layer. `notify` (<= 1 KiB) reaches the peer
        after the data. NIXL failures are reported through the handle
        (`poll()`/`wait()`); a bad mapping raises ValueError, an unknown peer
        UnknownPeerError. ``heads=(src_head, dst_head, num_heads)`` writes only that head range
        (a handoff between different TP sizes, `handoff.head_plan`; both pools HND).
        ``pool``: our pool of that name into the peer's (kvtransfer/nixl/pools.py: a draft
        model's; whole blocks, all or ``layers``), its layout checked against the peer's now.
        """
        target = self._peer(peer)
        if pool is None:
            plan = self._plan(target, local_block_ids, remote_block_ids, layers, heads, coalesce)
            return self._post(target, plan, notify)
        mine = self._pools.get(pool)
        theirs = peer_pool(target.name, target.pools, pool, mine.layout)
        plan = plan_block_write(mine.layout, theirs.layout, local_block_ids, remote_block_ids, layers, coalesce)
        return self._post(target, plan, notify, local_addr=mine.addr, remote_addr=theirs.addr)

    def has_pool(self, peer: str, pool: str) -> bool:
        """Whether `write_blocks(..., pool=pool)` can write the peer's pool of that name: we both
        registered one, of compatible layouts."""
        target = self._peer(peer)
        try:
            peer_pool(target.name, target.pools, pool, self._pools.get(pool).layout)
        except (LayoutMismatchError, ValueError):
            return False
        return True

    def _plan(self, target: PeerInfo, local_block_ids, remote_block_ids, layers, heads, coalesce=True) -> WritePlan:
        if heads is None:
            return plan_block_write(self.layout, target.layout, local_block_ids, remote_block_ids, layers, coalesce)
        src_head, dst_head, num_heads = heads
        return plan_head_write(self.layout, target.layout, src_head, dst_head, num_heads, local_block_ids,
                               remote_block_ids, layers)

    def read_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
        notify: bytes | None = None,
        *,
        heads: tuple[int, int, int] | None = None,
    ) -> TransferHandle:
        """Read the K and V pages of the peer's `remote_block_ids` into our `local_block_ids`
        (all layers; runs of consecutive ids on both sides are one descriptor per layer): a
        prefix another worker holds, lent for the read (kvtransfer/lend.py). The same layout
        checks as a write; `notify` reaches the peer once the read is done. Failures are
        reported through the handle, as for writes. ``heads=(local_head, remote_head,
        num_heads)`` reads only that head range (pools of different TP sizes, HND)."""
        target = self._peer(peer)
        plan = self._plan(target, local_block_ids, remote_block_ids, None, heads)
        return self._post(target, plan, notify, "READ")

    def write_bytes(
        self, peer: str, local_offset: int, remote_offset: int, num_bytes: int, notify: bytes | None = None
    ) -> TransferHandle:
        """Write one contiguous byte range of our pool into the peer's pool (a raw baseline)."""
        target = self._peer(peer)
        for what, offset, limit in (
            ("local", local_offset, self.layout.pool_bytes),
            ("remote", remote_offset, target.pool_bytes),
        ):
            if num_bytes <= 0 or offset < 0 or offset + num_bytes > limit:
                raise ValueError(f"{what} range [{offset}, {offset + num_bytes}) is outside [0, {limit})")
        plan = WritePlan(
            local_offsets=np.array([local_offset], dtype=np.int64),
            remote_offsets=np.array([remote_offset], dtype=np.int64),
            lengths=np.array([num_bytes], dtype=np.int64),
            layers=(),
        )
        return self._post(target, plan, notify)

    def begin_stream(
        self,
        peer: str,
        local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
        notify: bytes | None = None,
        layers: Iterable[int] | None = None,
        heads: tuple[int, int, int] | None = None,
    ) -> LayerStream:
        """Start a layer-by-layer write: call `write_layer(l)` as each layer is computed, then `finish()`."""
        target = self._peer(peer)
        check_notification(notify)
        plan = self._plan(target, local_block_ids, remote_block_ids, layers, heads)
        return LayerStream(self, target.name, plan, notify)

    @_locked
    def _post(self, peer: PeerInfo, plan: WritePlan, notify: bytes | None, op: str = "WRITE",
              local_addr: int | None = None, remote_addr: int | None = None) -> TransferHandle:
        self._check_open()
        check_notification(notify)
        local = plan.local_rows(self._pool_addr if local_addr is None else local_addr, self._device_id)
        return self._writes.post(self._nixl, peer, plan, notify, local, self.mem_type, op, remote_addr)

    def _layer_poster(self) -> LayerPoster:
        """The thread that posts layers once ready (started on first use)."""
        with self._lock:
            self._check_open()
            if self._poster is None:
                self._poster = LayerPoster(self.name)
            return self._poster

    # ---- progress ---------------------------------------------------------

    @_locked
    def poll(self) -> PollResult:
        """Drive NIXL; return writes that finished and notifications received since the last poll.

        Handles finished inside `wait()` are reported here too (once).
        """
        self._progress()
        return self._writes.take()

    def wait(self, handle: TransferHandle, timeout_s: float) -> TransferHandle:
        """Drive NIXL until `handle` finishes. Raises TransferError if it failed,
        TransferTimeoutError (and abandons the write) if `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        polls = 0
        while not handle.finished:
            if handle.id not in self._writes.handles:
                raise ValueError(f"transfer {handle.id} does not belong to agent {self.name!r}")
            self._progress()
            polls += 1
            # Yield (the layer poster takes the lock between polls); past the first polls nap,
            # so that NIXL's posting threads (`num_threads`) get the cores this loop would spin on.
            time.sleep(0 if polls < _SPIN_POLLS else _NAP_S)
            if not handle.finished and time.monotonic() >= deadline:
                with self._lock:
                    self._writes.fail(handle, f"write to {handle.peer!r} not complete after {timeout_s} s")
                raise TransferTimeoutError(
                    f"write of {handle.num_bytes} bytes to {handle.peer!r} did not complete "
                    f"within {timeout_s} s; the peer may be dead: remove it or raise the timeout"
                )
        if handle.failed:
            raise TransferError(f"write to {handle.peer!r} failed: {handle.error}")
        return handle

    @_locked
    def send_notification(self, peer: str, payload: bytes) -> None:
        """Send bytes to a peer outside any write (the stream's final message)."""
        target = self._peer(peer)
        check_notification(payload)
        try:
            self._nixl.send_notif(target.name, payload)
        except self._errors as exc:
            raise TransferError(f"could not notify peer {peer!r}: {exc!r}") from exc
        self._progress()  # push it out now; nobody may poll for a while

    @_locked
    def _progress(self) -> None:
        self._check_open()
        self._writes.progress(self._nixl)

    # ---- lifecycle --------------------------------------------------------

    def close(self) -> None:
        """Fail in-flight writes, drop peers, deregister the pool, destroy the NIXL agent."""
        poster, self._poster = self._poster, None
        if poster is not None:  # outside the lock: a post under way needs it to finish
            poster.close()
        self._close()

    @_locked
    def _close(self) -> None:
        if self._closed:
            return
        self._writes.fail_all("agent closed while the write was in flight")
        for name in self._peers.names():
            self.remove_peer(name)
        self._writes.release_deferred()
        for name in self._pools.deregister(self._nixl, self._errors):
            log.warning("NIXL could not deregister the %r pool", name)
        try:
            self._nixl.deregister_memory(self._registration)
        except self._errors as exc:
            log.warning("NIXL could not deregister the KV pool: %r", exc)
        self._closed = True
        self._nixl = None

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"agent {self.name!r} is closed")

    def _peer(self, name: str) -> PeerInfo:
        self._check_open()
        return self._peers.get(name)


# `wait()`: polls before it starts to nap between polls, and the nap (measured in
# bench/tp_handoff.py: a spinning waiter took a core from NIXL's posting threads).
_SPIN_POLLS = 32
_NAP_S = 100e-6
def listening_ports() -> set[int]:
    """TCP ports this process listens on (Linux /proc; empty elsewhere)."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _backend_params(backend: str, num_threads: int, split_batch_size: int) -> dict[str, str]:
    """NIXL backend init parameters. With ``num_threads`` > 0 the UCX backend posts a write of at
    least ``split_batch_size`` descriptors (NIXL's default 1024) from that many threads, in
    chunks; its notification still follows the last chunk's data (docs/PERFORMANCE.md, the
    handoff between TP sizes, for why a sender wants this)."""
    if backend != "UCX" or num_threads == 0:
        return {}
    params = {"num_threads": str(num_threads)}
    if split_batch_size:
        params["split_batch_size"] = str(split_batch_size)
    return params
