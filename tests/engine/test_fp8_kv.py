"""FP8 KV cache (engine arg kv_cache_dtype; engine/kv_quant.py, docs/kv_cache.md).

The pool is float8 and a quarter of the float32 pool's bytes per token (half of a 16-bit
pool's); greedy output is deterministic; a remote prefill over real NIXL agents (the prefill
worker at TP 1 or 2) equals the local path token for token with FP8 on both sides (scales 1.0,
and computed at start on both sides), and moves half the bytes per token of a
bfloat16 pair (measured by the prefill batch's counter); a pair whose kv_cache_dtype or
scales differ refuses to pair, naming the field; bad values are refused naming the field.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.config import ConfigError, EngineConfig
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer import PrefillDone
from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV, KVLayout, LayoutMismatchError
from pdserve.kvtransfer.nixl.tp_transport import WorkerTransport, open_worker_transport
from tests.kvtransfer.handoff_pair import paired

MAX_TOKENS = 8


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 32000) for _ in range(48)]  # three whole blocks the decode side caches
    out = [shared + [rng.randrange(3, 32000) for _ in range(21)]]
    out += [[rng.randrange(3, 32000) for _ in range(n)] for n in (5, 17, 40, 100)]
    return out


def engine(model: str, **args) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model, num_gpu_blocks_override=64, max_num_batched_tokens=512, **args))


def test_the_pool_is_float8_and_a_quarter_of_float32s_bytes(llama_dir):
    ref = engine(llama_dir)
    bf16 = engine(llama_dir, dtype="bfloat16")
    for name, storage in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                          ("fp8_e5m2", torch.float8_e5m2)):
        eng = engine(llama_dir, kv_cache_dtype=name)
        assert eng.runner.kv_cache.dtype == storage and eng.runner.dtype == torch.float32
        # bytes per token: 1 byte per element against float32's 4 and bfloat16's 2
        assert eng.connector.kv_bytes_per_token * 4 == ref.connector.kv_bytes_per_token
        assert eng.connector.kv_bytes_per_token * 2 == bf16.connector.kv_bytes_per_token
        assert eng.runner.block_bytes * 4 == ref.runner.block_bytes
        assert eng.runner.kv_cache.nbytes * 4 == ref.runner.kv_cache.nbytes
        info = eng.connector.layout_info()
        assert info["kv_cache_dtype"] == ("fp8_e5m2" if name == "fp8_e5m2" else "fp8_e4m3")
        assert info["dtype"] == "float32" and info["kv_dtype"] == str(storage).removeprefix("torch.")
        assert info["kv_scales"] == [[1.0, 1.0]] * eng.model_config.num_layers
    assert ref.connector.layout_info()["kv_cache_dtype"] == "auto"


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_fp8_greedy_output_is_deterministic_and_reads_what_the_pool_holds(llama_dir, kv_layout):
    ps = prompts(seed=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    llm = LLM(llama_dir, kv_cache_dtype="fp8", kv_layout=kv_layout)
    first = [o.token_ids for o in llm.generate(ps, params)]
    assert [o.token_ids for o in llm.generate(ps, params)] == first  # second run: prefixes from the cache
    fresh = LLM(llama_dir, kv_cache_dtype="fp8", kv_layout=kv_layout, enable_prefix_caching=False)
    assert [o.token_ids for o in fresh.generate(ps, params)] == first
    assert all(len(t) == MAX_TOKENS for t in first)
    pool = llm.engine.runner.kv_cache
    assert pool.dtype == torch.float8_e4m3fn and pool.float().abs().sum() > 0


def test_bad_kv_cache_dtypes_are_refused_naming_the_field(llama_dir):
    for bad in ("int8", "fp4", "float8", ""):
        with pytest.raises(ConfigError, match="kv_cache_dtype"):
            EngineConfig.from_kwargs(llama_dir, kv_cache_dtype=bad)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs(llama_dir, kv_cache_dtype=8)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs(llama_dir, kv_cache_dtype="fp8", attention_backend="flashinfer")
    assert EngineConfig.from_kwargs(llama_dir, kv_cache_dtype="fp8", attention_backend="native")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs(llama_dir, kv_cache_dtype="fp8_e5m2", cuda_graphs=True)
    assert EngineConfig.from_kwargs(llama_dir, kv_cache_dtype="FP8_E4M3").kv_cache_dtype == "FP8_E4M3"


def test_layouts_with_other_scales_or_kv_dtype_refuse_naming_the_field():
    base = KVLayout("m", "float8_e4m3fn", 2, 8, 16, 2, 64, kv_cache_dtype="fp8_e4m3",
                    kv_scales=((1.0, 1.0), (1.0, 1.0)))
    assert KVLayout.from_dict(base.to_dict()) == base  # the record carries the scales
    other = KVLayout("m", "float8_e4m3fn", 2, 8, 16, 2, 64, kv_cache_dtype="fp8_e4m3",
                     kv_scales=((1.0, 1.0), (0.5, 1.0)))
    with pytest.raises(LayoutMismatchError, match="kv_cache_dtype") as info:
        base.check_compatible(other)
    assert info.value.field == "kv_scales"
    auto = KVLayout("m", "float32", 2, 8, 16, 2, 64)
    with pytest.raises(LayoutMismatchError) as info:
        base.check_compatible(auto)
    assert (info.value.field, info.value.mine, info.value.theirs) == ("kv_cache_dtype", "fp8_e4m3", "auto")
    assert "kv_cache_dtype" in str(info.value)


def _transport(eng: LLMEngine, worker_id: str) -> WorkerTransport:
    return open_worker_transport(worker_id, eng, ucx_env=LOOPBACK_UCX_ENV)


def _remote(model: str, tag: str, ps, p_tp: int = 1, **args) -> tuple[list[list[int]], int]:
    """Remote prefill (on ``p_tp`` ranks) then local decode between two engines with ``args``
    (tests/kvtransfer/handoff_pair.py): each request's tokens and the bytes the prefill worker wrote."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with paired(model, tag, p_tp, 1, **args) as pair:
        pair.warm_prefix(ps[0])  # the decode side caches the first prompt's prefix
        tasks = pair.tasks(ps, params)
        assert tasks[0].cached_len == 48
        result, arrived = pair.prefill(tasks)
        assert result.failures == [] and result.done == len(tasks)
        assert all(isinstance(m, PrefillDone) for m in arrived) and len(arrived) == len(tasks)
        pair.hand_over(arrived)
        pair.decode()
        out = [o.token_ids for o in pair.outputs(len(ps))]
        assert pair.de.kv.num_free_blocks == pair.de.runner.num_blocks
        return out, pair.stats.bytes_written


TP2 = pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")


@pytest.mark.parametrize("kv_cache_dtype,p_tp,computed", [
    ("fp8_e4m3", 1, False), ("fp8_e5m2", 1, False),
    pytest.param("fp8_e4m3", 2, False, marks=TP2), pytest.param("fp8_e4m3", 2, True, marks=TP2),
])
def test_fp8_remote_prefill_equals_local_token_for_token(llama_dir, kv_cache_dtype, p_tp, computed):
    """``computed``: both sides compute their scales at start (calculate_kv_scales, per head), the
    prefill worker on 2 ranks: they agree (the pair would refuse otherwise) and the tokens match."""
    ps = prompts(seed=11)
    scales = {"calculate_kv_scales": True} if computed else {}
    want = [o.token_ids for o in LLM(llama_dir, kv_cache_dtype=kv_cache_dtype, **scales).generate(
        ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
    # Pools of different TP sizes exchange head ranges: HND on both sides.
    layout = {"kv_layout": "HND"} if p_tp > 1 else {}
    got, _ = _remote(llama_dir, f"{kv_cache_dtype[-4:]}{p_tp}{'c' if computed else ''}", ps, p_tp=p_tp,
                     kv_cache_dtype=kv_cache_dtype, **layout, **scales)
    assert got == want


def test_fp8_handoff_moves_half_the_bytes_per_token_of_bfloat16(llama_dir):
    ps = prompts(seed=12)
    _, bf16_bytes = _remote(llama_dir, "bf16", ps, dtype="bfloat16")
    _, fp8_bytes = _remote(llama_dir, "bf8", ps, dtype="bfloat16", kv_cache_dtype="fp8")
    assert bf16_bytes > 0 and fp8_bytes * 2 == bf16_bytes


def test_a_pair_with_different_kv_cache_dtypes_refuses_to_pair(llama_dir):
    pe, de = engine(llama_dir, kv_cache_dtype="fp8"), engine(llama_dir)
    pt, dt = _transport(pe, "pmix"), _transport(de, "dmix")
    try:
        with pytest.raises(LayoutMismatchError, match="kv_cache_dtype") as info:
            pt.sender().add_peer(dt.record)
        assert (info.value.mine, info.value.theirs) == ("fp8_e4m3", "auto")
    finally:
        pt.agent.close()
        dt.agent.close()
        pe.close()
        de.close()


@pytest.mark.parametrize("pe,de,ok", [("{kv_cache_dtype: fp8}", "{kv_cache_dtype: fp8_e4m3}", True),
                                      ("{kv_cache_dtype: fp8_e5m2}", "{kv_cache_dtype: fp8_e5m2}", True),
                                      ("{kv_cache_dtype: fp8}", "{}", False),
                                      ("{}", "{kv_cache_dtype: fp8_e5m2}", False),
                                      ("{kv_cache_dtype: fp8_e4m3}", "{kv_cache_dtype: fp8_e5m2}", False)])
def test_a_topology_whose_roles_store_kv_differently_is_refused(tmp_path, pe, de, ok):
    from pdserve.cluster.topology import TopologyError, load_topology
    from tests.cluster.test_topology import TP, write

    path = write(tmp_path, TP.format(p=1, d=1, pe=pe, de=de))
    if ok:
        load_topology(path)
        return
    with pytest.raises(TopologyError, match="kv_cache_dtype"):
        load_topology(path)
