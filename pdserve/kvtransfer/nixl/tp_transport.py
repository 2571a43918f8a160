"""The transport of a worker whose KV pool, or whose peer's, is split over tensor-parallel ranks.

Each rank has its own NIXL agent over its own pool (rank 0's lives in the worker process,
the others' in their rank processes: kvtransfer/nixl/rank_service.py). A worker publishes one
record listing its ranks' agents (`ranks_record`); a peer with one rank keeps publishing
the plain agent record, and both read as `PeerRanks`.

`TPSender` is the prefill side's `KVSender`: for a request it writes by the plan of
kvtransfer/head_plan.py: prefill rank ``s`` writes its head range into decode rank ``d``'s pool
for every (s, d) of the plan, and each such pair ends with its own copy of the notice,
wrapped with the pair (kvtransfer/ranked.py). Rank 0's writes go through its local agent; the
other ranks' are set up through the TP group: a stream's writes are attached to the step
that computes the request (so each rank posts its layers as its own forward computes
them), and finishing, settling or a whole-request write is a control request to every
rank, answered with what became of its writes. Between two single-rank workers nothing of
this applies: the calls go straight to the agent, unchanged.

`TPSender.read_blocks` reads a lent prefix (kvtransfer/lending.py) the other way round: the
holder's ranks are the sources of the same plan and this worker's ranks the targets, each
reading its heads into its own pool (`TPRead`).

`TPReceiver` is the decode side's `KVReceiver`: it polls rank 0's agent and the other
ranks (their agents received notices while idle) and passes every notice through
`RankedArrivals`, so the handoff table sees one `PrefillDone` per attempt, when the pages
are in place on every decode rank.

``group`` is the engine's TP group (engine/tp_group.py; anything with ``call(op, **args)``
and ``attach(item)``), or None for a single-rank worker.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.kvtransfer.head_plan import HeadWrite, write_plan
from pdserve.kvtransfer.ranked import RankedArrivals, wrap
from pdserve.kvtransfer.nixl.errors import MalformedMessageError, TransferError, TransferTimeoutError, UnknownPeerError
from pdserve.kvtransfer.nixl.transfer import Notification, PollResult

log = logging.getLogger(__name__)

RANKS_FORMAT = "pdserve.kvtransfer.ranks/1"


def rank_agent_name(worker_id: str, rank: int) -> str:
    """Rank 0's agent is named after the worker (as a single-rank worker's is)."""
    return worker_id if rank == 0 else f"{worker_id}.r{rank}"


def ranks_record(worker_id: str, infos: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The record a worker publishes: its ranks' agent records, rank 0 first (one rank: the
    plain agent record, which every version reads)."""
    if len(infos) == 1:
        return dict(infos[0])
    return {"format": RANKS_FORMAT, "name": worker_id, "tp": len(infos), "ranks": [dict(i) for i in infos]}


@dataclass(frozen=True)
class PeerRanks:
    name: str  # the worker
    tp: int
    infos: tuple[dict, ...]  # each rank's agent record, rank 0 first

    @property
    def agent_names(self) -> list[str]:
        return [i["name"] for i in self.infos]


def parse_peer_ranks(record: Mapping[str, Any]) -> PeerRanks:
    """A worker's record (plain or ranked) as its ranks; MalformedMessageError when it is neither."""
    if not isinstance(record, Mapping):
        raise MalformedMessageError(f"a peer record must be a map, got {type(record).__name__}")
    if record.get("format") != RANKS_FORMAT:
        return PeerRanks(str(record.get("name")), 1, (dict(record),))
    ranks = record.get("ranks")
    tp = record.get("tp")
    if not isinstance(ranks, list) or not isinstance(tp, int) or tp < 1 or len(ranks) != tp:
        raise MalformedMessageError(f"ranked peer record: tp={tp!r} and {len(ranks or [])} rank records disagree")
    return PeerRanks(str(record["name"]), tp, tuple(dict(r) for r in ranks))


@dataclass
class RankHandle:
    """What another rank reported about its writes of one request (already over)."""

    rank: int
    num_bytes: int = 0
    error: str | None = None
    timed_out: bool = False
    finished: bool = True

    @property
    def failed(self) -> bool:
        return self.error is not None


def _heads(w: HeadWrite) -> tuple[int, int, int]:
    return (w.src_head, w.dst_head, w.num_heads)


def _rank_handles(replies: list[dict]) -> list[RankHandle]:
    return [RankHandle(rank, r.get("bytes", 0), r.get("failed"), bool(r.get("timed_out")))
            for rank, r in enumerate(replies, start=1)]


@dataclass
class TPStream:
    """A request's layer-by-layer writes on every prefill rank (`LayerWrites`)."""

    sender: TPSender
    key: int
    peer: PeerRanks
    mine: list[tuple[int, Any]]  # (decode rank, rank 0's LayerStream)
    others: bool  # other prefill ranks write too (they were told with the step)
    finished: bool = False
    reported: dict = field(default_factory=dict)  # other ranks' outcomes, once finished

    @property
    def handles(self) -> dict:
        """Every write of the request: rank 0's layer writes, then the other ranks' reports."""
        out = {(d, layer): h for d, stream in self.mine for layer, h in stream.handles.items()}
        out.update(self.reported)
        return out

    def write_layer(self, layer: int, ready: Any = None) -> None:
        for _, stream in self.mine:
            stream.write_layer(layer, ready)

    def _others(self, op: str, **args) -> list[dict] | None:
        """``op`` on the other prefill ranks; None when the TP group is broken: it stopped those
        ranks (engine/tp_group.py `fail` kills and reaps them), and they cannot be asked."""
        try:
            return self.sender.group.call(op, key=self.key, **args)
        except Exception:
            if getattr(self.sender.group, "broken", None):
                log.info("prefill ranks stopped (%s) with request key %d's writes %s", self.sender.group.broken,
                         self.key, "never sent to them" if self._never_sent() else "under way")
                return None
            raise

    def _never_sent(self) -> bool:
        """The step that would have started the other ranks' writes never reached them (its
        sending failed): nothing of theirs was posted. Otherwise a stopped rank's writes may
        still land (over TCP, bytes it sent before it died), so nobody can vouch for them."""
        return any(isinstance(a, dict) and a.get("kind") == "stream" and a.get("key") == self.key
                   for a in getattr(self.sender.group, "undelivered", ()))

    def finish(self, timeout_s: float, notify: bytes | None = None) -> list:
        self.finished = True
        s = self.sender
        handles: list = []
        try:
            for d, stream in self.mine:
                note = None if notify is None else wrap(notify, 0, s.tp, d, self.peer.tp)
                handles += stream.finish(timeout_s, notify=note)
        finally:
            if self.others:
                replies = self._others("finish", notify=notify, timeout_s=timeout_s)
                if replies is None:  # the other ranks are gone: their writes never completed
                    replies = [{"failed": "the rank was stopped (its TP group broke)"}] * (s.tp - 1)
                for h in _rank_handles(replies):
                    self.reported[("rank", h.rank)] = h
                    handles.append(h)
        for h in handles:
            if isinstance(h, RankHandle) and h.failed:
                raise (TransferTimeoutError if h.timed_out else TransferError)(f"prefill rank {h.rank}: {h.error}")
        return handles

    def abort(self) -> None:
        self.finished = True
        for _, stream in self.mine:
            stream.abort()
        if self.others:
            self._others("abort")

    def settle_posts(self, timeout_s: float) -> bool:
        settled = all(stream.settle_posts(timeout_s) for _, stream in self.mine)
        if self.others:
            replies = self._others("settle", timeout_s=timeout_s)
            if replies is None:
                settled = settled and self._never_sent()
            else:
                settled = settled and all(r.get("settled", False) for r in replies)
        return settled


@dataclass
class TPWrite:
    """A whole-request write on every prefill rank (`WriteHandle`)."""

    mine: list
    others: list[RankHandle]

    @property
    def num_bytes(self) -> int:
        return sum(h.num_bytes for h in self.mine) + sum(h.num_bytes for h in self.others)

    @property
    def finished(self) -> bool:
        return all(h.finished for h in self.mine)


@dataclass
class TPRead:
    """A lent prefix read into this worker's ranks from the holder's (either side TP>1): rank 0's
    reads in ``mine``, the other ranks' in their processes, as they last reported them
    (`refresh`). Reads like a `TransferHandle`: ``finished`` once every rank's reads ended,
    ``failed`` if any failed, ``done`` when all arrived. The ``notify`` (the lender's release)
    is sent to the holder's rank 0 once all arrived, not with each rank's read: the holder must
    keep its blocks until the last read of them ends. Its answer (a `LendConfirm` from rank 0's
    lender, whose one lend table covers every rank's blocks) comes back to this worker's rank 0,
    and the borrower uses no rank's pages before it (kvtransfer/lending.py)."""

    sender: TPSender
    key: int
    holder: PeerRanks
    mine: list  # rank 0's TransferHandles
    notify: bytes | None = None
    others: dict[int, dict] = field(default_factory=dict)  # rank -> {"finished", "failed"} as last reported
    post_error: str | None = None  # a read rank 0 could not post (the rest of the plan was not posted)
    notified: bool = False

    @property
    def id(self) -> int:
        return -self.key  # (never a rank 0 agent handle's id, which are positive)

    @property
    def num_bytes(self) -> int:
        return sum(h.num_bytes for h in self.mine) + sum(r.get("bytes", 0) for r in self.others.values())

    @property
    def finished(self) -> bool:
        return all(h.finished for h in self.mine) and all(r.get("finished") for r in self.others.values())

    @property
    def error(self) -> str | None:
        if self.post_error is not None:
            return self.post_error
        for h in self.mine:
            if h.failed:
                return h.error or "the read failed"
        for rank, r in sorted(self.others.items()):
            if r.get("failed"):
                return f"rank {rank}: {r['failed']}"
        return None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def done(self) -> bool:
        return self.finished and not self.failed

    def refresh(self) -> TPRead:
        """Ask the other ranks how their reads stand (rank 0's move with its agent's polls); once
        every read arrived, send the ``notify``."""
        waiting = [rank for rank, r in self.others.items() if not r.get("finished")]
        if waiting:
            try:
                replies = self.sender.group.call("read_poll", keys=[self.key])
            except Exception as exc:  # noqa: BLE001  (a rank gone: its reads are as good as failed)
                # A broken group stopped its ranks (TPGroup.fail): nothing of theirs lands any more.
                gone = bool(getattr(self.sender.group, "broken", None))
                for rank in waiting:
                    self.others[rank] = {"finished": gone, "failed": f"{exc.__class__.__name__}: {exc}"}
            else:
                for rank, reply in enumerate(replies, start=1):
                    if rank in waiting:  # (one that reported its end forgot the read: it answers "finished")
                        self.others[rank] = reply["reads"][0]
        if self.done and self.notify is not None and not self.notified:
            self.notified = True
            try:
                self.sender.agent.send_notification(self.holder.agent_names[0], self.notify)
            except Exception as exc:  # noqa: BLE001  (the holder is gone: its lease ends the loan)
                log.info("could not notify %s after a read: %r", self.holder.name, exc)
        return self


class TPSender:
    """`KVSender` over this worker's ranks and its peers' ranks (see the module docstring)."""

    def __init__(self, agent, num_kv_heads: int, tp: int = 1, group=None):
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
            self.group.call("add_peer", infos=list(peer.infos))
        self._peers[peer.name] = peer
        return peer.name

    def remove_peer(self, name: str) -> bool:
        peer = self._peers.pop(name, None)
        if peer is None:
            return False
        for agent_name in peer.agent_names:
            self.agent.remove_peer(agent_name)
        if self.tp > 1:
            self.group.call("remove_peer", names=peer.agent_names)
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
                     notify: bytes | None = None) -> Any:
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
            self.group.attach({"kind": "stream", "key": key, "peer": target.agent_names, "dst_tp": target.tp,
                               "local": [int(b) for b in local_block_ids],
                               "remote": [int(b) for b in remote_block_ids],
                               "writes": [[w.src_rank, w.dst_rank, *_heads(w)] for w in plan.writes if w.src_rank]})
        return TPStream(self, key, target, mine, others)

    def write_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int], *,
                     notify: bytes | None = None) -> Any:
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
            replies = self.group.call(
                "write", peer=target.agent_names, dst_tp=target.tp, local=[int(b) for b in local_block_ids],
                remote=[int(b) for b in remote_block_ids], notify=notify, timeout_s=self.write_timeout_s,
                writes=[[w.src_rank, w.dst_rank, *_heads(w)] for w in plan.writes if w.src_rank])
            others = _rank_handles(replies)
        return TPWrite(mine, others)

    write_timeout_s = 30.0  # other ranks' whole-request writes (the worker sets its transfer timeout)

    def read_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                    notify: bytes | None = None) -> Any:
        """Read ``peer``'s blocks into this worker's (a lent prefix, kvtransfer/lending.py): each
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
                replies = self.group.call("read", key=read.key, peer=holder.agent_names, local=local, remote=remote,
                                          reads=reads)
            except Exception as exc:  # noqa: BLE001  (what a rank posted before it failed is asked later)
                read.post_error = f"{exc.__class__.__name__}: {exc}"
                read.others = {r: {"finished": False} for r in range(1, self.tp)}
            else:
                read.others = {rank: reply for rank, reply in enumerate(replies, start=1)}
        return read.refresh()

    def wait(self, handle: Any, timeout_s: float) -> Any:
        if isinstance(handle, RankHandle):
            if handle.failed:
                raise (TransferTimeoutError if handle.timed_out else TransferError)(
                    f"prefill rank {handle.rank}: {handle.error}")
            return handle
        if isinstance(handle, TPWrite):
            for h in handle.mine:
                self.agent.wait(h, timeout_s)
            for h in handle.others:
                self.wait(h, timeout_s)
            return handle
        return self.agent.wait(handle, timeout_s)

    def send_notification(self, peer: str, payload: bytes) -> None:
        """To the peer's rank 0 (a PrefillFailed: never wrapped)."""
        self.agent.send_notification(self._peer(peer).agent_names[0], payload)

    def poll(self) -> PollResult:
        return self.agent.poll()

    def __getattr__(self, name: str):
        return getattr(self.agent, name)  # local_info, close, ... of rank 0's agent


class TPReceiver:
    """`KVReceiver`: rank 0's agent and the other ranks' notices, through `RankedArrivals`."""

    def __init__(self, agent, num_kv_heads: int, tp: int = 1, group=None):
        self.agent, self.tp, self.group = agent, tp, group
        self.arrivals = RankedArrivals(num_kv_heads, decode_tp=tp)
        self.malformed = 0

    def poll(self) -> PollResult:
        res = self.agent.poll()
        notes: Iterable = res.notifications
        if self.tp > 1:
            replies = self.group.call("poll")
            notes = list(notes) + [Notification(s, bytes(p)) for r in replies for s, p in r.get("notes", [])]
        out = []
        for n in notes:
            try:
                payload = self.arrivals.feed(n.payload)
            except ValueError:  # MalformedNoticeError: the handoff layer counts and drops these
                payload = n.payload
            if payload is not None:
                out.append(Notification(n.sender, payload))
        return PollResult(completed=res.completed, failed=res.failed, notifications=out)

    def __getattr__(self, name: str):
        return getattr(self.agent, name)  # local_info, add_peer, close, ... of rank 0's agent


RANK_EXTENSION = "pdserve.kvtransfer.nixl.rank_service:RankTransfer"


def with_rank_transport(engine_args: Mapping[str, Any]) -> dict:
    """A worker's engine arguments: a tensor-parallel engine's ranks also run the transport."""
    out = dict(engine_args)
    if int(out.get("tensor_parallel_size", 1) or 1) > 1:
        out.setdefault("tp_rank_extension", RANK_EXTENSION)
    return out


@dataclass
class WorkerTransport:
    """One worker's transport over its engine's ranks: rank 0's agent here, the others' in their
    rank processes; `record` is what the worker publishes for its peers."""

    agent: Any  # rank 0's KVTransferAgent
    record: dict
    tp: int
    num_kv_heads: int
    group: Any

    def sender(self) -> TPSender:
        return TPSender(self.agent, self.num_kv_heads, self.tp, self.group)

    def receiver(self) -> TPReceiver:
        return TPReceiver(self.agent, self.num_kv_heads, self.tp, self.group)


def open_worker_transport(worker_id: str, engine, ucx_env: Mapping[str, str] | None = None,
                          threads: int = 0) -> WorkerTransport:
    """Open an agent on every rank of ``engine`` (an `LLMEngine`, started with
    `with_rank_transport` arguments when it has several ranks), each posting large writes
    from ``threads`` threads (`KVTransferAgent` num_threads)."""
    from pdserve.kvtransfer.nixl.agent import KVTransferAgent
    from pdserve.kvtransfer.nixl.layout import KVLayout

    m, conn = engine.model_config, engine.connector
    tp, group = conn.tensor_parallel_size, conn.tp_group
    kv = conn.kv_tensor
    layout = KVLayout.from_tensor(kv, m.model_id, kv_layout=conn.kv_layout, total_kv_heads=m.num_kv_heads,
                                  tp_size=tp, tp_rank=0)
    agent = KVTransferAgent(worker_id, kv, layout, ucx_env=ucx_env, num_threads=threads)
    infos = [agent.local_info()]
    if tp > 1:
        try:
            infos += [r["info"] for r in group.call("open", worker_id=worker_id, model_id=m.model_id,
                                                      total_kv_heads=m.num_kv_heads, ucx_env=dict(ucx_env or {}),
                                                      threads=threads)]
        except BaseException:
            agent.close()
            raise
    return WorkerTransport(agent, ranks_record(worker_id, infos), tp, m.num_kv_heads, group)
