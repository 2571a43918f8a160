"""FP8 KV cache against the model's dtype: greedy agreement and next-token KL.

Two engines on one model, ``kv_cache_dtype=auto`` (the reference) and each FP8 format asked;
N random prompts. Reports, per format:

- greedy agreement: the prompts whose greedy continuation (``--max-tokens``) is token for token
  the reference's, and the mean fraction of generated tokens equal up to the first difference;
- next-token KL: the mean over prompts of KL(reference || fp8) of the distribution of the
  first generated token (the prompt's last position, whose attention read every layer's
  FP8 K/V), from the full logits of the step (read off `ModelRunner.execute`);
- the pool's KV bytes per token of each;

for each way of setting the scales (``--scales``): ``checkpoint`` (the checkpoint's, 1.0 where it
has none), ``head`` (computed at start, per KV head: ``calculate_kv_scales``) and ``tensor``
(computed, per tensor).

``--kv-gain G`` runs the same function on K and V ``G`` times larger: a copy of the model with
``k_proj`` and ``v_proj`` multiplied by G and ``q_proj`` and ``o_proj`` divided by it (attention
scores and outputs unchanged, up to rounding), for K/V beyond float8's range (G = 1000) or in its
subnormals (G = 0.001), where the scales matter.

A table, not a threshold: docs/kv_cache.md says what it measured, with the command.

    python bench/fp8_kv.py                       # the default tiny model under .cache/, 20 prompts
    python bench/fp8_kv.py --model DIR --prompts 200 --dtype bfloat16 --device cuda
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="model dir (default: make the default tiny model under .cache/)")
    p.add_argument("--prompts", type=int, default=20, help="number of random prompts")
    p.add_argument("--prompt-len", default="16-128", help="prompt lengths, lo-hi tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--formats", default="fp8_e4m3,fp8_e5m2", help="kv_cache_dtype values, comma-separated")
    p.add_argument("--scales", default="checkpoint,head,tensor",
                   help="FP8 scales, comma-separated: checkpoint (1.0 without checkpoint scales), head or tensor "
                        "(computed at start: calculate_kv_scales with that kv_scale_granularity)")
    p.add_argument("--kv-gain", type=float, default=1.0,
                   help="run an equivalent model whose K and V are this many times larger (see above)")
    p.add_argument("--dtype", default="auto", help="the model's dtype (engine arg dtype)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.lo, args.hi = (int(x) for x in args.prompt_len.split("-"))
    except ValueError:
        p.error(f"--prompt-len: expected lo-hi, got {args.prompt_len!r}")
    args.scales = args.scales.split(",")
    if not set(args.scales) <= {"checkpoint", "head", "tensor"}:
        p.error(f"--scales: use checkpoint, head and/or tensor, got {args.scales}")
    if args.prompts < 1 or args.max_tokens < 1 or not 1 <= args.lo <= args.hi:
        p.error("--prompts and --max-tokens must be >= 1, and --prompt-len 1 <= lo <= hi")
    return args


def first_token_logprobs(eng, prompts: list[list[int]]) -> list:
    """The log-softmax of each prompt's first-token logits (float32, on the host)."""
    import torch

    from pdserve.engine import SamplingParams

    runner, seen = eng.runner, []
    execute = runner.execute

    def recording(*a, **kw):
        logits, batch = execute(*a, **kw)
        seen.append(logits)
        return logits, batch

    runner.execute = recording
    out = []
    try:
        for i, p in enumerate(prompts):
            seen.clear()
            eng.add_request(p, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"kl{i}")
            while eng.has_work():
                eng.step()
            eng.release(f"kl{i}")
            out.append(torch.log_softmax(seen[0][0].float().cpu(), dim=-1))
    finally:
        runner.execute = execute
    return out


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """Fraction of sequences equal, and mean fraction of tokens equal up to the first difference."""
    same = sum(a == b for a, b in zip(ref, got))
    prefix = []
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(a), 1))
    return same / len(ref), sum(prefix) / len(prefix)


def gained_model(model: str, gain: float) -> str:
    """A copy of ``model`` under .cache/ computing the same function with K and V ``gain`` times
    larger (Llama-form attention: no q/k norms, no biases)."""
    import glob
    import shutil

    from safetensors.torch import load_file, save_file

    out = os.path.join(os.path.dirname(os.path.abspath(model)), f"{os.path.basename(os.path.abspath(model))}-kvgain{gain:g}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    factor = {"q_proj.weight": 1 / gain, "k_proj.weight": gain, "v_proj.weight": gain, "o_proj.weight": 1 / gain}
    for path in glob.glob(os.path.join(model, "*")):
        if not path.endswith(".safetensors"):
            shutil.copy(path, out)
            continue
        tensors = load_file(path)
        for name, t in tensors.items():
            if ".self_attn." in name and not any(name.endswith(k) for k in factor):
                raise SystemExit(f"--kv-gain: {name} is not a Llama-form attention weight; use a Llama model")
            for suffix, f in factor.items():
                if name.endswith("self_attn." + suffix):
                    tensors[name] = (t.double() * f).to(t.dtype)
        save_file(tensors, os.path.join(out, os.path.basename(path)), metadata={"format": "pt"})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.engine import LLM, SamplingParams

    if args.model is None:
        from engine_throughput import default_model

        args.model = default_model()
    if args.kv_gain != 1.0:
        args.model = gained_model(args.model, args.kv_gain)
    rng = random.Random(args.seed)
    common = {"dtype": args.dtype, "device": args.device}
    ref_llm = LLM(args.model, **common)
    vocab = ref_llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.lo, args.hi))] for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    ref = [o.token_ids for o in ref_llm.generate(prompts, params)]
    ref_lp = first_token_logprobs(ref_llm.engine, prompts)
    ref_bytes = ref_llm.engine.connector.kv_bytes_per_token
    ref_llm.close()
    print(f"model {args.model} (K/V x{args.kv_gain:g}), {args.prompts} prompts of {args.lo}-{args.hi} tokens, {args.max_tokens} greedy "
          f"tokens each, dtype {args.dtype}, device {args.device}")
    print("| kv_cache_dtype | scales | KV bytes/token | greedy sequences equal | mean matching prefix | "
          "mean next-token KL (nats) | max KL |")
    print("|---|---|---|---|---|---|---|")
    print(f"| auto | - | {ref_bytes} | 1.000 | 1.000 | 0 | 0 |")
    for fmt in args.formats.split(","):
        for scales in args.scales:
            kw = {} if scales == "checkpoint" else {"calculate_kv_scales": True, "kv_scale_granularity": scales}
            llm = LLM(args.model, kv_cache_dtype=fmt, **kw, **common)
            got = [o.token_ids for o in llm.generate(prompts, params)]
            lp = first_token_logprobs(llm.engine, prompts)
            kls = [float((r.exp() * (r - g)).sum()) for r, g in zip(ref_lp, lp)]
            eq, pre = agreement(ref, got)
            mean_kl = sum(kls) / len(kls)
            name = "checkpoint / 1.0" if scales == "checkpoint" else f"computed, per {scales}"
            print(f"| {fmt} | {name} | {llm.engine.connector.kv_bytes_per_token} | {eq:.3f} | {pre:.3f} | "
                  f"{mean_kl:.3g} | {max(kls):.3g} |")
            if not all(math.isfinite(k) for k in kls):
                print(f"  {fmt} ({scales}): some KL is not finite", file=sys.stderr)
            llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
