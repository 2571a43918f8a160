"""Decode step time against the memory-bandwidth floor, FlashInfer vs the torch path (and
FlashInfer with decode CUDA graphs), and KV page writes VRAM to VRAM through NIXL.

    python bench/gpu_step.py                      # ~1.2B Llama-3.2-1B shape, random weights, bf16
    python bench/gpu_step.py --shape 8b --backends flashinfer+graphs,flashinfer+graphs+overlap --batches 1,64
    python bench/gpu_step.py --batches 1,16,64 --context-len 512 --json out.json
    python bench/gpu_step.py --device cpu --shape tiny --backends torch --batches 1,4 --steps 5
                                                  # smoke run on CPU (what tests/bench runs)

Decode step: ``B`` sequences that each hold ``--context-len`` tokens of KV, one new token per
sequence per step, timed through `LLMEngine.step` (scheduling, inputs, forward, sampling: what
a served token pays), median of ``--steps`` steps after warm-up.

Floor: a decode step must at least read every weight once and every sequence's KV once, so
``floor = (weight bytes + B * context * KV bytes per token) / bandwidth``, the bandwidth being
measured here with a large device-to-device copy (bytes read + written per second). The goal
for batch 1 is a step within 1.25x of that floor.

Transfer: bench/kv_transfer.py's coalesced write of ``--transfer-blocks`` blocks (Llama-3-8B
KV geometry) between two processes whose pools are on this device (VRAM to VRAM on a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

SHAPES = {
    # Llama-3.2-1B: 16 layers, 2048 hidden, 32 heads over 8 KV heads, 8192 MLP, 128k vocab, tied.
    "1b": dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, intermediate_size=8192,
               vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192),
    # Llama-3-8B: 32 layers, 4096 hidden, 32 heads over 8 KV heads, 14336 MLP, 128k vocab, untied.
    "8b": dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336,
               vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(),  # the default made model (~34M)
}
BACKENDS = ("torch", "flashinfer", "flashinfer+graphs", "flashinfer+graphs+overlap", "flashinfer+graphs+async")
# "+overlap" (after any backend): engine arg overlap_steps, the next step's inputs built while
# this one runs (engine/overlap.py); "+async": async_scheduling, that step also launched from
# this one's tokens before they are read; beside the same backend without them, their ablation
SUFFIXES = ("+overlap", "+async")


def base_backend(name: str) -> str:
    for suffix in SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="model shape to make (random weights)")
    p.add_argument("--model", default=None, help="use this model directory instead of making one")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--backends", default=None,
                   help=f"comma list of {', '.join(BACKENDS)} (default: all on cuda, torch on cpu)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context-len", type=int, default=512, help="KV tokens per sequence while decoding")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per point")
    p.add_argument("--transfer-blocks", type=int, default=256, help="blocks per write; 0: skip the NIXL transfer")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.backends = (args.backends or (",".join(BACKENDS) if cuda else "torch")).split(",")
    bad = [b for b in args.backends if b not in BACKENDS and base_backend(b) not in BACKENDS]
    if bad:
        p.error(f"--backends: unknown {bad}; choose from {', '.join(BACKENDS)}")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available here; use --device cpu --shape tiny for a smoke run")
    return args


def model_dir(args) -> str:
    if args.model:
        return args.model
    from pdserve.engine.model_maker import ModelSpec, make_model

    path = os.path.join(".cache", "models", f"pdserve-{args.shape}-llama-{args.dtype}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"making the {args.shape} model in {path} (random weights) ...", flush=True)
        # on the GPU: weights drawn there (seconds for the 8B shape; HF's CPU init takes minutes)
        make_model(path, ModelSpec(dtype=args.dtype, **SHAPES[args.shape]),
                   init_device="cuda" if args.device.startswith("cuda") else None)
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large copy, read + written (the floor's denominator)."""
    if not device.startswith("cuda"):
        nbytes = 256 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def engine_for(path: str, args, backend: str, max_batch: int):
    from pdserve.engine import LLM

    kwargs = dict(device=args.device, dtype=args.dtype, attention_backend=backend.split("+")[0],
                  max_num_seqs=max_batch, max_num_batched_tokens=max(8192, args.context_len * 4),
                  cuda_graphs="+graphs" in backend, cuda_graph_max_batch=max_batch,
                  overlap_steps=backend.endswith("+overlap"), async_scheduling=backend.endswith("+async"))
    need_tokens = max_batch * (args.context_len + args.steps + 8)
    if args.device.startswith("cuda"):
        kwargs["gpu_memory_utilization"] = 0.8
    else:
        kwargs["kv_cache_memory_bytes"] = need_tokens * 2 * 64 * 1024  # ample for the tiny shape
    return LLM(path, **kwargs).engine


def decode_step_ms(eng, batch: int, args) -> float:
    """Median step time with ``batch`` sequences decoding over ``context_len`` tokens of KV."""
    from pdserve.engine import SamplingParams

    # Long enough that the first prompts prefilled are still decoding when the last one is
    # (a planned step takes a bounded chunk of prompt tokens); aborted after the timed steps.
    params = SamplingParams(max_tokens=args.steps + 8 + batch * args.context_len // 64, temperature=0.0,
                            ignore_eos=True)
    vocab = eng.model_config.vocab_size
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(args.context_len)]
        eng.add_request(prompt, params, request_id=f"b{batch}-{i}")
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()  # prefill (and the first token)
    for _ in range(2):  # warm-up decode steps
        eng.step()
    times = []
    for _ in range(args.steps):
        sync(args.device)
        t0 = time.perf_counter()
        eng.step()
        sync(args.device)
        times.append(time.perf_counter() - t0)
        assert eng.last_step[2] == batch, f"expected {batch} decoding sequences, the step ran {eng.last_step}"
    for i in range(batch):
        eng.abort_request(f"b{batch}-{i}")
    return statistics.median(times) * 1e3


def weight_bytes(eng) -> int:
    return sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())


def transfer_gbps(args) -> dict:
    """The 4096-token (256-block) coalesced page write of bench/kv_transfer.py, pools on this
    device in two processes (VRAM to VRAM on a GPU): GB/s of its median."""
    import subprocess
    import tempfile

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    dtype = args.dtype if args.dtype in ("float16", "bfloat16") else "float16"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "kv.json")
        run = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "kv_transfer.py"),
                              "--device", device, "--dtype", dtype, "--sizes", str(args.transfer_blocks),
                              "--reps", "0.5", "--json", out], capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise SystemExit(f"bench/kv_transfer.py failed (rc {run.returncode}):\n{run.stdout}{run.stderr}")
        with open(out) as f:
            rows = json.load(f)["rows"]
    row = next(r for r in rows if r["case"] == "coalesced")
    return {"blocks": row["blocks"], "bytes": row["bytes"], "gbps": row["gb_per_s"], "median_ms": row["median_ms"],
            "mem": "VRAM" if device == "cuda" else "DRAM", "dtype": dtype}


def main(argv=None) -> int:
    args = parse_args(argv)
    path = model_dir(args)
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    bw = bandwidth(args.device)
    print(f"device: {dev_name}; copy bandwidth {bw / 1e9:.0f} GB/s; model {path}; dtype {args.dtype}; "
          f"context {args.context_len} tokens", flush=True)
    results = {"device": dev_name, "bandwidth_gbps": bw / 1e9, "model": path, "dtype": args.dtype,
               "context_len": args.context_len, "steps": {}, "transfer": None}
    max_batch = max(args.batches)
    eng = None
    print(f"{'backend':<18} {'batch':>5} {'step ms':>9} {'floor ms':>9} {'x floor':>8} {'tok/s':>9}")
    for backend in args.backends:
        eng = None  # the last backend's engine and its pool go before the next is sized
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        eng = engine_for(path, args, backend, max_batch)
        start_s = time.perf_counter() - t0
        wbytes = weight_bytes(eng)
        per_token = eng.connector.kv_bytes_per_token
        for batch in args.batches:
            ms = decode_step_ms(eng, batch, args)
            floor_ms = (wbytes + batch * args.context_len * per_token) / bw * 1e3
            results["steps"].setdefault(backend, {})[batch] = {
                "step_ms": ms, "floor_ms": floor_ms, "x_floor": ms / floor_ms, "tok_s": batch / ms * 1e3}
            if (ahead := eng.runner.lookahead) is not None:  # how many steps took their prepared inputs
                results["steps"][backend][batch].update(prepared=ahead.prepared, taken=ahead.taken,
                                                        launched=ahead.launched, launched_taken=ahead.launched_taken)
            print(f"{backend:<18} {batch:>5} {ms:>9.3f} {floor_ms:>9.3f} {ms / floor_ms:>7.2f}x "
                  f"{batch / ms * 1e3:>9.0f}", flush=True)
        results["steps"][backend]["engine_start_s"] = start_s
    if "torch" in results["steps"] and len(results["steps"]) > 1:
        for backend in results["steps"]:
            if backend != "torch":
                ratios = [results["steps"]["torch"][b]["step_ms"] / results["steps"][backend][b]["step_ms"]
                          for b in args.batches]
                print(f"{backend} vs torch: " + ", ".join(f"batch {b} {r:.2f}x" for b, r in zip(args.batches, ratios)))
    if args.transfer_blocks:
        results["transfer"] = t = transfer_gbps(args)
        print(f"KV transfer {t['mem']}->{t['mem']} through NIXL, two processes: {t['gbps']:.1f} GB/s "
              f"({t['blocks']} blocks of Llama-3-8B KV, {t['bytes'] >> 20} MiB, {t['dtype']}; bench/kv_transfer.py)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
