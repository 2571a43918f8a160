"""A worker's transport over its tensor-parallel ranks, as its peers see it: the record it
publishes, and the TP group the rank 0 side asks the other ranks through.

Each rank has its own NIXL agent over its own pool (rank 0's lives in the worker process,
the others' in their rank processes: kvtransfer/nixl/rank_service.py). A worker publishes one
record listing its ranks' agents (`ranks_record`); a peer with one rank keeps publishing
the plain agent record, and both read as `PeerRanks` (`parse_peer_ranks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.kvtransfer.nixl.errors import MalformedMessageError

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
    infos: tuple[dict[str, Any], ...]  # each rank's agent record, rank 0 first

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


class RankGroup(Protocol):
    """The engine's TP group (engine/tp_group.py `TPGroup`), as the transport uses it: a control
    request to every other rank, answered by each in rank order, and items attached to the next
    step (a stream's writes, posted as each rank's forward computes its layers)."""

    broken: str | None  # why the group broke (it stopped the other ranks), None while whole
    undelivered: list[Any]  # the attachments of a step whose sending failed

    def call(self, op: str, **args: Any) -> list[dict[str, Any]]: ...

    def attach(self, item: Any) -> None: ...


def group_of(group: RankGroup | None) -> RankGroup:
    """``group``, which a worker with other ranks has (`TPSender` refuses tp > 1 without one)."""
    if group is None:
        raise RuntimeError("a single-rank worker has no other ranks to ask")
    return group
