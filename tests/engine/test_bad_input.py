"""Bad input raises ValueError subclasses naming the field; nothing crashes or leaks."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=256)


@pytest.mark.parametrize("prompt, params, field", [
    ("", SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    ([5] * 256, SamplingParams(), "prompt"),
    ([5, 10**9], SamplingParams(), "prompt_token_ids"),
    ([5, -1], SamplingParams(), "prompt_token_ids"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("hi", SamplingParams(temperature=-0.5), "temperature"),
    ("hi", SamplingParams(top_p=0.0), "top_p"),
    ("hi", SamplingParams(top_p=1.5), "top_p"),
    ("hi", SamplingParams(top_k=-3), "top_k"),
    ("hi", SamplingParams(repetition_penalty=0), "repetition_penalty"),
    ("hi", SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
])
def test_invalid_request_names_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params)
    eng = llm.engine
    assert not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_one_bad_prompt_rejects_the_batch_before_any_work(llm):
    steps_before = llm.engine.stats.num_steps
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.requests
    assert llm.engine.stats.num_steps == steps_before
    assert llm.generate(["fine"], SamplingParams(max_tokens=2))[0].finish_reason is not None


def test_unknown_model_directory(tmp_path):
    with pytest.raises(ValueError, match="model="):
        LLM(str(tmp_path / "missing"))


def test_unsupported_architecture(tmp_path, llama_dir):
    d = tmp_path / "gpt"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures"):
        LLM(str(d))


def test_unknown_engine_argument(llama_dir):
    with pytest.raises(ValueError, match="block_sise"):
        LLM(llama_dir, block_sise=16)


def test_kv_pool_smaller_than_max_model_len(llama_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, num_gpu_blocks_override=2, max_model_len=512)
