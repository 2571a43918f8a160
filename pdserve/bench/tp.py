"""Tensor parallelism on the CPU: step time at TP=1 vs TP=2, and what the collectives cost.

Every configuration's engine starts once on the same model and warms up; then
``--rounds`` rounds run each in turn (the order rotates). In a round, for every batch size
it admits that many requests, runs their prefill, and times ``--steps`` decode-only steps
(their median, in ms), then three prefill steps of ``--prefill-len`` tokens (median). The
table gives the median over rounds and the ratio to tp1. Configurations, in one run on the
same machine:

- ``tp1``: one process, all the cores (the baseline);
- ``tp2-shm``: two ranks, shared-memory collectives (the CPU default), a mixture-of-experts
  model's experts tensor-parallel (every rank a slice of each);
- ``tp2-gloo``: two ranks, torch's gloo collectives over loopback;
- ``tp2-shm-hnd``: as tp2-shm with the HND pool layout (the one a handoff between
  different TP sizes needs), against ``tp1-hnd`` to show what HND costs at TP=1;
- ``tp2-ep``: as tp2-shm with a mixture-of-experts model's routed experts split whole
  between the ranks (``enable_expert_parallel``, the CPU's default) instead of every expert's
  rows (tp2-shm):

      python bench/tp.py --model DIR --configs tp1,tp2-shm,tp2-ep --batches 1,16,64

It also checks that every configuration's greedy output equals TP=1's.

    python bench/tp.py                                  # the default ~34M model under .cache/
    python bench/tp.py --batches 1,16,64 --steps 30 --configs tp1,tp2-shm,tp2-gloo

What to expect on a 2-core CPU: TP=2 gives each rank one core where TP=1 used both, so
the matmuls are no faster; what TP=2 adds is the collectives (two all-reduces a layer plus
the embedding and the logits gather) and the step broadcast. The figure that matters is
how close tp2-shm stays to tp1, and how far gloo's loopback collectives fall behind.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {
    "tp1": {},
    "tp1-hnd": {"kv_layout": "HND"},
    "tp2-shm": {"tensor_parallel_size": 2, "tp_comm": "shm", "enable_expert_parallel": False},
    "tp2-gloo": {"tensor_parallel_size": 2, "tp_comm": "gloo"},
    "tp2-shm-hnd": {"tensor_parallel_size": 2, "tp_comm": "shm", "kv_layout": "HND"},
    "tp2-ep": {"tensor_parallel_size": 2, "tp_comm": "shm", "enable_expert_parallel": True},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: make the default ~34M model under .cache/)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the timed prefill step")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all configurations (order rotates)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def drain(eng) -> None:
    """Abort what still runs, release what finished: the engine is empty again."""
    for rid, req in list(eng.requests.items()):
        if req.status.finished:
            eng.release(rid)
        else:
            eng.abort_request(rid)
    while eng.has_work():
        eng.step()
    for rid in list(eng.requests):
        eng.release(rid)


def measure(llm, batches: list[int], args, rng: random.Random) -> dict:
    """One round on a started engine: decode step times per batch size and a prefill step."""
    from pdserve.engine import SamplingParams

    eng = llm.engine
    vocab = eng.model_config.vocab_size
    out = {"decode": {}}
    for batch in batches:
        params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
        for _ in range(batch):
            eng.add_request([rng.randrange(3, vocab) for _ in range(args.context)], params)
        times = []
        while eng.has_work() and len(times) < args.steps:
            s = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - s
            seqs, tokens, decodes = eng.last_step
            if decodes == seqs == batch and tokens == batch:
                times.append(dt * 1e3)
        drain(eng)
        out["decode"][batch] = statistics.median(times) if times else float("nan")
    pre = []
    for _ in range(3):
        eng.add_request([rng.randrange(3, vocab) for _ in range(args.prefill_len)],
                        SamplingParams(max_tokens=1, temperature=0.0))
        s = time.perf_counter()
        eng.step()
        pre.append((time.perf_counter() - s) * 1e3)
        drain(eng)
    out["prefill_ms"] = statistics.median(pre)
    return out


def start(model: str, engine_args: dict, batches: list[int], args):
    import torch

    from pdserve.engine import LLM, SamplingParams

    threads = torch.get_num_threads()

    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=max(batches), max_num_batched_tokens=max(args.prefill_len, 2048),
              enable_prefix_caching=False, **engine_args)
    startup = time.perf_counter() - t0
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    check = [[rng.randrange(3, vocab) for _ in range(n)] for n in (7, 60, 200)]
    tokens = [o.token_ids for o in llm.generate(check, SamplingParams(max_tokens=16, temperature=0.0))]
    measure(llm, batches, args, rng)  # warm-up: first-call packing, page faults, thread pools
    torch.set_num_threads(threads)  # a TP engine set its rank 0's share for the whole process
    return llm, startup, tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad}; use {list(CONFIGS)}")
    batches = [int(b) for b in args.batches.split(",")]
    if args.model:
        model = args.model
    else:
        from engine_throughput import default_model

        model = default_model()
    print(f"model {model}, {os.cpu_count()} CPUs, batches {batches}, {args.steps} decode steps each, "
          f"context {args.context}, prefill {args.prefill_len} tokens", flush=True)
    import torch

    all_threads = torch.get_num_threads()
    engines, results = {}, {}
    try:
        for name in names:
            print(f"[{name}] starting and warming up ...", flush=True)
            llm, startup, tokens = start(model, CONFIGS[name], batches, args)
            engines[name] = llm
            results[name] = {"startup_s": startup, "tokens": tokens, "rounds": []}
        # Rounds rotate the order, so no configuration always runs first (or right after another).
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                # torch's thread count is per process: TP=1 uses every core, a TP rank 0 its share.
                group = engines[name].engine.runner.group
                torch.set_num_threads(group.threads if group is not None else all_threads)
                r = measure(engines[name], batches, args, random.Random(args.seed + rnd))
                results[name]["rounds"].append(r)
                print(f"round {rnd + 1}/{args.rounds} [{name}] decode ms/step: "
                      + ", ".join(f"b{b} {m:.2f}" for b, m in r["decode"].items())
                      + f"; prefill {r['prefill_ms']:.1f} ms", flush=True)
    finally:
        for llm in engines.values():
            llm.close()
    for r in results.values():
        r["decode"] = {b: statistics.median(x["decode"][b] for x in r["rounds"]) for b in batches}
        r["prefill_ms"] = statistics.median(x["prefill_ms"] for x in r["rounds"])
    print(f"\nmedian over {args.rounds} rounds (each a median of {args.steps} steps)")
    base = results.get("tp1")
    print("\n| config | " + " | ".join(f"decode b{b} ms" for b in batches) + " | prefill ms | same tokens as tp1 |")
    print("|---|" + "---|" * (len(batches) + 2))
    for name, r in results.items():
        cells = []
        for b in batches:
            m = r["decode"][b]
            ratio = f" ({m / base['decode'][b]:.2f}x)" if base and name != "tp1" else ""
            cells.append(f"{m:.2f}{ratio}")
        pre = f"{r['prefill_ms']:.1f}" + (f" ({r['prefill_ms'] / base['prefill_ms']:.2f}x)" if base and name != "tp1"
                                          else "")
        same = "-" if not base or name == "tp1" else ("yes" if r["tokens"] == base["tokens"] else "NO")
        print(f"| {name} | " + " | ".join(cells) + f" | {pre} | {same} |")
    if base and any(r["tokens"] != base["tokens"] for r in results.values()):
        print("greedy output differs from tp1", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
