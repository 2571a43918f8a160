"""FP8 KV cache against the model's dtype: greedy agreement and next-token KL.

Two engines on one model, ``kv_cache_dtype=auto`` (the reference) and each FP8 format asked;
N random prompts. Reports, per format:

- greedy agreement: the prompts whose greedy continuation (``--max-tokens``) is token for token
  the reference's, and the mean fraction of generated tokens equal up to the first difference;
- next-token KL: the mean over prompts of KL(reference || fp8) of the distribution of the
  first generated token (the prompt's last position, whose attention read every layer's
  FP8 K/V), from the full logits of the step (read off `ModelRunner.execute`);
- the pool's KV bytes per token of each.

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
    p.add_argument("--dtype", default="auto", help="the model's dtype (engine arg dtype)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.lo, args.hi = (int(x) for x in args.prompt_len.split("-"))
    except ValueError:
        p.error(f"--prompt-len: expected lo-hi, got {args.prompt_len!r}")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.engine import LLM, SamplingParams

    if args.model is None:
        from engine_throughput import default_model

        args.model = default_model()
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
    print(f"model {args.model}, {args.prompts} prompts of {args.lo}-{args.hi} tokens, {args.max_tokens} greedy "
          f"tokens each, dtype {args.dtype}, device {args.device}")
    print(f"| kv_cache_dtype | KV bytes/token | greedy sequences equal | mean matching prefix | "
          f"mean next-token KL (nats) | max KL |")
    print("|---|---|---|---|---|---|")
    print(f"| auto | {ref_bytes} | 1.000 | 1.000 | 0 | 0 |")
    for fmt in args.formats.split(","):
        llm = LLM(args.model, kv_cache_dtype=fmt, **common)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        lp = first_token_logprobs(llm.engine, prompts)
        kls = [float((r.exp() * (r - g)).sum()) for r, g in zip(ref_lp, lp)]
        eq, pre = agreement(ref, got)
        mean_kl = sum(kls) / len(kls)
        print(f"| {fmt} | {llm.engine.connector.kv_bytes_per_token} | {eq:.3f} | {pre:.3f} | "
              f"{mean_kl:.3g} | {max(kls):.3g} |")
        if not all(math.isfinite(k) for k in kls):
            print(f"  {fmt}: some KL is not finite", file=sys.stderr)
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
