"""The FlashInfer backend's inputs and wiring, on CPU, against a stand-in written from
FlashInfer's documentation (tests/engine/fake_flashinfer.py): which wrapper each step
plans, host int32 plan inputs, append coordinates, and greedy tokens equal to the torch
path through chunked prefill, prefix-cache hits and decode. The kernels themselves run
in the `gpu` tests (tests/engine/test_flashinfer.py)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import fake_flashinfer  # noqa: E402

from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine import attention  # noqa: E402
from pdserve.engine.attention import FlashInferAttention, PagedPlan  # noqa: E402
from pdserve.engine.attention_base import BatchLayout  # noqa: E402
from pdserve.engine.cuda_graphs import DecodeGraphs  # noqa: E402


@pytest.fixture
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(attention, "FLASHINFER_DTYPES", (torch.float32,))  # the stand-in runs float32
    monkeypatch.setattr(attention, "FLASHINFER_HEAD_DIMS", (16,))  # and the CPU suite's small heads
    fake_flashinfer.calls.clear()
    return fake_flashinfer.calls


def _with_flashinfer(llm: LLM) -> LLM:
    runner = llm.engine.runner
    m = llm.engine.model_config
    runner.backend = FlashInferAttention(m.head_dim ** -0.5, m.num_heads, m.num_kv_heads, m.head_dim,
                                         runner.dtype, runner.device, workspace_bytes=64)
    return llm


def test_paged_plan_matches_the_layout():
    # seq 0: 5 cached + chunk of 3; seq 1: decode at position 9; seq 2: fresh prompt of 2.
    layout = BatchLayout(
        query_start_loc=np.array([0, 3, 4, 6]), context_lens=np.array([5, 9, 0]),
        block_tables=np.array([[7, 2, 0], [4, 5, 6], [1, 0, 0]]), slot_mapping=torch.zeros(6, dtype=torch.long),
        block_size=4)
    p = PagedPlan.from_layout(layout)
    assert p.qo_indptr.tolist() == [0, 3, 4, 6]
    assert p.kv_indptr.tolist() == [0, 2, 5, 6]  # 8 tokens -> 2 pages, 10 -> 3, 2 -> 1
    assert p.kv_indices.tolist() == [7, 2, 4, 5, 6, 1]
    assert p.kv_last_page_len.tolist() == [4, 2, 2]
    assert p.batch_indices.tolist() == [0, 0, 0, 1, 2, 2]
    assert p.positions.tolist() == [5, 6, 7, 9, 0, 1]
    assert all(a.dtype == np.int32 for a in (p.qo_indptr, p.kv_indptr, p.kv_indices, p.positions))


def test_what_flashinfer_has_no_kernel_for_is_refused_with_the_setting_to_change():
    with pytest.raises(ValueError, match="bfloat16"):
        FlashInferAttention(1.0, 4, 2, 64, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"head_dim in \(64, 128, 256, 512\); this model's is 16"):
        FlashInferAttention(1.0, 4, 2, 16, torch.bfloat16, torch.device("cpu"))


def test_steps_plan_the_right_wrapper_and_tokens_equal_the_torch_path(llama_dir, fake_fi):
    rng = random.Random(5)
    shared = [rng.randrange(3, 300) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(n)] for n in (3, 17, 1)]
    prompts.append([rng.randrange(3, 300) for _ in range(2)])
    params = SamplingParams(max_tokens=6, temperature=0.0)
    args = dict(kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=24)
    ref = LLM(llama_dir, **args).generate(prompts, params)
    llm = _with_flashinfer(LLM(llama_dir, **args))
    outs = [llm.generate([p], params)[0] for p in prompts[:1]] + llm.generate(prompts[1:], params)

    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert outs[1].num_cached_tokens > 0, "the shared prefix should come from the cache"
    kinds = [what for what, _ in fake_fi]
    assert "plan_prefill" in kinds and "plan_decode" in kinds
    m = llm.engine.model_config
    group_ok = {facts["tensor_cores"] for what, facts in fake_fi if what == "plan_decode"}
    assert group_ok == {m.num_heads // m.num_kv_heads >= attention.TENSOR_CORE_MIN_GROUP}
    # every layer of every step appends exactly the step's new tokens, once
    appends = sum(1 for what, _ in fake_fi if what == "append")
    plans = sum(1 for what, _ in fake_fi if what.startswith("plan_"))
    assert appends == plans * m.num_layers


def _overlap_run(llama_dir: str, seed: int):
    """Three decoding requests of different lengths, their torch-path reference, and an engine
    with overlap_steps on the FlashInfer stand-in."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 21, 9)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 14, 11)]
    args = dict(kv_cache_memory_bytes=8 << 20, block_size=4)
    ref = LLM(llama_dir, **args).generate(prompts, params)
    return prompts, params, ref, _with_flashinfer(LLM(llama_dir, overlap_steps=True, **args))


def test_decode_steps_planned_ahead_alternate_two_wrappers_and_keep_tokens_exact(llama_dir, fake_fi):
    """Engine arg overlap_steps (engine/overlap.py): a decode step planned while the one before
    runs goes into the other decode wrapper; tokens stay the torch path's."""
    prompts, params, ref, llm = _overlap_run(llama_dir, seed=11)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    ahead = llm.engine.runner.lookahead
    assert ahead is not None and ahead.planned > 0
    decode_plans = [facts["wrapper"] for what, facts in fake_fi if what == "plan_decode"]
    assert len(set(decode_plans)) == 2
    # On a device the last step may still run when the next is planned: once there are two
    # wrappers, no decode plan goes into the one the last step ran
    spare, last_run, two, checked = id(llm.engine.runner.backend._spare), None, False, 0
    for what, facts in fake_fi:
        if what == "run_decode":
            last_run = facts["wrapper"]
        elif what == "plan_decode":
            two = two or facts["wrapper"] == spare
            if two:
                assert facts["wrapper"] != last_run
                checked += 1
    assert checked >= 10


class _EagerGraphs(DecodeGraphs):
    """CUDA graphs whose "replay" runs the captured forward eagerly (CPU has no graphs): the
    static buffers, padding rows, scratch block and per-size wrapper plans are the real ones."""

    replays: list[int]
    slots_replayed: list[int]

    def _record(self, size, slot):
        graphs = self

        class Replay:
            def replay(self):
                graphs.replays.append(size)
                graphs.slots_replayed.append(slot)
                graphs._forward(size, slot)

        self._forward(size, slot)  # what capture runs once
        return Replay()


def test_decode_graphs_pad_into_the_scratch_block_and_keep_tokens_exact(llama_dir, fake_fi):
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 21, 9)]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    args = dict(kv_cache_memory_bytes=8 << 20)
    ref = LLM(llama_dir, **args).generate(prompts, params)
    llm = _with_flashinfer(LLM(llama_dir, **args))
    runner, kv = llm.engine.runner, llm.engine.kv
    graphs = _EagerGraphs(runner, kv, max_batch=8, max_model_len=64)
    graphs.replays, graphs.slots_replayed = [], []
    graphs.capture()
    runner.graphs = graphs
    assert graphs.sizes == [1, 2, 4, 8] and set(graphs.wrappers) == {1, 2, 4, 8}
    assert all(w.use_cuda_graph for w in graphs.wrappers.values())

    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert graphs.replays and set(graphs.replays) <= {4}, "3 decoding sequences replay the 4-row graph"
    # the scratch block is held by the pool outside every request's table, and stays held
    assert all(graphs.scratch_block not in kv.block_ids(rid) for rid in kv.tables)
    assert kv.pool.blocks[graphs.scratch_block].ref_cnt == 1
    assert graphs.size_for(BatchLayout(np.arange(10), np.ones(9, dtype=np.int64), np.zeros((9, 1), np.int64),
                                       torch.zeros(9), 16)) is None  # more rows than the largest graph


def test_decode_graphs_loaded_ahead_alternate_two_sets_and_keep_tokens_exact(llama_dir, fake_fi):
    """overlap_steps with decode graphs: the next step is loaded and planned into the set of
    static inputs the running replay does not read; tokens stay the torch path's."""
    prompts, params, ref, llm = _overlap_run(llama_dir, seed=13)
    runner, kv = llm.engine.runner, llm.engine.kv
    graphs = _EagerGraphs(runner, kv, max_batch=8, max_model_len=64, slots=2)
    graphs.replays, graphs.slots_replayed = [], []
    graphs.capture()
    runner.graphs = graphs
    loaded = []
    load_ahead = graphs.load_ahead
    graphs.load_ahead = lambda batch, size: loaded.append(load_ahead(batch, size)) or loaded[-1]

    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert len(graphs.slots[0].graphs) == len(graphs.slots[1].graphs) == 4
    ahead = runner.lookahead
    assert ahead is not None and ahead.planned > 0 and len(loaded) == ahead.prepared
    # consecutive replays read alternate sets
    assert all(a != b for a, b in zip(graphs.slots_replayed, graphs.slots_replayed[1:]))
    assert set(graphs.slots_replayed) == {0, 1}


def test_cuda_graphs_are_refused_off_the_cuda_flashinfer_path(llama_dir):
    with pytest.raises(ValueError, match="cuda_graphs=True needs device='cuda'"):
        LLM(llama_dir, device="cpu", cuda_graphs=True, kv_cache_memory_bytes=4 << 20)
