"""The heterogeneous write plan: which prefill rank writes which KV heads into which decode rank.

A pure function of ``(num_kv_heads, prefill TP, decode TP)``; both sides compute it from
sizes they already exchange (the decode worker's etcd record lists its ranks, the task
names the decode worker), so nothing about the plan travels per request.

Where the heads live is `pdserve.common.heads` (split when there are at least as many KV
heads as ranks, replicated when fewer). The plan writes every KV head of every decode rank
exactly once. When the prefill side holds a head on several ranks (replicas), decode
replica ``j`` of that head is written by prefill replica ``j mod (prefill replicas)``: one
canonical writer per decode replica, and the writes spread over the prefill replicas.

A write is a run of heads contiguous in both pools (`HeadWrite`); the transport turns each
run into page descriptors for every layer, K and V, and block. Completion is counted per
decode rank as the *set* of prefill ranks it expects (`HandoffCompletion`): a request is
ready when every decode rank has heard from all of its sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from pdserve.common.heads import check_tp_heads, kv_head_range, ranks_holding


@dataclass(frozen=True)
class HeadWrite:
    """Prefill rank ``src_rank`` writes its local heads ``[src_head, src_head + num_heads)`` into
    decode rank ``dst_rank``'s local heads ``[dst_head, dst_head + num_heads)``; the global
    heads are ``[head, head + num_heads)``."""

    src_rank: int
    dst_rank: int
    head: int
    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True)
class WritePlan:
    num_kv_heads: int
    prefill_tp: int
    decode_tp: int
    writes: tuple[HeadWrite, ...]

    def writes_from(self, src_rank: int) -> tuple[HeadWrite, ...]:
        """What prefill rank ``src_rank`` writes (what it posts and notifies)."""
        return tuple(w for w in self.writes if w.src_rank == src_rank)

    def targets_of(self, src_rank: int) -> frozenset[int]:
        """The decode ranks prefill rank ``src_rank`` writes to (and notifies)."""
        return frozenset(w.dst_rank for w in self.writes if w.src_rank == src_rank)

    def sources_of(self, dst_rank: int) -> frozenset[int]:
        """The prefill ranks decode rank ``dst_rank`` must hear from before its heads are whole."""
        return frozenset(w.src_rank for w in self.writes if w.dst_rank == dst_rank)

    @property
    def homogeneous(self) -> bool:
        """Rank ``i`` writes its whole pool into rank ``i``: the page layout needs no head split."""
        return self.prefill_tp == self.decode_tp

    def explain(self) -> list[str]:
        """One line per write, for `pdserve status` and logs."""
        return [f"prefill rank {w.src_rank} heads {w.src_head}..{w.src_head + w.num_heads - 1} -> decode rank "
                f"{w.dst_rank} heads {w.dst_head}..{w.dst_head + w.num_heads - 1} "
                f"(global {w.head}..{w.head + w.num_heads - 1})" for w in self.writes]


def canonical_writer(num_kv_heads: int, prefill_tp: int, decode_tp: int, head: int, dst_rank: int) -> int:
    """The prefill rank that writes global KV head ``head`` into decode rank ``dst_rank``."""
    writers = ranks_holding(num_kv_heads, prefill_tp, head)
    replica = list(ranks_holding(num_kv_heads, decode_tp, head)).index(dst_rank)
    return writers[replica % len(writers)]


@lru_cache(maxsize=256)
def write_plan(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> WritePlan:
    """The plan for this shape pair; `HeadShardingError` when either TP size cannot hold the heads.

    (Only the KV heads matter here: the query-head check of each worker is its own.)
    """
    for tp in (prefill_tp, decode_tp):
        check_tp_heads(num_heads=tp * num_kv_heads, num_kv_heads=num_kv_heads, tp=tp)
    writes: list[HeadWrite] = []
    for dst in range(decode_tp):
        dst_heads = kv_head_range(num_kv_heads, decode_tp, dst)
        for offset, head in enumerate(dst_heads):
            src = canonical_writer(num_kv_heads, prefill_tp, decode_tp, head, dst)
            src_head = head - kv_head_range(num_kv_heads, prefill_tp, src).start
            last = writes[-1] if writes else None
            if (last is not None and last.src_rank == src and last.dst_rank == dst
                    and last.src_head + last.num_heads == src_head and last.dst_head + last.num_heads == offset):
                writes[-1] = HeadWrite(src, dst, last.head, last.src_head, last.dst_head, last.num_heads + 1)
            else:
                writes.append(HeadWrite(src, dst, head, src_head, offset, 1))
    return WritePlan(num_kv_heads, prefill_tp, decode_tp, tuple(writes))


@dataclass
class HandoffCompletion:
    """Arrivals of one request's writes, counted per decode rank as sets of source ranks.

    ``arrive(dst, src)`` records that prefill rank ``src`` finished its writes into decode
    rank ``dst``; duplicates and sources the plan does not expect are ignored and counted
    (a retried or stray notice must never complete a request early).
    """

    plan: WritePlan
    heard: dict[int, set[int]] = field(default_factory=dict)
    duplicates: int = 0
    unexpected: int = 0

    def arrive(self, dst_rank: int, src_rank: int) -> bool:
        """Record one arrival; True when the request's KV is whole on every decode rank."""
        if not 0 <= dst_rank < self.plan.decode_tp or src_rank not in self.plan.sources_of(dst_rank):
            self.unexpected += 1
        else:
            got = self.heard.setdefault(dst_rank, set())
            if src_rank in got:
                self.duplicates += 1
            got.add(src_rank)
        return self.complete

    @property
    def complete(self) -> bool:
        return all(self.heard.get(d, set()) >= self.plan.sources_of(d) for d in range(self.plan.decode_tp))

    def missing(self) -> dict[int, list[int]]:
        """Decode rank -> the source ranks not heard from yet (for the failure message)."""
        out = {}
        for d in range(self.plan.decode_tp):
            left = sorted(self.plan.sources_of(d) - self.heard.get(d, set()))
            if left:
                out[d] = left
        return out
