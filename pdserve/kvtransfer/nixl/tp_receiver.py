"""`TPReceiver`: the decode side's `KVReceiver` over this worker's tensor-parallel ranks.

It polls rank 0's agent and the other ranks (their agents received notices while idle:
kvtransfer/nixl/rank_service.py) and passes every notice through `RankedArrivals`
(kvtransfer/ranked.py), so the handoff table sees one `PrefillDone` per attempt, when the
pages are in place on every decode rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.kvtransfer.nixl.ranks import RankGroup, group_of
from pdserve.kvtransfer.nixl.transfer import Notification, PollResult
from pdserve.kvtransfer.ranked import RankedArrivals

if TYPE_CHECKING:
    from pdserve.kvtransfer.nixl.agent import KVTransferAgent


class TPReceiver:
    """`KVReceiver`: rank 0's agent and the other ranks' notices, through `RankedArrivals`.
    ``group`` is the engine's TP group (engine/tp_group.py), None for a single-rank worker."""

    def __init__(self, agent: KVTransferAgent, num_kv_heads: int, tp: int = 1, group: RankGroup | None = None):
        self.agent, self.tp, self.group = agent, tp, group
        self.arrivals = RankedArrivals(num_kv_heads, decode_tp=tp)
        self.malformed = 0

    def poll(self) -> PollResult:
        res = self.agent.poll()
        notes: list[Notification] = res.notifications
        if self.tp > 1:
            replies = group_of(self.group).call("poll")
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

    def close(self) -> None:
        """Close rank 0's agent (the other ranks' close with their engine)."""
        self.agent.close()
