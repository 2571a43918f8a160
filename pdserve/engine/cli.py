"""`pdserve make-model` and `pdserve generate`."""

from __future__ import annotations

import argparse
import sys
import time

from .model_maker import FAMILIES


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write a small random-weight model with a real tokenizer",
        description=(
            "Write a small random-weight model of one family (Llama, Mistral, Qwen2, Qwen3, "
            "Qwen3-MoE, Mixtral, DeepSeek-V3: config.json, "
            "model.safetensors) with the Mistral SentencePiece tokenizer converted to "
            "tokenizer.json. Deterministic from --seed. Useful for tests, demos and "
            "benchmarks on machines without a model hub."
        ),
    )
    p.add_argument("dir", help="output directory (created if missing)")
    p.add_argument("--family", "--arch", dest="arch", choices=FAMILIES, default="llama",
                   help="model family (default llama)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (default 6)")
    p.add_argument("--hidden", type=int, default=384, help="hidden size (default 384)")
    p.add_argument("--heads", type=int, default=6, help="attention heads (default 6)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads, GQA when < heads (default 2)")
    p.add_argument("--intermediate", type=int, default=1024, help="MLP size (default 1024)")
    p.add_argument("--vocab", type=int, default=32000, help="vocab size, >= 32000 (the tokenizer's)")
    p.add_argument("--max-position", type=int, default=4096, help="max_position_embeddings")
    p.add_argument("--tie-embeddings", action="store_true", help="tie lm_head to the embedding")
    p.add_argument("--rope-type", choices=["default", "llama3", "yarn"], default="default",
                   help="yarn: deepseek_v3 only")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="dtype of the saved weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head-dim", type=int, default=0,
                   help="qwen3, qwen3_moe, mixtral: head dim (default hidden / heads)")
    p.add_argument("--experts", type=int, default=4, help="qwen3_moe, mixtral: experts per layer (default 4)")
    p.add_argument("--experts-per-tok", type=int, default=2, help="qwen3_moe, mixtral: top-k (default 2)")
    p.add_argument("--moe-intermediate", type=int, default=128,
                   help="qwen3_moe: each expert's MLP size (default 128; mixtral's is --intermediate)")
    p.add_argument("--no-norm-topk-prob", dest="norm_topk_prob", action="store_false",
                   help="qwen3_moe: do not renormalise the top-k routing weights")
    p.add_argument("--mlp-only-layers", type=_layer_list, default=(),
                   help="qwen3_moe: comma-separated dense layers, e.g. 0,3")
    p.add_argument("--q-lora-rank", type=int, default=64,
                   help="deepseek_v3: query compression rank (0: none, q_proj; default 64)")
    p.add_argument("--kv-lora-rank", type=int, default=64, help="deepseek_v3: the KV latent's rank (default 64)")
    p.add_argument("--qk-nope-head-dim", type=int, default=32,
                   help="deepseek_v3: each head's query/key part without rope (default 32; DeepSeek-V3: 128)")
    p.add_argument("--qk-rope-head-dim", type=int, default=16,
                   help="deepseek_v3: the rope part shared by the heads' keys (default 16; DeepSeek-V3: 64)")
    p.add_argument("--v-head-dim", type=int, default=32, help="deepseek_v3: each head's value size (default 32; "
                   "DeepSeek-V3: 128)")
    p.set_defaults(func=_make_model)

    g = subparsers.add_parser(
        "generate",
        help="generate a completion offline with the engine",
        description="Load a local model directory and print completions of the given prompts.",
    )
    g.add_argument("prompts", nargs="+", help="one or more prompts (text)")
    g.add_argument("--model", required=True, help="local Hugging Face model directory")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--ids", action="store_true", help="also print the generated token ids")
    g.set_defaults(func=_generate)


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(i) for i in text.split(",") if i.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices") from None


def _make_model(args: argparse.Namespace) -> int:
    from .model_maker import ModelSpec, make_model

    spec = ModelSpec(
        arch=args.arch, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
        num_kv_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=args.max_position, tie_word_embeddings=args.tie_embeddings,
        rope_type=args.rope_type, seed=args.seed, dtype=args.dtype, head_dim=args.head_dim,
        num_experts=args.experts, num_experts_per_tok=args.experts_per_tok,
        moe_intermediate_size=args.moe_intermediate, norm_topk_prob=args.norm_topk_prob,
        mlp_only_layers=args.mlp_only_layers, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
    )
    t0 = time.perf_counter()
    print(f"making a {spec.arch} model in {args.dir} ...", file=sys.stderr)
    make_model(args.dir, spec)
    print(f"wrote {args.dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from . import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos, stop=args.stop,
    )
    t0 = time.perf_counter()
    outs = llm.generate(args.prompts, params)
    dt = time.perf_counter() - t0
    for prompt, out in zip(args.prompts, outs):
        print(f"{prompt}{out.text}")
        if args.ids:
            print(f"  token_ids={out.token_ids}")
        print(f"  [{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    n = sum(len(o.token_ids) for o in outs)
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)", file=sys.stderr)
    return 0
