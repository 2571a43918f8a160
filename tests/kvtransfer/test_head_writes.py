"""A handoff between TP sizes over real NIXL: each prefill rank (its own process and agent, an
HND pool holding its KV heads) writes the head ranges `handoff.head_plan` gives it into the
decode ranks' pools (their own processes and agents); every decode value is then checked
against an encoding of (head, layer, block, K/V, token, dim)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from kvt_peer import (PeerProcess, assert_pool_equal, blocks_digest, connect, encoded_pool, expected_pool, open_agent,
                      snapshot)

from pdserve.common.heads import kv_head_range
from pdserve.kvtransfer.head_plan import write_plan
from pdserve.kvtransfer.nixl import KVLayout
from pdserve.kvtransfer.nixl.descriptors import plan_head_write

NUM_KV_HEADS, LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 4, 2, 8, 4, 4
_names = itertools.count()


def rank_layout(tp: int, rank: int, num_blocks: int = BLOCKS, kv_layout: str = "HND") -> KVLayout:
    return KVLayout("tiny", "float32", num_layers=LAYERS, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                    num_kv_heads=len(kv_head_range(NUM_KV_HEADS, tp, rank)), head_dim=HEAD_DIM,
                    kv_layout=kv_layout, total_kv_heads=NUM_KV_HEADS, tp_size=tp, tp_rank=rank)


@pytest.fixture(scope="module")
def ranks(spawn_ctx):
    procs = [PeerProcess(spawn_ctx, f"r{i}") for i in range(5)]
    yield procs
    codes = [p.stop() for p in procs]
    assert codes == [0] * len(procs)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_every_decode_rank_holds_exactly_its_heads_after_the_plan(ranks, p_tp, d_tp):
    prefill, decode = ranks[:p_tp], ranks[p_tp:p_tp + d_tp]
    infos = []
    for r, proc in enumerate(prefill):
        lay = rank_layout(p_tp, r)
        proc.ok("open_encoded", name=f"p{r}-{next(_names)}", layout=lay.to_dict(),
                heads=list(kv_head_range(NUM_KV_HEADS, p_tp, r)))
    for r, proc in enumerate(decode):
        lay = rank_layout(d_tp, r, num_blocks=BLOCKS + 3)
        proc.layout = lay
        infos.append(proc.ok("open_encoded", name=f"d{r}-{next(_names)}", layout=lay.to_dict(), heads=None)["info"])
    local, remote = [6, 1, 2, 3, 7], [0, 9, 4, 5, 10]  # non-contiguous on both sides, a run in the middle
    plan = write_plan(NUM_KV_HEADS, p_tp, d_tp)
    names = {}
    for w in plan.writes:
        key = (w.src_rank, w.dst_rank)
        if key not in names:
            names[key] = prefill[w.src_rank].ok("add_peer", info=infos[w.dst_rank])["name"]
        res = prefill[w.src_rank].ok("write_heads", peer=names[key], local=local, remote=remote,
                                     src_head=w.src_head, dst_head=w.dst_head, num_heads=w.num_heads)
        whole = w.num_heads == rank_layout(p_tp, w.src_rank).num_kv_heads == rank_layout(d_tp, w.dst_rank).num_kv_heads
        # Whole pools: one descriptor per layer and run; a head range: K and V per block and layer.
        assert res["num_descriptors"] == (LAYERS * 4 if whole else LAYERS * len(local) * 2)
        assert res["num_bytes"] == LAYERS * len(local) * 2 * w.num_heads * BLOCK_SIZE * HEAD_DIM * 4
    for r, proc in enumerate(decode):
        lay = proc.layout
        got = np.frombuffer(proc.ok("snapshot")["data"], dtype=np.float32).reshape(lay.shape)
        # What the source blocks hold, placed at the destination blocks; every other block untouched.
        source = encoded_pool(rank_layout(d_tp, r), list(kv_head_range(NUM_KV_HEADS, d_tp, r)))
        want = np.full(lay.shape, -1.0, dtype=np.float32)
        want[:, remote] = source[:, local]
        assert np.array_equal(got, want), f"decode rank {r} of {d_tp} (prefill TP {p_tp}) holds other values"


def mla_fp8_layout(tp: int, rank: int, num_blocks: int) -> KVLayout:
    """A DeepSeek-style MLA pool in FP8: one KV head (latent and rope part; 72 values here),
    replicated on every rank, float8 pages with per-layer (k_scale, v_scale)."""
    return KVLayout("mla", "float8_e4m3fn", num_layers=LAYERS, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                    num_kv_heads=1, head_dim=72, kv_layout="HND", total_kv_heads=1, tp_size=tp, tp_rank=rank,
                    kv_cache_dtype="fp8_e4m3", kv_scales=((0.5, 0.25), (1.0, 2.0)))


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (4, 1), (1, 4)])
def test_an_mla_latent_in_fp8_pages_lands_byte_for_byte_on_every_decode_rank(ranks, p_tp, d_tp):
    """The MLA latent is not split by heads: the plan gives every decode rank the whole latent
    from exactly one prefill rank. Each rank's pool is seeded with its own bytes, so after the
    writes every decode block written must equal its writer's source block byte for byte (the
    bytes name the writer), and every other block must be as it was."""
    prefill, decode = ranks[:p_tp], ranks[p_tp:p_tp + d_tp]
    for r, proc in enumerate(prefill):
        open_agent(proc, mla_fp8_layout(p_tp, r, BLOCKS), seed=100 + r)
    for r, proc in enumerate(decode):
        open_agent(proc, mla_fp8_layout(d_tp, r, BLOCKS + 3), seed=200 + r)
    local, remote = [6, 1, 2, 3, 7], [0, 9, 4, 5, 10]  # non-contiguous on both sides
    plan = write_plan(1, p_tp, d_tp)
    assert sorted(w.dst_rank for w in plan.writes) == list(range(d_tp))  # each decode rank written once
    for w in plan.writes:
        res = prefill[w.src_rank].ok("write_heads", peer=connect(prefill[w.src_rank], decode[w.dst_rank]),
                                     local=local, remote=remote, src_head=w.src_head, dst_head=w.dst_head,
                                     num_heads=w.num_heads)
        assert res["num_bytes"] == LAYERS * len(local) * 2 * BLOCK_SIZE * 72  # one byte a value
    for w in plan.writes:
        want = expected_pool((mla_fp8_layout(d_tp, w.dst_rank, BLOCKS + 3), 200 + w.dst_rank),
                             [(mla_fp8_layout(p_tp, w.src_rank, BLOCKS), 100 + w.src_rank, local, remote)])
        assert_pool_equal(snapshot(decode[w.dst_rank]), want)


@pytest.mark.parametrize("d_tp", [2, 4])
def test_a_sender_posting_from_nixl_threads_lands_every_byte_before_its_notification(ranks, d_tp):
    """1-N with the sender's writes split over NIXL's posting threads (network.kv_transport.threads;
    a split every 2 descriptors here, so each write is several chunks): every decode rank holds
    exactly its heads at the moment the write's notification reaches it, not only later."""
    sender, decode = ranks[0], ranks[1:1 + d_tp]
    sender.ok("open_encoded", name=f"p0-{next(_names)}", layout=rank_layout(1, 0).to_dict(),
              heads=list(range(NUM_KV_HEADS)), threads=2, split_batch_size=2)
    infos = []
    for r, proc in enumerate(decode):
        lay = rank_layout(d_tp, r, num_blocks=BLOCKS + 3)
        infos.append(proc.ok("open_encoded", name=f"d{r}-{next(_names)}", layout=lay.to_dict(), heads=None)["info"])
    local, remote = [5, 0, 1, 2, 6, 3], [10, 2, 3, 4, 0, 7]
    for w in write_plan(NUM_KV_HEADS, 1, d_tp).writes:
        name = sender.ok("add_peer", info=infos[w.dst_rank])["name"]
        res = sender.ok("write_heads", peer=name, local=local, remote=remote, src_head=w.src_head,
                        dst_head=w.dst_head, num_heads=w.num_heads, notify=f"done-{w.dst_rank}".encode())
        assert res["num_descriptors"] == LAYERS * len(local) * 2
    for r, proc in enumerate(decode):
        got = proc.ok("collect", count=1, timeout_s=10.0, digest_blocks=remote)
        assert [n["payload"] for n in got["notifications"]] == [f"done-{r}".encode()]
        lay = rank_layout(d_tp, r, num_blocks=BLOCKS + 3)
        want = np.full(lay.shape, -1.0, dtype=np.float32)
        want[:, remote] = encoded_pool(rank_layout(d_tp, r), list(kv_head_range(NUM_KV_HEADS, d_tp, r)))[:, local]
        view = want.reshape(-1).view(np.uint8).reshape(lay.num_layers, lay.num_blocks, lay.block_bytes)
        assert got["digest_at_first"] == blocks_digest(view, remote), f"decode rank {r}: data after its notification"


def test_a_head_range_of_an_nhd_pool_is_refused_naming_kv_layout():
    from pdserve.kvtransfer.nixl.errors import LayoutMismatchError

    with pytest.raises(LayoutMismatchError, match="kv_layout"):
        plan_head_write(rank_layout(1, 0, kv_layout="NHD"), rank_layout(2, 0, kv_layout="NHD"), 0, 0, 2, [0], [0])


def test_pools_of_another_model_shape_are_refused():
    from pdserve.kvtransfer.nixl.errors import LayoutMismatchError

    other = KVLayout("tiny", "float32", num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK_SIZE,
                     num_kv_heads=1, head_dim=HEAD_DIM, kv_layout="HND", total_kv_heads=8, tp_size=8)
    with pytest.raises(LayoutMismatchError, match="num_kv_heads"):
        plan_head_write(rank_layout(1, 0), other, 0, 0, 1, [0], [0])
