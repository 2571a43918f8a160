"""LoRA adapters' cost in the engine: decode throughput with adapters mixed against the base alone.

One engine (`LLMEngine` with ``enable_lora``, ``max_loras`` = ``--adapters``) on this machine;
``--adapters`` random PEFT adapters (rank ``--rank`` on every projection, written here as PEFT
writes them) are made for the model. At each ``--batches`` size, two sides alternate every
round so drift hits both alike: ``base``, every request on the base model, and ``mixed``, the
requests spread round-robin over the adapters (every adapter resident, all of them in every
step). Each request has a ``--prompt-len`` prompt and decodes ``--output-len`` tokens (EOS
ignored); the figure is decode tokens per second over the steps where every request decodes
(the prefill steps excluded), and the ratio mixed / base. Then ``--ttft-rounds`` times, the TTFT
of one request under an adapter the engine has never seen (cold: its files read and checked, a
slot filled) against the same adapter right after (warm).

    python -m pdserve.bench.lora                         # the default model under .cache/
    python -m pdserve.bench.lora --batches 4 --output-len 8 --rounds 1 --adapters 2   # quick check
    python -m pdserve.bench.lora --model DIR --batches 16,64 --rounds 5 --json out.json

Prints min / median / max over ``--rounds`` of each side and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: make the default model under .cache/)")
    p.add_argument("--adapters", type=int, default=8, help="adapters mixed (and the engine's max_loras)")
    p.add_argument("--rank", type=int, default=16, help="each adapter's rank (max_lora_rank)")
    p.add_argument("--batches", default="16,64", help="requests decoding at once (comma-separated)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-kernel", choices=("auto", "torch"), default="auto",
                   help="auto: the native gathered kernel on a float32 CPU model (engine/lora_native.py); "
                        "torch: the torch forms only (PDSERVE_LORA_KERNEL=torch), the ablation")
    p.add_argument("--ttft-rounds", type=int, default=5,
                   help="TTFT of a request under a never-seen adapter (cold) against it resident (warm); 0: skip")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def make_adapters(model_cfg, n: int, rank: int, root: str, seed: int) -> list[str]:
    """``n`` random adapters for ``model_cfg`` on every projection, in PEFT's files."""
    import torch
    from safetensors.torch import save_file

    from pdserve.engine.lora import MLP_MODULES, MODULES, expected_shape

    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(n):
        path = os.path.join(root, f"adapter{i}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(model_cfg.num_layers):
            for m in MODULES:
                out_f, in_f = expected_shape(model_cfg, m)
                key = f"base_model.model.model.layers.{layer}.{'mlp' if m in MLP_MODULES else 'self_attn'}.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                       "target_modules": list(MODULES)}, f)
        paths.append(path)
    return paths


def decode_rate(eng, prompts: list[list[int]], loras: list, output_len: int) -> float:
    """Decode tokens per second over the steps where every request decodes."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(p, params, lora_request=lora) for p, lora in zip(prompts, loras)]
    tokens, secs = 0, 0.0
    while eng.has_unfinished():
        decoding = all(r.output_token_ids for r in reqs if not r.status.finished)
        t0 = time.perf_counter()
        deltas = eng.step()
        if decoding:
            secs += time.perf_counter() - t0
            tokens += sum(len(d.new_token_ids) for d in deltas)
        for d in deltas:
            if d.finished:
                eng.release(d.request_id)
    return tokens / secs if secs else 0.0


def ttft_ms(eng, prompt: list[int], lora) -> float:
    """One request's time to its first token (ms), alone in the engine."""
    from pdserve.engine import SamplingParams

    t0 = time.perf_counter()
    req = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), lora_request=lora)
    while not req.output_token_ids:
        eng.step()
    ms = (time.perf_counter() - t0) * 1e3
    eng.release(req.request_id)  # (max_tokens 1: it finished with its first token)
    assert not eng.has_unfinished()
    return ms


def cold_and_warm(eng, paths: list[str], prompt_len: int, rounds: int, rng: random.Random) -> dict[str, list[float]]:
    """TTFT of a request under an adapter the engine has never seen (cold: its files read and
    checked, a slot filled) against the same adapter right after (warm: resident), ``rounds``
    times, each round a new name (so nothing of it is cached) and a fresh prompt."""
    from pdserve.engine import LoRARequest

    vocab = eng.model_config.vocab_size
    out: dict[str, list[float]] = {"cold": [], "warm": []}
    for rnd in range(rounds):
        lora = LoRARequest(f"cold-{rnd}", 1000 + rnd, paths[rnd % len(paths)])
        for side in ("cold", "warm"):
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            out[side].append(ttft_ms(eng, prompt, lora))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.bench.engine_throughput import default_model
    from pdserve.engine import LLMEngine, LoRARequest
    from pdserve.engine.config import EngineConfig, ModelConfig

    os.environ["PDSERVE_LORA_KERNEL"] = args.lora_kernel  # read when the engine wraps its projections
    model = args.model or default_model()
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(args.seed)
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-bench-") as root:
        paths = make_adapters(ModelConfig.from_dir(model), args.adapters, args.rank, root, args.seed)
        adapters = [LoRARequest(f"bench-{i}", i + 1, p) for i, p in enumerate(paths)]
        eng = LLMEngine(EngineConfig.from_kwargs(
            model, enable_prefix_caching=False, enable_lora=True, max_loras=args.adapters,
            max_lora_rank=args.rank, max_num_seqs=max(batches)))
        vocab = eng.model_config.vocab_size
        kernel = eng.runner.lora.model.state.lib is not None
        print(f"LoRA delta: {'the native gathered kernel' if kernel else 'the torch forms'} (--lora-kernel {args.lora_kernel})")
        decode_rate(eng, [[5] * 8] * 2, adapters[:2], 4)  # warm-up
        for batch in batches:
            prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
            sides: dict[str, list] = {"base": [None] * batch,
                                      "mixed": [adapters[i % len(adapters)] for i in range(batch)]}
            res = results[f"batch {batch}"] = {"base": [], "mixed": []}
            for rnd in range(args.rounds):
                for side in (["base", "mixed"] if rnd % 2 == 0 else ["mixed", "base"]):
                    res[side].append(decode_rate(eng, prompts, sides[side], args.output_len))
            base, mixed = statistics.median(res["base"]), statistics.median(res["mixed"])
            print(f"batch {batch}: base {min(res['base']):.1f}/{base:.1f}/{max(res['base']):.1f} tok/s, "
                  f"{args.adapters} adapters mixed {min(res['mixed']):.1f}/{mixed:.1f}/{max(res['mixed']):.1f} "
                  f"tok/s (min/median/max), mixed/base {mixed / base:.3f}")
        if args.ttft_rounds:
            ttft = results["ttft"] = cold_and_warm(eng, paths, args.prompt_len, args.ttft_rounds, rng)
            cold, warm = ttft["cold"], ttft["warm"]
            print(f"TTFT with an adapter ({args.prompt_len}-token prompt, {args.ttft_rounds} rounds): cold "
                  f"{min(cold):.1f}/{statistics.median(cold):.1f}/{max(cold):.1f} ms, warm "
                  f"{min(warm):.1f}/{statistics.median(warm):.1f}/{max(warm):.1f} ms (min/median/max)")
        eng.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
