"""The second KV tier on a CPU engine: loading a prefix back against computing it again.

Two parts, one run, same model and the same pool size for every engine:

1. **Candidates for the tier's store** (per block of real KV, taken from an engine's pool
   after a prefill): the file tier (a mapped file, the page cache warm), and a compressed
   in-memory tier (zlib level 1 on the pool's dtype), against computing the block's
   tokens again (the engine's own prefill ms per token, measured here). Prints MB/s of
   each load and how many times faster than recomputing it is.
2. **Serving a working set larger than the pool**: ``--docs`` documents of ``--doc-len``
   tokens, each asked ``--rounds`` times with a short new question, the pool holding about
   ``--pool-docs`` of them. Engines, measured in turns (the order rotates each round):
   ``recompute`` (prefix cache, no tier: an evicted prefix is computed again) and ``tier``
   (``kv_offload_bytes`` holding every document). Prints TTFT p50/p90 and the share of
   prompt tokens served from the pool and from the tier, and the ratios.

    python bench/kv_tier.py                          # the default ~34M model under .cache/
    python bench/kv_tier.py --docs 8 --doc-len 1024 --pool-docs 2 --rounds 3
    python bench/kv_tier.py --tensor-parallel-size 2  # part 2 at TP=2: every rank's tier
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="model dir (default: make the default ~34M model under .cache/)")
    p.add_argument("--docs", type=int, default=8, help="documents in the working set")
    p.add_argument("--doc-len", type=int, default=768, help="tokens per document")
    p.add_argument("--question-len", type=int, default=16, help="new tokens after the document in each prompt")
    p.add_argument("--pool-docs", type=float, default=2.5, help="the KV pool holds about this many documents")
    p.add_argument("--rounds", type=int, default=3, help="times each document is asked (the first fills)")
    p.add_argument("--output-len", type=int, default=4, help="tokens generated per request")
    p.add_argument("--tier-path", default=None, help="the file tier's directory (default: the temp directory)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="part 2's engines at this TP size (ranks as child processes; at TP>1 each rank keeps "
                        "its heads of the same tier slots, engine/kv_tier.py)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def default_model() -> str:
    from engine_throughput import default_model as made

    return made()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def first_token_ms(engine, prompt, params) -> float:
    """Add one request and step until its first token: the TTFT of a request alone."""
    t0 = time.perf_counter()
    req = engine.add_request(prompt, params)
    ttft = None
    while engine.has_unfinished():
        for d in engine.step():
            if d.request_id == req.request_id and d.new_token_ids and ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
            if d.finish_reason is not None:
                engine.release(d.request_id)
    return ttft


def store_candidates(model: str, args) -> None:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
    from pdserve.engine.kv_tier import KVTier

    rng = random.Random(args.seed)
    eng = LLMEngine(EngineConfig(model=model, kv_cache_memory_bytes=64 << 20))
    try:
        vocab = eng.model_config.vocab_size
        prompt = [rng.randrange(3, vocab) for _ in range(args.doc_len)]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        first_token_ms(eng, prompt, params)  # warm-up
        times = []
        for _ in range(3):
            other = [rng.randrange(3, vocab) for _ in range(args.doc_len)]
            times.append(first_token_ms(eng, other, params))
        compute_ms_per_token = statistics.median(times) / args.doc_len
        pool = eng.runner.kv_cache
        bs = eng.config.block_size
        n = args.doc_len // bs
        blocks = list(range(n))
        tier = KVTier(pool, (n + 1) * pool[:, 0].numel() * pool.element_size(), "file", args.tier_path)
        try:
            data = tier.store.view()
            for i in blocks:
                data[i].copy_(pool[:, i])
            ids = torch.tensor(blocks)
            loads = []
            for _ in range(5):
                t0 = time.perf_counter()
                pool.index_copy_(1, ids, data[ids].transpose(0, 1))
                loads.append(time.perf_counter() - t0)
            file_s = statistics.median(loads)
        finally:
            tier.close()
        raw = [pool[:, i].contiguous().numpy().tobytes() for i in blocks]
        packed = [zlib.compress(b, 1) for b in raw]
        decs = []
        for _ in range(3):
            t0 = time.perf_counter()
            for b, i in zip(packed, blocks):
                pool[:, i].copy_(torch.frombuffer(bytearray(zlib.decompress(b)), dtype=pool.dtype).view(pool[:, i].shape))
            decs.append(time.perf_counter() - t0)
        zlib_s = statistics.median(decs)
        block_bytes = len(raw[0])
        total = block_bytes * n
        ratio = sum(map(len, raw)) / sum(map(len, packed))
        recompute_s = compute_ms_per_token * n * bs / 1e3
        print(f"\n## store candidates: {n} blocks of {block_bytes} bytes ({pool.dtype}), {n * bs} tokens")
        print(f"{'candidate':<24} {'load ms':>9} {'MB/s':>9} {'x faster than recompute':>24}")
        print(f"{'recompute (prefill)':<24} {recompute_s * 1e3:>9.2f} {'':>9} {1.0:>24.1f}")
        print(f"{'file tier (mmap)':<24} {file_s * 1e3:>9.2f} {total / file_s / 1e6:>9.0f} {recompute_s / file_s:>24.1f}")
        print(f"{'zlib-1 in memory':<24} {zlib_s * 1e3:>9.2f} {total / zlib_s / 1e6:>9.0f} {recompute_s / zlib_s:>24.1f}"
              f"   (compresses {ratio:.3f}x)")
    finally:
        eng.close()


def working_set(model: str, args) -> None:
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

    probe = LLMEngine(EngineConfig(model=model, kv_cache_memory_bytes=16 << 20))
    vocab = probe.model_config.vocab_size
    block_bytes = probe.runner.block_bytes * probe.model_config.num_layers
    probe.close()
    rng = random.Random(args.seed + 1)
    docs = [[rng.randrange(3, vocab) for _ in range(args.doc_len)] for _ in range(args.docs)]
    bs = 16
    pool_blocks = int(args.pool_docs * (args.doc_len + args.question_len + args.output_len) / bs) + 1
    tier_bytes = (args.docs + 1) * ((args.doc_len + args.question_len + args.output_len) // bs + 1) * block_bytes
    configs = {"recompute": {}, "tier": {"kv_offload_bytes": tier_bytes, "kv_offload_path": args.tier_path}}
    tp = args.tensor_parallel_size
    engines = {name: LLMEngine(EngineConfig(model=model, num_gpu_blocks_override=pool_blocks,
                                            tensor_parallel_size=tp, **kw))
               for name, kw in configs.items()}
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    ttfts = {name: [] for name in engines}
    outs = {name: [] for name in engines}
    try:
        for name, eng in engines.items():  # warm-up, then forget it
            first_token_ms(eng, [rng.randrange(3, vocab) for _ in range(64)], params)
        order = list(engines)
        for r in range(args.rounds):
            questions = [[rng.randrange(3, vocab) for _ in range(args.question_len)] for _ in docs]
            print(f"round {r + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
            for d, doc in enumerate(docs):
                for name in order:
                    eng = engines[name]
                    before = eng.stats.num_prompt_tokens_cached
                    ms = first_token_ms(eng, doc + questions[d], params)
                    if r > 0:  # the first round only fills the caches
                        ttfts[name].append(ms)
                        outs[name].append(eng.stats.num_prompt_tokens_cached - before)
                order = order[1:] + order[:1]
        print(f"\n## working set {args.docs} docs x {args.doc_len} tokens, pool {pool_blocks} blocks "
              f"(~{args.pool_docs} docs), {args.rounds - 1} measured rounds, TTFT of each request alone"
              + (f", TP={tp}" if tp > 1 else ""))
        print(f"{'engine':<11} {'TTFT p50 ms':>12} {'p90 ms':>9} {'pool hit':>9} {'tier hit':>9} "
              f"{'p90 vs recompute':>17}")
        base = pct(ttfts["recompute"], 90)
        asked = len(ttfts["recompute"]) * (args.doc_len + args.question_len)
        for name, eng in engines.items():
            tier_tokens = eng.scheduler.tier_loaded_tokens
            cached = sum(outs[name])
            pool_hit = (cached - (tier_tokens if name == "tier" else 0)) / asked
            tier_hit = (tier_tokens / asked) if name == "tier" else 0.0
            print(f"{name:<11} {pct(ttfts[name], 50):>12.1f} {pct(ttfts[name], 90):>9.1f} {pool_hit:>9.2f} "
                  f"{tier_hit:>9.2f} {base / pct(ttfts[name], 90):>16.2f}x")
        if engines["tier"].tier is not None:
            snap = engines["tier"].tier.snapshot()
            print(f"tier: {snap['stored']} blocks stored ({snap['sync_copies']} at eviction), {snap['dropped']} "
                  f"copies dropped, {snap['loaded_blocks']} loaded in {snap['loads']} loads, "
                  f"{(snap['load_bytes_per_s'] or 0) / 1e6:.0f} MB/s")
    finally:
        for eng in engines.values():
            eng.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model or default_model()
    if args.tier_path is None:
        args.tier_path = tempfile.gettempdir()
    print(f"model {model}; tier files under {args.tier_path}")
    store_candidates(model, args)
    working_set(model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
