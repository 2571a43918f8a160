"""`TPSender`: the prefill side's `KVSender` over this worker's ranks and its peers' ranks.

For a request it writes by the plan of kvtransfer/head_plan.py: prefill rank ``s`` writes its
head range into decode rank ``d``'s pool for every (s, d) of the plan, and each such pair ends
with its own copy of the notice, wrapped with the pair (kvtransfer/ranked.py). Rank 0's writes
go through its local agent; the other ranks' are set up through the TP group: a stream's
writes are attached to the step that computes the request (so each rank posts its layers as
its own forward computes them), and finishing, settling or a whole-request write is a control
request to every rank, answered with what became of its writes (kvtransfer/nixl/tp_handles.py).
Between two single-rank workers nothing of this applies: the calls go straight to the agent,
unchanged.

`TPSender.read_blocks` reads a lent prefix (kvtransfer/borrower.py) the other way round: the
holder's ranks are the sources of the same plan and this worker's ranks the targets, each
reading its heads into its own pool (`TPRead`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pdserve.kvtransfer.head_plan import HeadWrite, write_plan
from pdserve.kvtransfer.nixl.errors import UnknownPeerError
from pdserve.kvtransfer.nixl.ranks import PeerRanks, RankGroup, group_of, parse_peer_ranks
from pdserve.kvtransfer.nixl.tp_handles import RankHandle, TPRead, TPStream, TPWrite, rank_handles
from pdserve.kvtransfer.nixl.transfer import PollResult, TransferHandle
from pdserve.kvtransfer.ranked import wrap
from pdserve.kvtransfer.transport import WriteHandle

if TYPE_CHECKING:
    from pdserve.kvtransfer.nixl.agent import KVTransferAgent
    from pdserve.kvtransfer.nixl.stream import LayerStream


def _heads(w: HeadWrite) -> tuple[int, int, int]:
    return (w.src_head, w.dst_head, w.num_heads)


class TPSender:
    """`KVSender` over this worker's ranks and its peers' ranks (see the module docstring).

    ``agent`` is rank 0's, ``group`` the engine's TP group (engine/tp_group.py), None for a
    single-rank worker. A worker that lends its prefixes hands each `poll()`'s result to its
    `Lending.on_poll` (kvtransfer/lending.py) itself (prefill/loans.py, decode/kv_arrival.py)."""

    write_timeout_s = 30.0  # other ranks' whole-request writes (the worker sets its transfer timeout)

    def __init__(self, agent: KVTransferAgent, num_kv_heads: int, tp: int = 1, group: RankGroup | None = None):
        if tp > 1 and group is None:
            raise ValueError("a prefill worker with tp > 1 needs its TP group")
        self.agent, self.num_kv_heads, self.tp, self.group = agent, num_kv_heads, tp, group
        self._peers: dict[str, PeerRanks] = {}
        self._keys = itertools.count(1)

    # -- peers -----------------------------------------------------------------------
    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def add_peer(self, record: Mapping[str, Any]) -> str:
        """Add a worker (its plain or ranked record) on every rank of this one; returns its name."""
        peer = parse_peer_ranks(record)
        write_plan(self.num_kv_heads, self.tp, peer.tp)  # HeadShardingError: no plan fits the pair
        for info in peer.infos:
            self.agent.add_peer(info)
        if self.tp > 1:
            group_of(self.group).call("add_peer", infos=list(peer.infos))
        self._peers[peer.name] = peer
        return peer.name

    def remove_peer(self, name: str) -> bool:
        peer = self._peers.pop(name, None)
        if peer is None:
            return False
        for agent_name in peer.agent_names:
            self.agent.remove_peer(agent_name)
        if self.tp > 1:
            group_of(self.group).call("remove_peer", names=peer.agent_names)
        return True

    def peer_tp(self, name: str) -> int:
        """How many ranks a peer's pool is split over (1 for a peer not known here)."""
        peer = self._peers.get(name)
        return peer.tp if peer is not None else 1

    def _peer(self, name: str) -> PeerRanks:
        peer = self._peers.get(name)
        if peer is None:
            raise UnknownPeerError(f"unknown peer {name!r}; add it (its etcd record) first")
        return peer

    def _single(self, peer: PeerRanks) -> bool:
        return self.tp == 1 and peer.tp == 1

    # -- writes ------------------------------------------------------------------------
    def begin_stream(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                     notify: bytes | None = None) -> LayerStream | TPStream:
        target = self._peer(peer)
        if self._single(target):
            return self.agent.begin_stream(target.agent_names[0], local_block_ids, remote_block_ids, notify)
        plan = write_plan(self.num_kv_heads, self.tp, target.tp)
        mine = [(w.dst_rank, self.agent.begin_stream(target.agent_names[w.dst_rank], local_block_ids,
                                                     remote_block_ids, None, heads=_heads(w)))
                for w in plan.writes_from(0)]
        key = next(self._keys)
        others = self.tp > 1
        if others:
            group_of(self.group).attach(
                {"kind": "stream", "key": key, "peer": target.agent_names, "dst_tp": target.tp,
                 "local": [int(b) for b in local_block_ids], "remote": [int(b) for b in remote_block_ids],
                 "writes": [[w.src_rank, w.dst_rank, *_heads(w)] for w in plan.writes if w.src_rank]})
        return TPStream(self, key, target, mine, others)

    def write_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int], *,
                     notify: bytes | None = None) -> TransferHandle | TPWrite:
        target = self._peer(peer)
        if self._single(target):
            return self.agent.write_blocks(target.agent_names[0], local_block_ids, remote_block_ids, notify=notify)
        plan = write_plan(self.num_kv_heads, self.tp, target.tp)
        mine = [self.agent.write_blocks(target.agent_names[w.dst_rank], local_block_ids, remote_block_ids,
                                        notify=None if notify is None else wrap(notify, 0, self.tp, w.dst_rank,
                                                                                 target.tp),
                                        heads=_heads(w))
                for w in plan.writes_from(0)]
        others: list[RankHandle] = []
        if self.tp > 1:
            replies = group_of(self.group).call(
                "write", peer=target.agent_names, dst_tp=target.tp, local=[int(b) for b in local_block_ids],
                remote=[int(b) for b in remote_block_ids], notify=notify, timeout_s=self.write_timeout_s,
                writes=[[w.src_rank, w.dst_rank, *_heads(w)] for w in plan.writes if w.src_rank])
            others = rank_handles(replies)
        return TPWrite(mine, others)

    def write_pool(self, peer: str, pool: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int]
                   ) -> TransferHandle:
        """Whole blocks of our pool ``pool`` (a draft model's, kvtransfer/nixl/pools.py) into the
        peer's pool of that name, rank 0 to rank 0 (the draft runs whole on rank 0 of each)."""
        return self.agent.write_blocks(self._peer(peer).agent_names[0], local_block_ids, remote_block_ids,
                                       pool=pool)

    def has_pool(self, peer: str, pool: str) -> bool:
        """Whether the peer's rank 0 registered a pool ``pool`` that ours of that name can write."""
        return self.agent.has_pool(self._peer(peer).agent_names[0], pool)

    def read_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                    notify: bytes | None = None) -> TransferHandle | TPRead:
        """Read ``peer``'s blocks into this worker's (a lent prefix, kvtransfer/borrower.py): each
        rank here reads its heads from the holder ranks the plan names as their sources, and
        ``notify`` reaches the holder's rank 0 once every read arrived. Between two single-rank
        workers: the agent's read, unchanged. Never raises once a read is posted: what could not
        be posted fails the returned `TPRead`."""
        holder = self._peer(peer)
        if self._single(holder):
            return self.agent.read_blocks(holder.agent_names[0], local_block_ids, remote_block_ids, notify=notify)
        plan = write_plan(self.num_kv_heads, holder.tp, self.tp)  # the holder's ranks are the sources
        local, remote = [int(b) for b in local_block_ids], [int(b) for b in remote_block_ids]
        read = TPRead(self, next(self._keys), holder, [], notify)
        try:
            for w in plan.writes:
                if w.dst_rank == 0:
                    read.mine.append(self.agent.read_blocks(holder.agent_names[w.src_rank], local, remote,
                                                            heads=(w.dst_head, w.src_head, w.num_heads)))
        except Exception as exc:  # noqa: BLE001  (a layout that cannot be read: the borrow fails)
            read.post_error = f"{exc.__class__.__name__}: {exc}"
            return read
        if self.tp > 1:
            reads = [[w.src_rank, w.dst_rank, w.dst_head, w.src_head, w.num_heads] for w in plan.writes if w.dst_rank]
            try:
                replies = group_of(self.group).call("read", key=read.key, peer=holder.agent_names, local=local,
                                                    remote=remote, reads=reads)
            except Exception as exc:  # noqa: BLE001  (what a rank posted before it failed is asked later)
                read.post_error = f"{exc.__class__.__name__}: {exc}"
                read.others = {r: {"finished": False} for r in range(1, self.tp)}
            else:
                read.others = {rank: reply for rank, reply in enumerate(replies, start=1)}
        return read.refresh()

    def wait(self, handle: WriteHandle, timeout_s: float) -> WriteHandle:
        """Until ``handle`` (one this sender handed out) landed: TransferError if it failed,
        TransferTimeoutError past ``timeout_s``."""
        if isinstance(handle, RankHandle):
            return handle.check()
        if isinstance(handle, TPWrite):
            for h in handle.mine:
                self.agent.wait(h, timeout_s)
            for other in handle.others:
                other.check()
            return handle
        if not isinstance(handle, TransferHandle):
            raise TypeError(f"not a write of this sender: {handle!r}")
        return self.agent.wait(handle, timeout_s)

    # -- notices, progress, end -----------------------------------------------------------
    def send_notification(self, peer: str, payload: bytes) -> None:
        """To the peer's rank 0 (a PrefillFailed: never wrapped)."""
        self.agent.send_notification(self._peer(peer).agent_names[0], payload)

    def poll(self) -> PollResult:
        """Rank 0's agent's progress and notifications."""
        return self.agent.poll()

    def close(self) -> None:
        """Close rank 0's agent (the other ranks' close with their engine)."""
        self.agent.close()
