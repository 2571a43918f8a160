"""EAGLE heads written in their published checkpoints' layout for a given target (vLLM's
``llama_eagle.py`` and ``llama_eagle3.py`` read the same names): random ones, for benchmarks of
what a head costs (bench/spec_pd.py) and tests of the proposer's mechanics, and "copy" ones, whose
output is the target's own hidden state (tests/engine/test_spec_eagle.py says what that checks).
A random head proposes tokens the target rarely agrees with: no acceptance figure comes of it.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file


def target_config(target_dir: str) -> dict:
    """The target's config.json."""
    with open(os.path.join(target_dir, "config.json")) as f:
        return json.load(f)


def _layer(prefix: str, t: dict, hidden: int, q_in: int, gen: torch.Generator, copy: bool) -> dict:
    """A Llama layer's weights in HF names (q/k/v over ``q_in`` inputs); ``copy``: its attention
    and MLP outputs are zero (the layer passes its input through)."""
    heads, kv, inter = t["num_attention_heads"], t["num_key_value_heads"], t["intermediate_size"]
    hd = hidden // heads

    def rnd(*shape):
        return 0.05 * torch.randn(*shape, generator=gen)

    return {
        prefix + "self_attn.q_proj.weight": rnd(heads * hd, q_in),
        prefix + "self_attn.k_proj.weight": rnd(kv * hd, q_in),
        prefix + "self_attn.v_proj.weight": rnd(kv * hd, q_in),
        prefix + "self_attn.o_proj.weight": torch.zeros(hidden, heads * hd) if copy else rnd(hidden, heads * hd),
        prefix + "mlp.gate_proj.weight": rnd(inter, hidden),
        prefix + "mlp.up_proj.weight": rnd(inter, hidden),
        prefix + "mlp.down_proj.weight": torch.zeros(hidden, inter) if copy else rnd(hidden, inter),
        prefix + "post_attention_layernorm.weight": 1 + rnd(hidden),
    }


def make_eagle1(out: str, target_dir: str, copy: bool = False, hidden: int | None = None, seed: int = 0) -> str:
    """An EAGLE-1 head: a 1-layer Llama config, ``fc`` [hidden, 2 hidden], ``layers.0.*``
    without input_layernorm; embed_tokens and lm_head left to the target's."""
    t = target_config(target_dir)
    h = hidden or t["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    os.makedirs(out, exist_ok=True)
    cfg = {**t, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": h}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    fc = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1) if copy else 0.05 * torch.randn(h, 2 * h, generator=gen)
    weights = {"fc.weight": fc, **_layer("layers.0.", t, h, h, gen, copy)}
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    return out


def make_eagle3(out: str, target_dir: str, draft_ids: list[int], copy: bool = False, seed: int = 0) -> str:
    """An EAGLE-3 head: ``fc`` over three target hidden states, ``midlayer.*`` whose q/k/v read
    2 x hidden, ``norm``, its own ``lm_head`` over a draft vocabulary (draft id i is target id
    ``draft_ids[i]``), ``d2t`` (draft id -> target id - draft id) and ``t2d``. Random: vLLM's
    default aux layers (2, L // 2, L - 3) = (0, 1, 2) for the 3-layer target. Copy: aux layers
    [3, 0, 1] (read sorted), ``fc`` selecting the third (the last layer's output before the final
    norm), the target's final norm and the LM head rows of the draft ids."""
    t = target_config(target_dir)
    h = t["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    os.makedirs(out, exist_ok=True)
    cfg = {**t, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
           "draft_vocab_size": len(draft_ids)}
    if copy:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [3, 0, 1]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    target = load_file(os.path.join(target_dir, "model.safetensors"))
    to_target = torch.tensor(draft_ids)
    t2d = torch.zeros(t["vocab_size"], dtype=torch.bool)
    t2d[to_target] = True
    if copy:
        fc = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1)
        norm, lm_head = target["model.norm.weight"], target["lm_head.weight"][to_target]
    else:
        fc = 0.05 * torch.randn(h, 3 * h, generator=gen)
        norm, lm_head = 1 + 0.05 * torch.randn(h, generator=gen), 0.05 * torch.randn(len(draft_ids), h, generator=gen)
    weights = {
        "fc.weight": fc, "norm.weight": norm, "lm_head.weight": lm_head,
        "d2t": to_target - torch.arange(len(draft_ids)), "t2d": t2d,
        "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
        **_layer("midlayer.", t, h, 2 * h, gen, copy),
    }
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    return out
