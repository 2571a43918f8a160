"""The heterogeneous write plan (kvtransfer/head_plan.py) and the head ownership it rests on."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from pdserve.common.heads import HeadShardingError, check_tp_heads, kv_head_range, q_head_range, ranks_holding
from pdserve.kvtransfer.head_plan import HandoffCompletion, write_plan

HEADS = (1, 2, 4, 8)
TPS = (1, 2, 4, 8)
LAYERS, BLOCKS = 2, 3


@pytest.mark.parametrize("num_kv_heads,tp", list(itertools.product(HEADS, TPS)))
def test_every_rank_holds_the_kv_heads_its_query_heads_read(num_kv_heads, tp):
    num_heads = 8 * num_kv_heads  # GQA group of 8: every tp in TPS divides it
    check_tp_heads(num_heads, num_kv_heads, tp)
    group = num_heads // num_kv_heads
    held = Counter()
    for rank in range(tp):
        kv = kv_head_range(num_kv_heads, tp, rank)
        held.update(kv)
        for q in q_head_range(num_heads, tp, rank):
            assert q // group in kv, f"rank {rank}: query head {q} reads KV head {q // group}, not held"
        for h in kv:
            assert rank in ranks_holding(num_kv_heads, tp, h)
    assert sorted(held) == list(range(num_kv_heads))
    assert set(held.values()) == {max(tp // num_kv_heads, 1)}  # replicas only when fewer heads than ranks


@pytest.mark.parametrize("num_heads,num_kv_heads,tp,word", [
    (6, 2, 4, "num_attention_heads=6"), (8, 3, 2, "num_key_value_heads=3"), (8, 8, 0, ">= 1")])
def test_unsplittable_shapes_are_refused_naming_the_field(num_heads, num_kv_heads, tp, word):
    with pytest.raises(HeadShardingError, match=word):
        check_tp_heads(num_heads, num_kv_heads, tp)


@pytest.mark.parametrize("num_kv_heads,p_tp,d_tp", list(itertools.product(HEADS, TPS, TPS)))
def test_the_plan_writes_every_decode_head_layer_kv_and_block_exactly_once(num_kv_heads, p_tp, d_tp):
    plan = write_plan(num_kv_heads, p_tp, d_tp)
    written = Counter()
    for w in plan.writes:
        src_heads = kv_head_range(num_kv_heads, p_tp, w.src_rank)
        dst_heads = kv_head_range(num_kv_heads, d_tp, w.dst_rank)
        for i in range(w.num_heads):
            # The source holds the head at that local index, and the destination expects it there.
            assert src_heads[w.src_head + i] == w.head + i
            assert dst_heads[w.dst_head + i] == w.head + i
            for layer, kv, block in itertools.product(range(LAYERS), range(2), range(BLOCKS)):
                written[(w.dst_rank, w.head + i, layer, kv, block)] += 1
    want = {(d, h, layer, kv, block) for d in range(d_tp) for h in kv_head_range(num_kv_heads, d_tp, d)
            for layer, kv, block in itertools.product(range(LAYERS), range(2), range(BLOCKS))}
    assert set(written) == want
    assert set(written.values()) == {1}
    # Both sides compute the expected sources from the same sizes and agree.
    for d in range(d_tp):
        assert plan.sources_of(d) == {s for s in range(p_tp) if d in plan.targets_of(s)}
        assert plan.sources_of(d)  # every decode rank hears from someone
    # Replicated prefill heads: the writes spread over the replicas rather than all from one.
    if p_tp > num_kv_heads and d_tp >= p_tp:
        assert {w.src_rank for w in plan.writes} == set(range(p_tp))


def test_the_plan_merges_contiguous_heads_into_one_write():
    plan = write_plan(8, 1, 2)
    assert [(w.src_rank, w.dst_rank, w.src_head, w.dst_head, w.num_heads) for w in plan.writes] == [
        (0, 0, 0, 0, 4), (0, 1, 4, 0, 4)]
    assert write_plan(8, 2, 2).homogeneous
    assert plan.explain()[1] == "prefill rank 0 heads 4..7 -> decode rank 1 heads 0..3 (global 4..7)"


@pytest.mark.parametrize("num_kv_heads,p_tp,d_tp", [(1, 2, 1), (2, 1, 4), (2, 4, 1), (4, 2, 4), (8, 4, 2),
                                                    (2, 8, 8), (4, 1, 1)])
def test_pools_after_the_plan_hold_exactly_the_heads_each_decode_rank_owns(num_kv_heads, p_tp, d_tp):
    """Pool values encode (head, layer, block, K/V, token, dim); copying by the plan fills every
    decode pool with its heads' values and nothing else."""
    bs, dim = 4, 3

    def encoded(heads: range) -> np.ndarray:
        layer, block, kv, tok, head, d = np.meshgrid(range(LAYERS), range(BLOCKS), range(2), range(bs),
                                                     np.array(heads), range(dim), indexing="ij")
        return ((((head * 10 + layer) * 10 + block) * 10 + kv) * 10 + tok) * 10 + d

    src = [encoded(kv_head_range(num_kv_heads, p_tp, r)) for r in range(p_tp)]
    dst = [np.full_like(encoded(kv_head_range(num_kv_heads, d_tp, r)), -1) for r in range(d_tp)]
    plan = write_plan(num_kv_heads, p_tp, d_tp)
    for w in plan.writes:  # [layer, block, K/V, token, head, dim]: a head run is one strided slice
        dst[w.dst_rank][..., w.dst_head:w.dst_head + w.num_heads, :] = \
            src[w.src_rank][..., w.src_head:w.src_head + w.num_heads, :]
    for r in range(d_tp):
        assert np.array_equal(dst[r], encoded(kv_head_range(num_kv_heads, d_tp, r)))


def test_completion_counts_sets_of_sources_per_decode_rank():
    plan = write_plan(2, 4, 2)  # 2 heads, prefill replicas on ranks {0,1} and {2,3}; decode rank d holds head d
    assert [sorted(plan.sources_of(d)) for d in range(2)] == [[0], [2]]
    done = HandoffCompletion(plan)
    assert not done.arrive(0, 0)
    assert not done.arrive(0, 0)  # a duplicate does not count twice
    assert not done.arrive(1, 1)  # rank 1 holds head 0: not a source of decode rank 1
    assert not done.arrive(5, 2)  # no decode rank 5
    assert done.missing() == {1: [2]}
    assert done.arrive(1, 2)
    assert (done.duplicates, done.unexpected) == (1, 2)
    assert done.missing() == {}


def test_completion_needs_every_source_of_every_rank():
    plan = write_plan(8, 4, 1)  # one decode rank gathers from all four prefill ranks
    done = HandoffCompletion(plan)
    for src in (3, 1, 0):
        assert not done.arrive(0, src)
    assert done.missing() == {0: [2]}
    assert done.arrive(0, 2)
