"""Write planning: block-id mappings become coalesced byte ranges of two pools."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kvtransfer.nixl import KVLayout, LayoutMismatchError, plan_block_write

SRC = KVLayout("tiny", "float16", num_layers=3, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8)
DST = KVLayout("tiny", "float16", num_layers=3, num_blocks=20, block_size=4, num_kv_heads=2, head_dim=8)
BB = SRC.block_bytes  # 256


def apply_plan(plan, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy bytes the way NIXL would: one memcpy per descriptor."""
    for lo, ro, n in zip(plan.local_offsets, plan.remote_offsets, plan.lengths):
        dst[ro:ro + n] = src[lo:lo + n]


@pytest.mark.parametrize(
    "local, remote",
    [
        ([7, 2, 9, 0, 11], [3, 19, 0, 8, 12]),  # scattered
        (list(range(6)), list(range(19, 13, -1))),  # reversed
        ([3, 4, 5, 6, 9, 10, 0, 1], [10, 11, 12, 13, 2, 3, 17, 18]),  # repeated runs
        ([4, 5, 6, 7], [1, 2, 8, 9]),  # local consecutive, remote breaks: two runs
    ],
    ids=["scattered", "reversed", "runs", "remote-break"],
)
def test_plan_copies_exactly_the_mapped_pages(local, remote):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, SRC.pool_bytes, dtype=np.uint8)
    dst = rng.integers(0, 256, DST.pool_bytes, dtype=np.uint8)
    expected = dst.reshape(3, 20, BB).copy()
    expected[:, remote] = src.reshape(3, 12, BB)[:, local]
    apply_plan(plan_block_write(SRC, DST, local, remote), src, dst)
    assert np.array_equal(dst.reshape(3, 20, BB), expected)


def test_runs_consecutive_on_both_sides_become_one_descriptor_per_layer():
    plan = plan_block_write(SRC, DST, [3, 4, 5, 6, 9, 10, 0, 1], [10, 11, 12, 13, 2, 3, 17, 18])
    assert plan.num_descriptors == 3 * 3  # 3 runs x 3 layers
    assert plan.lengths[:3].tolist() == [4 * BB, 2 * BB, 2 * BB]
    assert plan.num_bytes == 3 * 8 * BB


def test_a_run_needs_consecutive_ids_on_both_sides():
    assert plan_block_write(SRC, DST, [4, 5, 6, 7], [1, 2, 8, 9]).num_descriptors == 2 * 3
    assert plan_block_write(SRC, DST, [0, 1, 2], [5, 4, 3]).num_descriptors == 3 * 3


def test_without_coalescing_every_block_is_a_descriptor():
    plan = plan_block_write(SRC, DST, range(8), range(8), coalesce=False)
    assert plan.num_descriptors == 8 * 3
    assert set(plan.lengths.tolist()) == {BB}


def test_byte_math_follows_the_pool_contract():
    plan = plan_block_write(SRC, DST, [5], [17], layers=[2])
    assert plan.local_offsets.tolist() == [SRC.block_offset(2, 5)] == [(2 * 12 + 5) * BB]
    assert plan.remote_offsets.tolist() == [DST.block_offset(2, 17)] == [(2 * 20 + 17) * BB]


def test_a_layer_subset_touches_only_those_layers():
    plan = plan_block_write(SRC, DST, [1, 2], [3, 4], layers=[2, 0])
    assert plan.layers == (2, 0)
    assert plan.remote_offsets.tolist() == [DST.block_offset(2, 3), DST.block_offset(0, 3)]
    assert plan.for_layer(0).remote_offsets.tolist() == [DST.block_offset(0, 3)]
    with pytest.raises(ValueError, match="not in this plan"):
        plan.for_layer(1)


@pytest.mark.parametrize(
    "local, remote, layers, message",
    [
        ([0, 1], [0], None, "one remote block per local block"),
        ([0, 12], [0, 1], None, r"outside the pool's \[0, 12\)"),
        ([0, 1], [0, 20], None, r"outside the pool's \[0, 20\)"),
        ([0, 1], [4, 4], None, "repeats a block"),
        ([], [], None, "non-empty"),
        ([0.5], [1], None, "integers"),
        ([0], [1], [3], r"outside \[0, 3\)"),
        ([0], [1], [1, 1], "repeats a layer"),
        ([0], [1], [], "layers is empty"),
    ],
)
def test_malformed_mappings_are_refused(local, remote, layers, message):
    with pytest.raises(ValueError, match=message):
        plan_block_write(SRC, DST, local, remote, layers)


def test_one_source_block_may_feed_several_targets():
    plan = plan_block_write(SRC, DST, [2, 2], [5, 9])
    assert plan.local_offsets.tolist()[:2] == [SRC.block_offset(0, 2)] * 2


def test_incompatible_layouts_cannot_be_planned():
    other = KVLayout("tiny", "float16", num_layers=3, num_blocks=20, block_size=8, num_kv_heads=2, head_dim=8)
    with pytest.raises(LayoutMismatchError, match="block_size"):
        plan_block_write(SRC, other, [0], [0])


def test_whole_blocks_are_refused_between_pools_of_different_tp_sizes():
    """A TP=2 rank holds half of each block: its blocks are not the bytes of a TP=1 pool's, so
    a whole-block plan would read or write at the wrong offsets. Refused, naming the field."""
    half = KVLayout("tiny", "float16", num_layers=3, num_blocks=12, block_size=4, num_kv_heads=1, head_dim=8,
                    total_kv_heads=2, tp_size=2, tp_rank=1)
    for a, b in ((SRC, half), (half, SRC)):
        with pytest.raises(LayoutMismatchError, match="num_kv_heads"):
            plan_block_write(a, b, [0, 1], [2, 3])
