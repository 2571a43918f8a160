"""What `TPSender` (kvtransfer/nixl/tp_sender.py) hands back for one request's writes and reads
over several ranks: `TPStream` (layer by layer, a `LayerWrites`), `TPWrite` (whole, a
`WriteHandle`), `TPRead` (a lent prefix read rank by rank, like a `TransferHandle`), and
`RankHandle` (what another rank reported of its writes).

Rank 0's part goes through its agent here; the other ranks' through the TP group
(`RankGroup`): a stream's writes were attached to the step that computes the request, and
finishing, settling or asking how reads stand is a control request to every other rank. A
group that broke stopped those ranks (engine/tp_group.py `fail`): they cannot be asked, and
what they had posted is over or may still land, as each handle says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.kvtransfer.nixl.errors import TransferError, TransferTimeoutError
from pdserve.kvtransfer.nixl.ranks import PeerRanks, RankGroup, group_of
from pdserve.kvtransfer.ranked import wrap

if TYPE_CHECKING:
    from pdserve.kvtransfer.nixl.agent import KVTransferAgent
    from pdserve.kvtransfer.nixl.stream import LayerStream
    from pdserve.kvtransfer.nixl.transfer import TransferHandle

log = logging.getLogger(__name__)


class RankSide(Protocol):
    """The worker side a handle belongs to (a `TPSender`): rank 0's agent, its TP size, its group."""

    @property
    def agent(self) -> KVTransferAgent: ...

    @property
    def tp(self) -> int: ...

    @property
    def group(self) -> RankGroup | None: ...


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

    def check(self) -> RankHandle:
        """Itself, or the transfer error it reports."""
        if self.failed:
            raise (TransferTimeoutError if self.timed_out else TransferError)(f"prefill rank {self.rank}: {self.error}")
        return self


def rank_handles(replies: list[dict[str, Any]]) -> list[RankHandle]:
    """The other ranks' replies (rank 1 first) as their handles."""
    return [RankHandle(rank, r.get("bytes", 0), r.get("failed"), bool(r.get("timed_out")))
            for rank, r in enumerate(replies, start=1)]


@dataclass
class TPStream:
    """A request's layer-by-layer writes on every prefill rank (`LayerWrites`)."""

    sender: RankSide
    key: int
    peer: PeerRanks
    mine: list[tuple[int, LayerStream]]  # (decode rank, rank 0's LayerStream)
    others: bool  # other prefill ranks write too (they were told with the step)
    finished: bool = False
    reported: dict[tuple[str, int], RankHandle] = field(default_factory=dict)  # other ranks' outcomes, once finished

    @property
    def handles(self) -> dict[Any, TransferHandle | RankHandle]:
        """Every write of the request: rank 0's layer writes, then the other ranks' reports."""
        out: dict[Any, TransferHandle | RankHandle] = {
            (d, layer): h for d, stream in self.mine for layer, h in stream.handles.items()}
        out.update(self.reported)
        return out

    def write_layer(self, layer: int, ready: Any = None) -> None:
        for _, stream in self.mine:
            stream.write_layer(layer, ready)

    def _others(self, op: str, **args: Any) -> list[dict[str, Any]] | None:
        """``op`` on the other prefill ranks; None when the TP group is broken: it stopped those
        ranks (engine/tp_group.py `fail` kills and reaps them), and they cannot be asked."""
        group = group_of(self.sender.group)
        try:
            return group.call(op, key=self.key, **args)
        except Exception:
            if group.broken:
                log.info("prefill ranks stopped (%s) with request key %d's writes %s", group.broken,
                         self.key, "never sent to them" if self._never_sent() else "under way")
                return None
            raise

    def _never_sent(self) -> bool:
        """The step that would have started the other ranks' writes never reached them (its
        sending failed): nothing of theirs was posted. Otherwise a stopped rank's writes may
        still land (over TCP, bytes it sent before it died), so nobody can vouch for them."""
        return any(isinstance(a, dict) and a.get("kind") == "stream" and a.get("key") == self.key
                   for a in group_of(self.sender.group).undelivered)

    def finish(self, timeout_s: float, notify: bytes | None = None) -> list[TransferHandle | RankHandle]:
        self.finished = True
        s = self.sender
        handles: list[TransferHandle | RankHandle] = []
        try:
            for d, stream in self.mine:
                note = None if notify is None else wrap(notify, 0, s.tp, d, self.peer.tp)
                handles += stream.finish(timeout_s, notify=note)
        finally:
            if self.others:
                replies = self._others("finish", notify=notify, timeout_s=timeout_s)
                if replies is None:  # the other ranks are gone: their writes never completed
                    replies = [{"failed": "the rank was stopped (its TP group broke)"}] * (s.tp - 1)
                for other in rank_handles(replies):
                    self.reported[("rank", other.rank)] = other
                    handles.append(other)
        for h in handles:
            if isinstance(h, RankHandle):
                h.check()
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

    mine: list[TransferHandle]
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
    and the borrower uses no rank's pages before it (kvtransfer/borrower.py)."""

    sender: RankSide
    key: int
    holder: PeerRanks
    mine: list[TransferHandle]  # rank 0's reads
    notify: bytes | None = None
    others: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> {"finished", "failed"} as last reported
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
            group = group_of(self.sender.group)
            try:
                replies = group.call("read_poll", keys=[self.key])
            except Exception as exc:  # noqa: BLE001  (a rank gone: its reads are as good as failed)
                # A broken group stopped its ranks (TPGroup.fail): nothing of theirs lands any more.
                gone = bool(group.broken)
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
