"""Greedy output is token-identical to HF transformers on the same directory."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

MAX_TOKENS = 24


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Ten prompts from 1 to 230 tokens; several span many 16-token blocks."""
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 64, 100, 161, 230]
    # Token ids from the normal vocabulary range (skip the 3 special ids).
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    hf.eval()
    outs = []
    for ids in prompts:  # one at a time: no padding in the reference
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "default"])
def test_greedy_matches_hf_generate(model_dirs, name):
    model_dir = model_dirs(name)
    llm = LLM(model_dir, max_num_batched_tokens=256)
    prompts = mixed_prompts(llm.engine.model_config.vocab_size)
    if name == "default":
        prompts = prompts[::2]  # the ~34M model is slower under HF; five prompts suffice
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    ref = hf_greedy(model_dir, prompts, MAX_TOKENS)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r, f"prompt {i} (len {len(prompts[i])}) diverged from HF"
        assert o.finish_reason in ("stop", "length")


def test_text_prompt_tokenizes_with_bos_and_matches_hf(llama_dir):
    llm = LLM(llama_dir)
    prompt = "The quick brown fox jumps over the lazy dog"
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.prompt_token_ids[0] == 1  # BOS
    assert out.token_ids == hf_greedy(llama_dir, [out.prompt_token_ids], 12)[0]
    assert out.text == llm.tokenizer.decode(
        out.prompt_token_ids[-6:] + out.token_ids)[len(llm.tokenizer.decode(out.prompt_token_ids[-6:])):]


@pytest.mark.parametrize("tie", [True, False])
def test_made_on_a_device_loads_in_hf_and_matches(tmp_path, tie):
    """make_model(init_device=...) (the GPU benchmarks' fast path for the 8B shape): HF loads
    its shards through their index with no missing or unexpected weight, and greedy output
    matches HF's on it."""
    import json
    import os

    from transformers import AutoModelForCausalLM

    from pdserve.engine.model_maker import ModelSpec, _fill_on_device, make_model

    spec = ModelSpec(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
                     tie_word_embeddings=tie, initializer_range=0.2)
    d = str(tmp_path / "m")
    make_model(d, spec, init_device="cpu")
    assert os.listdir(d).count("model.safetensors") == 1
    # the same again in shards of ~1 MiB: several files and HF's index naming each weight's file
    sharded = str(tmp_path / "sharded")
    os.makedirs(sharded)
    make_model(sharded, spec)  # tokenizer and config; its HF-init weights are replaced below
    os.remove(os.path.join(sharded, "model.safetensors"))
    common = json.load(open(os.path.join(d, "config.json")))
    _fill_on_device(sharded, spec, AutoModelForCausalLM.from_pretrained(d).config, "cpu", shard_bytes=1 << 20)
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    for path in (d, sharded):
        hf, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        assert not any(info.values()), info
        assert ("lm_head.weight" in index["weight_map"]) is not tie
    assert common["architectures"] == ["LlamaForCausalLM"] and common["dtype"] == "float32"
    prompts = mixed_prompts(spec.vocab_size)[:4]
    for path in (d, sharded):
        outs = LLM(path, max_num_batched_tokens=256).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
        assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 8)
