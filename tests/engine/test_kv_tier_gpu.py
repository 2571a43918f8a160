"""The second KV tier on a GPU engine: host memory (pinned), copies on the tier's own CUDA
stream ordered by events against the engine's. The same workloads as test_kv_tier.py's
file tier, compared token for token with an engine without prefix caching on the same
device and dtype (float32, the torch attention path: no kernel build needed)."""

from __future__ import annotations

import random

import pytest

from pdserve.common.kv_events import MEDIUM_CPU
from pdserve.engine.offline import LLM
from tests.engine.test_kv_tier import GREEDY, prompt, settle  # the file tier's workloads, on a device

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
ON_GPU = dict(device="cuda", dtype="float32", attention_backend="torch")


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 28, **ON_GPU)
    yield lambda prompts: [o.token_ids for o in llm.generate(prompts, GREEDY)]
    llm.close()


def test_a_prefix_evicted_from_device_memory_comes_back_from_host_memory_token_exact(llama_dir, reference):
    rng = random.Random(0)
    a, b = prompt(rng, 200), prompt(rng, 200)
    llm = LLM(llama_dir, num_gpu_blocks_override=16, max_model_len=240, kv_offload_bytes=1 << 22, **ON_GPU)
    try:
        outs = [llm.generate([p], GREEDY)[0] for p in (a, b, a)]
        assert [o.token_ids for o in outs] == reference([a, b, a])
        eng = llm.engine
        tier = eng.tier.snapshot()
        assert tier["medium"] == MEDIUM_CPU and tier["backend"] == "memory", tier
        assert eng.tier.store.view().is_pinned()
        assert outs[2].num_cached_tokens == 12 * 16, outs[2].num_cached_tokens
        assert tier["loads"] == 1 and tier["loaded_blocks"] == 9 and tier["load_failures"] == 0, tier
        assert eng.kv.pool.num_free == eng.kv.pool.num_blocks and tier["pinned"] == 0
    finally:
        llm.close()


def test_a_random_shared_prefix_workload_on_a_gpu_is_token_exact_and_leaks_nothing(llama_dir, reference):
    rng = random.Random(7)
    systems = [prompt(rng, 16 * rng.randrange(3, 8)) for _ in range(4)]
    prompts = [rng.choice(systems) + prompt(rng, rng.randrange(1, 40)) for _ in range(24)]
    llm = LLM(llama_dir, num_gpu_blocks_override=20, max_model_len=300, kv_offload_bytes=40 * 12288,
              max_num_seqs=3, kv_events=True, **ON_GPU)
    try:
        got = []
        for i in range(0, len(prompts), 3):
            got += [o.token_ids for o in llm.generate(prompts[i:i + 3], GREEDY)]
        assert got == reference(prompts)
        eng = llm.engine
        settle(eng.tier)
        snap = eng.tier.snapshot()
        assert snap["loaded_blocks"] > 0 and snap["evicted"] > 0, snap
        assert eng.kv.pool.num_free == eng.kv.pool.num_blocks and snap["pinned"] == 0
        assert not eng.scheduler.loading
    finally:
        llm.close()


@pytest.mark.parametrize("mirrored", [False, True], ids=["tp1", "tp_rank0"])
def test_block_ids_leave_only_once_the_copies_out_of_them_have_landed(mirrored):
    """A block the pool takes is copied into the tier on the engine's stream, behind whatever
    the engine queued there; another worker may write into that block with NIXL as soon as
    its id leaves the engine (a reservation, a borrow's targets), and NIXL waits for no
    stream. So `flush()` (now) returns only once that copy has landed: with the stream held
    busy by a long kernel, it is idle when flush returns, and the tier holds the old KV."""
    import torch

    from pdserve.engine.block_manager import BlockPool
    from pdserve.engine.kv_tier import KVTier
    from tests.engine.test_kv_tier import cache_block

    pool_t = torch.zeros(2, 4, 2, 16, 2, 8, device="cuda")
    pool = BlockPool(4)
    handed = []
    tier = KVTier(pool_t, 4 * 2 * (2 * 16 * 2 * 8 * 4), "auto", None, window=4,
                  mirror=(lambda slots, ops, now: handed.append(now)) if mirrored else None)
    pool.tier = tier
    try:
        blk = cache_block(pool, pool_t, 1, 1.0)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on the engine's stream
        pool.allocate(4)  # takes the cached block: its copy is queued behind the spin
        tier.flush()
        assert torch.cuda.current_stream().query(), "flush returned before the copy out of the block landed"
        pool_t[:, blk.block_id] = -1.0  # what a remote write would do next
        slot = tier._slots[bytes([1]) * 32]
        assert bool((tier.store.view()[slot] == 1.0).all())
        assert handed == ([True] if mirrored else [])
    finally:
        tier.close()
