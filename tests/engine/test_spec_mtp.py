"""Speculative decoding with DeepSeek-V3's MTP layer (``method: mtp``; engine/spec_mtp_model.py,
run by EAGLE's proposer, engine/spec_eagle.py; docs/speculative.md, "MTP").

The MTP layer is written here into a copy of the test DeepSeek-V3 model (latent attention, a
mixture-of-experts MLP) under the names DeepSeek-V3's checkpoints use, ``model.layers.{L}.*``
after the model's L layers, with ``num_nextn_predict_layers: 1`` in config.json. Its block is
the model's sparse layer 1 renamed: a random layer (its ``eh_proj`` and norms random) proposes
tokens the target rarely agrees with, so with it the tests check exactness and that proposals
were made and verified. A "copy" layer has its attention's ``o_proj`` and every expert's (and
the shared expert's) ``down_proj`` zero, so the block passes its input through, and ``eh_proj``
selecting the hidden half: its logits are the LM head of the target's own final hidden state
(normalised again, a positive multiple of it), so each proposal is the target's argmax at the
request's last computed position, i.e. the last token again: right only when the layer reads
the target's hidden state of the right position; the target's greedy output repeats tokens, so
proposals are accepted and rejected (both models' KV rolled back).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ConfigError
from pdserve.engine.spec_config import parse_speculative_config

from .test_model_families import family_dirs  # noqa: F401  (the fixture)
from .test_spec_decode import prompts, run
from .test_spec_eagle import pools_full, proposals_seen

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_mtp(out: str, target_dir: str, copy: bool, seed: int = 0, layers: int = 1) -> str:
    """A copy of the target's directory with an MTP layer after its own layers (the weights in a
    second safetensors file, config.json saying ``num_nextn_predict_layers``)."""
    shutil.copytree(target_dir, out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    n = cfg["num_hidden_layers"]
    cfg["num_nextn_predict_layers"] = layers
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    target = load_file(os.path.join(target_dir, "model.safetensors"))
    h = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    p = f"model.layers.{n}."
    weights = {}
    for name, t in target.items():
        if name.startswith("model.layers.1."):  # (a sparse layer: layer 0 is dense)
            new = p + name[len("model.layers.1."):]
            zero = copy and (name.endswith("self_attn.o_proj.weight") or name.endswith("down_proj.weight"))
            weights[new] = torch.zeros_like(t) if zero else t.clone()
    if copy:
        eh_proj = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
        norms = {x: torch.ones(h) for x in ("enorm", "hnorm", "shared_head.norm")}
    else:
        eh_proj = 0.05 * torch.randn(h, 2 * h, generator=gen)
        norms = {x: 1 + 0.05 * torch.randn(h, generator=gen) for x in ("enorm", "hnorm", "shared_head.norm")}
    weights.update({p + "eh_proj.weight": eh_proj, p + "embed_tokens.weight": target["model.embed_tokens.weight"],
                    p + "shared_head.head.weight": target["lm_head.weight"]})
    weights.update({p + x + ".weight": w for x, w in norms.items()})
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "mtp.safetensors"),
              metadata={"format": "pt"})
    return out


def mtp_cfg(k: int = 3, **extra) -> dict:
    """Every step speculates (no acceptance floor, no measured-cost rule: test_spec_cost.py tests it)."""
    return {"method": "mtp", "num_speculative_tokens": k, "acceptance_floor": 0.0, "disable_by_cost": False, **extra}


@pytest.fixture(scope="module")
def deepseek(family_dirs):  # noqa: F811
    return family_dirs("deepseek_v3")


@pytest.fixture(scope="module")
def mtp_dirs(deepseek, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mtp")
    return {"random": make_mtp(str(root / "random"), deepseek, copy=False),
            "copy": make_mtp(str(root / "copy"), deepseek, copy=True)}


@pytest.fixture(scope="module")
def plain(deepseek):
    with LLM(deepseek, seed=0) as llm:
        yield llm


def test_a_random_mtp_layer_proposes_and_output_is_exact(plain, mtp_dirs):
    """Greedy and seeded sampling equal the engine without speculation; the model's own directory
    is the default ``model``; proposals are made and verified; every block of both pools back."""
    ps = prompts(6, seed=4)
    seeded = [SamplingParams(max_tokens=16, temperature=t, seed=50 + i, ignore_eos=True)
              for i, t in enumerate([0.05, 0.7, 1.0] * 2)]
    with LLM(mtp_dirs["random"], seed=0, speculative_config=mtp_cfg()) as llm:
        head = llm.engine.spec.draft
        assert head.hc.method == "mtp" and head.hc.model.path == mtp_dirs["random"]
        assert run(llm, ps, GREEDY) == run(plain, ps, GREEDY)
        assert llm.engine.stats.num_spec_draft_tokens > 60 and head.num_forwards > 0
        assert run(llm, ps, seeded) == run(plain, ps, seeded)
        assert pools_full(llm)


def test_the_copy_layer_reads_the_right_hidden_states(plain, mtp_dirs):
    """Every proposal is the request's last token again (the target's argmax at its last computed
    position, through the layer's latent attention and experts passing their input on); some
    accepted, some rejected; output equal to the engine without speculation, also with a small
    pool (preemptions), chunked prompts and a prefix cache hit."""
    ps = prompts(8, seed=6)
    want = run(plain, ps, GREEDY)
    with LLM(mtp_dirs["copy"], seed=0, speculative_config=mtp_cfg(k=4)) as llm:
        stats = llm.engine.stats
        with proposals_seen(llm) as seen:
            assert run(llm, ps, GREEDY) == want
        assert len(seen) > 30 and all(props == [last] * len(props) for last, props in seen), seen[:5]
        proposed, accepted = stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens
        assert 0.1 * proposed < accepted < proposed, (accepted, proposed)
        assert pools_full(llm)
    with LLM(mtp_dirs["copy"], seed=0, speculative_config=mtp_cfg(k=4, draft_kv_cache_fraction=0.5),
             max_num_batched_tokens=24, block_size=4, num_gpu_blocks_override=48) as llm:
        assert run(llm, ps, GREEDY) == want
        s = llm.engine.stats
        assert s.num_preemptions > 0 and s.num_spec_accepted_tokens > 0
        assert run(llm, ps[:1], GREEDY) == want[:1]
        computed, longer = s.num_prompt_tokens_computed, [ps[0] + [5, 6, 7]]
        assert run(llm, longer, GREEDY) == run(plain, longer, GREEDY)
        assert s.num_prompt_tokens_computed - computed < len(longer[0])  # (a prefix cache hit)
        assert pools_full(llm)


def test_mtp_is_refused_where_there_is_no_layer_naming_the_field(deepseek, mtp_dirs, family_dirs, tmp_path):  # noqa: F811
    assert parse_speculative_config({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"
    with pytest.raises(ConfigError, match=r"speculative_config\.model=.*num_nextn_predict_layers=0"):
        LLM(deepseek, speculative_config=mtp_cfg())  # (the test model has none)
    with pytest.raises(ConfigError, match=r"speculative_config\.method='mtp': the target model is qwen3"):
        LLM(family_dirs("qwen3"), speculative_config=mtp_cfg(model=mtp_dirs["random"]))
    with pytest.raises(ConfigError, match=r"speculative_config\.model=.*no such directory"):
        parse_speculative_config(mtp_cfg(model=str(tmp_path / "nowhere")))
    # A layer promised by config.json but a weight of it missing: refused when the head loads.
    short = make_mtp(str(tmp_path / "short"), deepseek, copy=False)
    weights = load_file(os.path.join(short, "mtp.safetensors"))
    del weights["model.layers.4.eh_proj.weight"]
    save_file(weights, os.path.join(short, "mtp.safetensors"))
    with pytest.raises(ConfigError, match=r"speculative_config\.model=.*'model\.layers\.4\.eh_proj\.weight' is missing"):
        LLM(short, speculative_config=mtp_cfg())
