"""FP8 KV on the CPU: decode speed of the native kernel's float8 variant against the torch path
and against a float32 pool, side by side in one process.

Three engines on one model (float32 weights): ``kv_cache_dtype=auto`` on the native kernel (the
default CPU engine), ``fp8_e4m3`` on the torch path (what FP8 ran before the kernel read float8)
and ``fp8_e4m3`` on the native kernel. Each round runs every engine once, in turn, on the same
batch: ``--batch`` prompts of ``--prompt-len`` random tokens, ``--max-tokens`` greedy tokens each
(EOS ignored), and times the decode steps (every step after the batch's prompts are in). Prints
the median decode tokens/s of each engine over the rounds, with min and max, and each engine's
ratio to the float32 pool's.

    python -m pdserve.bench.fp8_speed --model .cache/models/pdserve-llama-0992c9fa --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

CONFIGS = (("auto", "native"), ("fp8_e4m3", "torch"), ("fp8_e4m3", "native"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", required=True, help="model directory (float32 on the CPU)")
    p.add_argument("--batch", default="16,64", help="batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (the context each decode step reads)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.rounds < 1 or args.max_tokens < 2 or args.prompt_len < 1 or min(args.batch) < 1:
        p.error("--rounds, --prompt-len and --batch must be >= 1, --max-tokens >= 2")
    return args


def decode_tps(eng, prompts: list[list[int]], max_tokens: int, tag: str) -> float:
    """Decode tokens per second of one batch: the steps after every prompt is in."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"{tag}-{i}")
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    start, tokens = time.perf_counter(), 0
    while eng.has_work():
        tokens += sum(len(d.new_token_ids) for d in eng.step())
    elapsed = time.perf_counter() - start
    for i in range(len(prompts)):
        eng.release(f"{tag}-{i}")
    return tokens / elapsed


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.engine import LLMEngine
    from pdserve.engine.config import EngineConfig

    rng = random.Random(args.seed)
    engines = {c: LLMEngine(EngineConfig.from_kwargs(args.model, kv_cache_dtype=c[0], attention_backend=c[1],
                                                     enable_prefix_caching=False, max_num_seqs=max(args.batch),
                                                     max_num_batched_tokens=8192))
               for c in CONFIGS}
    print(f"model {args.model}; prompts of {args.prompt_len} tokens, {args.max_tokens} greedy tokens each; "
          f"{args.rounds} rounds, engines in turn each round")
    print("| batch | KV | attention | decode tok/s (median) | min | max | vs float32 pool |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)] for _ in range(batch)]
        for c, eng in engines.items():  # warm-up, not counted
            decode_tps(eng, prompts[:2], 4, f"w{batch}")
        runs: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
        for r in range(args.rounds):
            for c, eng in engines.items():
                runs[c].append(decode_tps(eng, prompts, args.max_tokens, f"r{batch}-{r}"))
        base = statistics.median(runs[CONFIGS[0]])
        for c in CONFIGS:
            med = statistics.median(runs[c])
            print(f"| {batch} | {c[0]} | {c[1]} | {med:.0f} | {min(runs[c]):.0f} | {max(runs[c]):.0f} | "
                  f"{med / base:.2f}x |")
    for eng in engines.values():
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
