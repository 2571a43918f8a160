"""Qwen3, Qwen3-MoE, Mixtral and DeepSeek-V3 (engine/model.py, engine/moe.py, engine/mla.py): greedy
output equals HF transformers' in float32, batched, in chunks and from the prefix cache, at TP=1 and
TP=2, from both checkpoint forms of the experts; DeepSeek's pool holds one latent head per token;
bad configs are refused naming the field."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine import cli as engine_cli
from pdserve.engine.config import ConfigError, EngineConfig, ModelConfig
from pdserve.engine.model_maker import ModelSpec, make_model
from pdserve.engine.moe import grouped_mm_available
from pdserve.engine.tensor_parallel import check_tp, expert_parallel

from .markers import needs_shm

from .test_hf_parity import hf_greedy, mixed_prompts

MAX_TOKENS = 12

SPECS = {
    # head_dim 64 where hidden / heads is 32: the head dim comes from config.json.
    "qwen3": ModelSpec(arch="qwen3", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate_size=256, seed=21),
    # Layer 1 dense (mlp_only_layers) between two expert layers; renormalised top-k.
    "qwen3_moe": ModelSpec(arch="qwen3_moe", num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2,
                           intermediate_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                           norm_topk_prob=True, mlp_only_layers=(1,), seed=22),
    # Raw top-k probabilities (norm_topk_prob false), top 3 of 6, tied embeddings.
    "qwen3_moe_raw": ModelSpec(arch="qwen3_moe", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=1,
                               intermediate_size=256, num_experts=6, num_experts_per_tok=3,
                               moe_intermediate_size=64, norm_topk_prob=False, tie_word_embeddings=True, seed=23),
    "mixtral": ModelSpec(arch="mixtral", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, num_experts=4, num_experts_per_tok=2, seed=24),
    # MLA with q_lora_rank, interleaved rope; layer 0 dense, then 8 routed experts in 2 groups (top
    # group only), top-2, one shared expert, a random e_score_correction_bias (model_maker).
    "deepseek_v3": ModelSpec(arch="deepseek_v3", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=4,
                             intermediate_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                             q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                             n_group=2, topk_group=1, first_k_dense_replace=1, seed=25),
    # q_lora_rank null (q_proj), yarn with its mscale, rotate-half rope, 4 groups of which 2 are kept.
    "deepseek_v3_noq": ModelSpec(arch="deepseek_v3", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4,
                                 intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=64, q_lora_rank=0, rope_type="yarn", rope_interleave=False,
                                 n_group=4, topk_group=2, seed=26),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    made: dict[str, str] = {}
    root = tmp_path_factory.mktemp("families")

    def get(name: str) -> str:
        if name not in made:
            made[name] = make_model(str(root / name), SPECS[name])
        return made[name]

    return get


def greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]


def prompts_for(seed: int) -> list[list[int]]:
    return mixed_prompts(32000, seed=seed)[1::2]  # 2-230 tokens


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_matches_hf_batched_chunked_and_cached(family_dirs, name):
    model_dir = family_dirs(name)
    prompts = prompts_for(seed=len(name))
    # 64-token steps: the longer prompts prefill in several chunks, batched with the others.
    llm = LLM(model_dir, max_num_batched_tokens=64)
    cfg = llm.engine.model_config
    assert cfg.architecture == SPECS[name].arch
    assert cfg.qk_norm == name.startswith("qwen3")
    ref = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert greedy(llm, prompts) == ref
    # Again: each prompt's full blocks now come from the prefix cache.
    cached_before = llm.engine.stats.num_prompt_tokens_cached
    assert greedy(llm, prompts) == ref
    assert llm.engine.stats.num_prompt_tokens_cached - cached_before >= sum((len(p) - 1) // 16 * 16 for p in prompts)


def test_moe_config_is_read_as_hf_reads_it(family_dirs):
    moe = ModelConfig.from_dir(family_dirs("qwen3_moe")).moe
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (8, 2, 64, True)
    assert moe.dense_layers == {1} and not moe.weights_float32
    mixtral = ModelConfig.from_dir(family_dirs("mixtral"))
    assert mixtral.moe is not None and mixtral.moe.norm_topk_prob and mixtral.moe.weights_float32
    assert mixtral.moe.intermediate_size == 128 and not mixtral.qk_norm
    assert ModelConfig.from_dir(family_dirs("qwen3")).head_dim == 64


def _fuse(src: str, dst: str, block: str) -> None:
    """Rewrite a per-expert checkpoint into transformers 5's fused expert tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    n = raw.get("num_experts") or raw["num_local_experts"]
    names = ("w1", "w3", "w2") if block == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
    for layer in range(raw["num_hidden_layers"]):
        p = f"model.layers.{layer}.{block}."
        if f"{p}experts.0.{names[0]}.weight" not in tensors:
            continue
        g, u, d = ([tensors.pop(f"{p}experts.{e}.{w}.weight") for e in range(n)] for w in names)
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([a, b]) for a, b in zip(g, u)])
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(d)
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = tensors.pop(f"{p}gate.weight")
    save_file(tensors, os.path.join(dst, "model.safetensors"))


@pytest.mark.parametrize("name,block", [("qwen3_moe", "mlp"), ("mixtral", "block_sparse_moe")])
def test_fused_expert_checkpoints_load_like_per_expert_ones(family_dirs, tmp_path, name, block):
    src = family_dirs(name)
    assert any(".experts.0." in k for k in load_file(os.path.join(src, "model.safetensors")))  # the hub's form
    fused = str(tmp_path / "fused")
    _fuse(src, fused, block)
    prompts = prompts_for(seed=7)[:3]
    assert greedy(LLM(fused), prompts) == greedy(LLM(src), prompts)


def test_a_missing_expert_weight_is_named(family_dirs, tmp_path):
    broken = str(tmp_path / "broken")
    shutil.copytree(family_dirs("mixtral"), broken)
    path = os.path.join(broken, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, path)
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        LLM(broken)


@pytest.mark.skipif(not grouped_mm_available(), reason="this torch has no grouped_mm")
@pytest.mark.parametrize("name,sparse", [("qwen3_moe", 2), ("deepseek_v3_noq", 1)])
def test_the_grouped_gemm_path_gives_the_same_tokens(family_dirs, name, sparse):
    """The GPU path (engine/moe.py `grouped`) run on the CPU, with unpacked torch linears."""
    model_dir = family_dirs(name)
    prompts = prompts_for(seed=3)
    llm = LLM(model_dir, linear_backend="torch", max_num_batched_tokens=64)
    moes = [layer.moe for layer in llm.engine.runner.model.layers if layer.moe is not None]
    assert len(moes) == sparse and all(m.experts.path == "loop" for m in moes)
    for m in moes:
        assert m.experts.stack_for_grouped_mm()
        assert m.experts.path == "grouped"
        assert m.experts.gate_up[0].weight.data_ptr() == m.experts.w13.data_ptr()  # views: held once
    assert greedy(llm, prompts) == hf_greedy(model_dir, prompts, MAX_TOKENS)


def _raw(**over) -> dict:
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    raw.update(over)
    return {k: v for k, v in raw.items() if v is not None}


@pytest.mark.parametrize("over,word", [
    ({"num_experts_per_tok": None}, "num_experts_per_tok is missing"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size is missing"),
    ({"num_experts": None}, "num_experts is missing"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ({"num_experts": 0}, "num_experts=0"),
    ({"mlp_only_layers": [2]}, "mlp_only_layers=[2]"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
    ({"architectures": ["MixtralForCausalLM"], "num_experts": None}, "num_local_experts is missing"),
])
def test_bad_moe_configs_are_refused_naming_the_field(over, word):
    with pytest.raises(ConfigError, match=word.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_dict(_raw(**over), "m")


def test_qwen3_moe_dense_layers_follow_hfs_rule():
    # transformers 5's save_pretrained writes num_local_experts; decoder_sparse_step 2: odd layers sparse.
    cfg = ModelConfig.from_dict(_raw(num_experts=None, num_local_experts=4, num_hidden_layers=4,
                                     decoder_sparse_step=2, mlp_only_layers=[3]), "m")
    assert cfg.moe is not None and cfg.moe.num_experts == 4
    assert [cfg.moe.is_sparse(i) for i in range(4)] == [False, True, False, False]
    assert ModelConfig.from_dict(_raw(), "m").has_dense_mlp() is False


def test_tp_must_divide_each_experts_intermediate_size():
    check_tp(ModelConfig.from_dict(_raw(), "m"), 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 must divide the model's moe_intermediate_size=18"):
        check_tp(ModelConfig.from_dict(_raw(moe_intermediate_size=18), "m"), 4)


@needs_shm
@pytest.mark.parametrize("name,tp", [("qwen3", 2), ("qwen3_moe", 2), ("mixtral", 2), ("deepseek_v3", 2),
                                     ("qwen3_moe", 4), ("deepseek_v3", 4)])
def test_tp_greedy_equals_tp1_and_hf(family_dirs, name, tp):
    """TP=2 for every family, TP=4 for a mixture-of-experts model and the MLA one (the KV
    heads replicated where there are fewer than ranks; the latent on every rank)."""
    model_dir = family_dirs(name)
    prompts = prompts_for(seed=2)
    # tensor-parallel experts (the CPU's default for MoE models is expert parallel: next test)
    with LLM(model_dir, max_num_batched_tokens=64, tensor_parallel_size=tp, enable_expert_parallel=False) as llm:
        if llm.engine.model_config.moe is not None:
            assert not llm.engine.runner.expert_parallel and len(llm.engine.runner.shard.experts) > 1
        got = greedy(llm, prompts)
        again = greedy(llm, prompts)  # prefix-cache hits
    ref = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert got == ref
    assert again == ref
    assert greedy(LLM(model_dir, max_num_batched_tokens=64), prompts) == ref


@needs_shm
@pytest.mark.parametrize("name,tp", [("qwen3_moe", 2), ("mixtral", 2), ("deepseek_v3", 2)])
def test_expert_parallel_greedy_equals_hf(family_dirs, name, tp):
    """Expert parallel (enable_expert_parallel; the CPU's default where tp divides the experts):
    each rank holds 1/tp of the routed experts whole (DeepSeek's shared expert stays split by
    rows); the output is HF's, with and without prefix-cache hits."""
    model_dir = family_dirs(name)
    prompts = prompts_for(seed=2)
    with LLM(model_dir, max_num_batched_tokens=64, tensor_parallel_size=tp) as llm:  # the CPU's default
        runner = llm.engine.runner
        assert runner.expert_parallel
        cfg = runner.model_cfg
        per = cfg.moe.num_experts // tp
        assert runner.shard.experts == range(0, per) and len(runner.shard.moe_inter) == cfg.moe.intermediate_size
        moe = next(layer.moe for layer in runner.model.layers if layer.moe is not None)
        assert len(moe.experts.gate_up) == per
        got = greedy(llm, prompts)
        again = greedy(llm, prompts)
    ref = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert got == ref and again == ref


def test_expert_parallel_needs_the_ranks_to_divide_the_experts(family_dirs):
    cfg = ModelConfig.from_dict(_raw(num_experts=6, moe_intermediate_size=18), "m")
    with pytest.raises(ConfigError, match="enable_expert_parallel: tensor_parallel_size=4 must divide the model's 6"):
        check_tp(cfg, 4, expert_parallel=True)
    check_tp(cfg, 2, expert_parallel=True)  # 6 experts over 2 ranks; 18 rows need not split
    with pytest.raises(ConfigError, match="moe_intermediate_size=18"):
        check_tp(cfg, 4)
    with pytest.raises(ConfigError, match="enable_expert_parallel"):
        EngineConfig.from_kwargs(family_dirs("mixtral"), enable_expert_parallel="yes")
    # the default: expert parallel on the CPU where the ranks divide the experts, else tensor-parallel
    assert expert_parallel(cfg, 2, None, "cpu") and not expert_parallel(cfg, 4, None, "cpu")
    assert not expert_parallel(cfg, 2, None, "cuda") and expert_parallel(cfg, 4, True, "cuda")
    assert not expert_parallel(cfg, 1, None, "cpu") and not expert_parallel(cfg, 2, False, "cpu")


def test_make_model_cli_writes_each_family(tmp_path):
    parser = argparse.ArgumentParser()
    engine_cli.register(parser.add_subparsers())
    small = ["--layers", "3", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--intermediate", "64"]
    args = parser.parse_args(["make-model", str(tmp_path / "moe"), "--family", "qwen3_moe", *small, "--experts", "3",
                              "--experts-per-tok", "1", "--moe-intermediate", "32", "--no-norm-topk-prob",
                              "--mlp-only-layers", "0,2", "--head-dim", "16"])
    assert args.func(args) == 0
    cfg = ModelConfig.from_dir(str(tmp_path / "moe"))
    assert (cfg.architecture, cfg.head_dim, cfg.qk_norm) == ("qwen3_moe", 16, True)
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (3, 1, 32)
    assert cfg.moe.norm_topk_prob is False and cfg.moe.dense_layers == {0, 2}
    args = parser.parse_args(["make-model", str(tmp_path / "ds"), "--family", "deepseek_v3", *small, "--experts", "4",
                              "--q-lora-rank", "0", "--kv-lora-rank", "32", "--qk-nope-head-dim", "24",
                              "--qk-rope-head-dim", "8", "--v-head-dim", "20"])
    assert args.func(args) == 0
    cfg = ModelConfig.from_dir(str(tmp_path / "ds"))
    assert cfg.architecture == "deepseek_v3" and cfg.mla is not None and cfg.mla.q_lora_rank is None
    assert (cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim) == (24, 8, 20)
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 32 + 8)
    with open(tmp_path / "ds" / "config.json") as f:
        raw = json.load(f)
    assert (raw["topk_method"], raw["scoring_func"]) == ("noaux_tc", "sigmoid")  # DeepSeek-V3's own values
    args = parser.parse_args(["make-model", str(tmp_path / "llama"), "--arch", "llama", *small])  # the old flag
    assert args.func(args) == 0
    assert ModelConfig.from_dir(str(tmp_path / "llama")).architecture == "llama"
    with pytest.raises(SystemExit):
        parser.parse_args(["make-model", str(tmp_path / "x"), "--family", "gpt2"])


def test_deepseek_config_is_read_as_hf_reads_it(family_dirs):
    cfg = ModelConfig.from_dir(family_dirs("deepseek_v3"))
    assert cfg.mla is not None and cfg.moe is not None
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim,
            cfg.mla.v_head_dim, cfg.mla.rope_interleave) == (64, 64, 32, 16, 32, True)
    assert cfg.softmax_scale == (32 + 16) ** -0.5 and cfg.rope_dim == 16
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 64 + 16)  # the pool's one latent head
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group, moe.n_shared_experts) == (8, 2, 2, 1, 1)
    assert moe.scoring == "sigmoid" and moe.routed_scaling_factor == 2.5 and moe.dense_layers == {0}
    noq = ModelConfig.from_dir(family_dirs("deepseek_v3_noq"))
    assert noq.mla is not None and noq.mla.q_lora_rank is None and not noq.mla.rope_interleave
    assert noq.rope.rope_type == "yarn" and noq.rope.factor == 4.0
    m = 0.1 * 0.8 * math.log(4.0) + 1.0  # HF's yarn_get_mscale(factor, mscale_all_dim), squared into the scale
    assert noq.softmax_scale == pytest.approx((32 + 16) ** -0.5 * m * m, rel=1e-12)


def test_deepseek_pool_holds_one_latent_head_per_token(family_dirs):
    """K = [c_kv, k_pe], V = [c_kv, 0] in one KV head of kv_lora_rank + qk_rope_head_dim."""
    llm = LLM(family_dirs("deepseek_v3"), max_num_batched_tokens=64)
    runner = llm.engine.runner
    layers, blocks, two, block_size, heads, dim = runner.kv_cache.shape  # NHD
    assert (layers, two, heads, dim) == (4, 2, 1, 64 + 16)
    assert runner.block_bytes == 2 * block_size * (64 + 16) * 4  # float32
    info = runner.layout_info()
    assert (info["num_kv_heads"], info["head_dim"]) == (1, 80)
    prompt = prompts_for(seed=1)[0]
    greedy(llm, [prompt])
    k, v = runner.kv_cache[:, :, 0], runner.kv_cache[:, :, 1]  # [layers, blocks, block_size, 1, 80]
    written = k.abs().sum(dim=(0, 3, 4)) > 0  # [blocks, block_size]: slots some token wrote
    assert int(written.sum()) >= len(prompt)
    assert torch.equal(v[..., :64][:, written], k[..., :64][:, written])  # the latent, once per half
    assert not v[..., 64:][:, written].any() and k[..., 64:][:, written].any()  # rope part: K's only


def test_deepseek_fp8_latent_pool_reads_the_same_on_the_native_kernel_and_the_torch_path(family_dirs):
    """FP8 KV on the latent pool with computed scales: one KV head, so one scale per layer and half;
    the native kernel's float8 variant (engine/native.py) generates the torch path's tokens."""
    args = {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True, "max_num_batched_tokens": 64}
    fast = LLM(family_dirs("deepseek_v3_noq"), attention_backend="native", **args)
    slow = LLM(family_dirs("deepseek_v3_noq"), attention_backend="torch", **args)
    scales = fast.engine.runner.layout_info()["kv_scales"]
    assert len(scales) == 2 and all(isinstance(x, float) and x != 1.0 for layer in scales for x in layer)
    assert scales == slow.engine.runner.layout_info()["kv_scales"]
    ps = prompts_for(seed=4)
    assert greedy(fast, ps) == greedy(slow, ps)


@pytest.mark.parametrize("over,word", [
    ({"n_group": 3}, "n_group=3"),
    ({"topk_group": 3}, "topk_group=3 .* exceeds n_group=2"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7"),
    ({"kv_lora_rank": 0}, "kv_lora_rank=0"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"rope_interleave": "yes"}, "rope_interleave='yes'"),
])
def test_bad_deepseek_configs_are_refused_naming_the_field(over, word):
    raw = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 100, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 16,
           "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}
    ModelConfig.from_dict(raw, "m")  # the base is valid
    with pytest.raises(ConfigError, match=word):
        ModelConfig.from_dict({**raw, **over}, "m")


def test_yarn_is_refused_outside_deepseek():
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        ModelConfig.from_dict(_raw(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "m")


def test_lora_is_refused_on_deepseek(family_dirs):
    with pytest.raises(ConfigError, match="enable_lora"):
        LLM(family_dirs("deepseek_v3_noq"), enable_lora=True)
