"""The per-step fast paths: batch building, paged torch attention, RoPE, greedy argmax."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.attention_base import BatchLayout
from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.model import apply_rope_
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.sampler import first_argmax
from pdserve.engine.step_batch import build_step_batch
from pdserve.engine.torch_attention import TorchAttention, split_by_length

BS = 4  # small blocks: every sequence spans several


def test_batch_positions_slots_and_sampling_rows():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    fresh = Request("fresh", list(range(10, 16)), SamplingParams())  # 6-token prompt, all new
    chunk = Request("chunk", list(range(20, 31)), SamplingParams())  # 11 tokens, 5 cached, 4 now
    decode = Request("decode", [7, 8, 9], SamplingParams())
    decode.output_token_ids = [40, 41]  # position 4 is the last output token
    chunk.num_computed_tokens, decode.num_computed_tokens = 5, 4
    for req, total in ((fresh, 6), (chunk, 9), (decode, 5)):
        assert kv.allocate(req.request_id, total)
    batch = build_step_batch([(fresh, 6), (chunk, 4), (decode, 1)], kv, BS, torch.device("cpu"))

    assert batch.input_ids.tolist() == list(range(10, 16)) + [25, 26, 27, 28] + [41]
    assert batch.positions.tolist() == list(range(6)) + [5, 6, 7, 8] + [4]
    tables = {r: kv.block_ids(r) for r in ("fresh", "chunk", "decode")}
    expect = [tables[r][p // BS] * BS + p % BS
              for r, ps in (("fresh", range(6)), ("chunk", range(5, 9)), ("decode", [4])) for p in ps]
    assert batch.layout.slot_mapping.tolist() == expect
    assert batch.layout.query_start_loc.tolist() == [0, 6, 10, 11]
    assert batch.layout.context_lens.tolist() == [0, 5, 4]
    # The chunk stops short of its prompt's end, so it does not sample.
    assert batch.sampling == [fresh, decode]
    assert batch.logits_indices.tolist() == [5, 10]


def _reference_attention(q, k_all, v_all, scale):
    """Causal attention of the last q.shape[0] positions over k_all/v_all (one sequence)."""
    n_q, total = q.shape[0], k_all.shape[0]
    mask = torch.arange(total)[None, :] <= torch.arange(total - n_q, total)[:, None]
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k_all, v_all))
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def test_paged_attention_matches_dense_reference_for_a_mixed_batch():
    """Fresh prefill, prefill chunk after cached context, and decodes of many lengths (GQA 3:1)."""
    torch.manual_seed(0)
    hq, hkv, d, nb = 6, 2, 8, 64
    scale = d ** -0.5
    pool = torch.zeros(nb, 2, BS, hkv, d)
    rng = random.Random(0)
    free = list(range(nb))
    rng.shuffle(free)
    # (context tokens already in the pool, new tokens this step)
    seqs = [(0, 7), (9, 5)] + [(c, 1) for c in (1, 3, 4, 5, 15, 16, 17, 30, 31, 2)]
    hist_k, hist_v, tables = [], [], []
    for ctx, n in seqs:
        nblk = -(-(ctx + n) // BS)
        tables.append([free.pop() for _ in range(nblk)])
        hist_k.append(torch.randn(ctx + n, hkv, d))
        hist_v.append(torch.randn(ctx + n, hkv, d))
        for p in range(ctx):  # the cached context is already in the pool
            blk, off = tables[-1][p // BS], p % BS
            pool[blk, 0, off], pool[blk, 1, off] = hist_k[-1][p], hist_v[-1][p]
    new = np.array([n for _, n in seqs])
    qsl = np.concatenate(([0], np.cumsum(new)))
    slots = [tables[i][p // BS] * BS + p % BS for i, (c, n) in enumerate(seqs) for p in range(c, c + n)]
    width = max(map(len, tables))
    layout = BatchLayout(
        query_start_loc=qsl, context_lens=np.array([c for c, _ in seqs]),
        block_tables=np.array([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots), block_size=BS,
    )
    q = torch.randn(int(qsl[-1]), hq, d)
    k = torch.cat([hk[c:] for hk, (c, _) in zip(hist_k, seqs)])
    v = torch.cat([hv[c:] for hv, (c, _) in zip(hist_v, seqs)])
    backend = TorchAttention(scale)
    out = backend.forward(pool, q, k, v, backend.plan(layout, torch.device("cpu")))

    for i, (ctx, n) in enumerate(seqs):
        q0, q1 = int(qsl[i]), int(qsl[i + 1])
        ref = _reference_attention(q[q0:q1], hist_k[i], hist_v[i], scale)
        torch.testing.assert_close(out[q0:q1], ref, rtol=1e-5, atol=1e-6)


def _brute_force_cost(lengths, group_cost):
    n, best = len(lengths), None
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        cost = sum((b - a) * lengths[b - 1] + group_cost for a, b in zip(bounds, bounds[1:]))
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_split_by_length_is_optimal_and_covers_every_sequence(seed):
    rng = random.Random(seed)
    lengths = sorted(rng.choice([16, 32, 48, 160, 400]) for _ in range(rng.randint(1, 9)))
    group_cost = rng.choice([0, 16, 100, 512])
    runs = split_by_length(lengths, group_cost)
    assert runs[0][0] == 0 and runs[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    cost = sum((b - a) * lengths[b - 1] + group_cost for a, b in runs)
    assert cost == _brute_force_cost(lengths, group_cost)


def test_rope_in_place_is_bitwise_hf_rotate_half():
    torch.manual_seed(0)
    x = torch.randn(37, 8, 64)
    angles = torch.randn(37, 1, 32)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    rotated = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    expected = x * cos + rotated * sin
    apply_rope_(x, cos, sin)
    assert torch.equal(x, expected)


def test_first_argmax_matches_argmax_with_ties_and_nan():
    torch.manual_seed(0)
    ties = torch.randint(0, 4, (9, 32000)).float()  # many equal maxima per row
    flat = torch.zeros(3, 32000)
    nan = torch.randn(4, 32000)
    nan[1, 777] = nan[1, 30000] = float("nan")
    odd_vocab = torch.randn(5, 1000)  # not a multiple of the slice width: plain argmax
    for logits in (torch.randn(64, 32000), ties, flat, nan, odd_vocab):
        assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
