"""Which attention heads a tensor-parallel rank holds: the one definition both roles share.

The engine shards a model by it (engine/tensor_parallel.py) and the KV handoff plans its
page writes by it (kvtransfer/head_plan.py), so prefill and decode workers of different TP
sizes agree on where every KV head lives without exchanging anything but their sizes.

With ``tp`` ranks, rank ``r`` holds query heads ``[r * Hq / tp, (r + 1) * Hq / tp)``.

- ``Hkv >= tp`` (``tp`` divides ``Hkv``): rank ``r`` holds KV heads
  ``[r * Hkv / tp, (r + 1) * Hkv / tp)``, exactly the ones its query heads read.
- ``Hkv < tp`` (``Hkv`` divides ``tp``): each KV head is *replicated* on ``tp / Hkv``
  consecutive ranks; rank ``r`` holds the single head ``r // (tp / Hkv)``, the one all its
  query heads read (``Hq / tp`` query heads per rank divide the group ``Hq / Hkv``).
"""

from __future__ import annotations


class HeadShardingError(ValueError):
    """The model's head counts cannot be split over this many ranks; the message says why."""


def check_tp_heads(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raise `HeadShardingError` unless ``tp`` ranks can split these heads as described above."""
    if tp < 1:
        raise HeadShardingError(f"tensor_parallel_size={tp} must be >= 1")
    if num_heads % tp:
        raise HeadShardingError(
            f"tensor_parallel_size={tp} must divide the model's num_attention_heads={num_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise HeadShardingError(
            f"tensor_parallel_size={tp} and num_key_value_heads={num_kv_heads}: one must divide the "
            "other (KV heads are split when there are more of them than ranks, replicated when fewer)")


def kv_replicas(num_kv_heads: int, tp: int) -> int:
    """How many ranks hold each KV head (1 unless there are fewer KV heads than ranks)."""
    return tp // num_kv_heads if tp > num_kv_heads else 1


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    return max(num_kv_heads // tp, 1)


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> range:
    """The global KV heads rank ``rank`` of ``tp`` holds, in the order of its pool."""
    if not 0 <= rank < tp:
        raise HeadShardingError(f"rank {rank} is outside tensor_parallel_size={tp}")
    if tp > num_kv_heads:
        head = rank // (tp // num_kv_heads)
        return range(head, head + 1)
    per = num_kv_heads // tp
    return range(rank * per, (rank + 1) * per)


def q_head_range(num_heads: int, tp: int, rank: int) -> range:
    per = num_heads // tp
    return range(rank * per, (rank + 1) * per)


def ranks_holding(num_kv_heads: int, tp: int, head: int) -> range:
    """The ranks whose pools hold global KV head ``head`` (several when replicated)."""
    if tp > num_kv_heads:
        rep = tp // num_kv_heads
        return range(head * rep, (head + 1) * rep)
    rank = head // (num_kv_heads // tp)
    return range(rank, rank + 1)
