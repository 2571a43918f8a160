"""Engine step time by where the engine was loaded: the OpenMP team trap (common/compute_thread.py).

The same engine, the same decode batches, stepped on a thread of its own; what changes is the
thread that loaded it (built the model, packed the weights, warmed up):

* ``loader-alive``: loaded on a thread that stays alive (the main thread here; in a worker,
  the event loop's or an `asyncio.to_thread` pool thread), as the workers did before.
* ``loader-gone``: loaded on a thread that has ended (`run_in_own_thread`), as they do now.

Each mode runs in its own process (a process's OpenMP teams are the point), alternating, and
the script prints the median decode-step time per batch size for each and their ratio.

    python bench/engine_threads.py                      # 3 rounds, batches 1,4,8, the default model
    python bench/engine_threads.py --rounds 5 --batches 1,2 --cpus 0,1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(REPO))
sys.path.insert(0, os.path.join(REPO, "bench"))

MODES = ("loader-alive", "loader-gone")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: make the default model under .cache/)")
    p.add_argument("--batches", default="1,4,8", help="decode batch sizes (comma-separated)")
    p.add_argument("--prompt-len", type=int, default=500, help="prompt tokens per stream")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per batch size")
    p.add_argument("--rounds", type=int, default=3, help="processes per mode, alternating")
    p.add_argument("--cpus", default="", help="taskset core list for the measured processes (default: inherit)")
    p.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _measure(engine, batches: list[int], prompt_len: int, steps: int) -> dict:
    """Median pure-decode step ms per batch size (run on the stepping thread)."""
    from pdserve.engine import SamplingParams

    rnd = random.Random(0)
    out = {}
    for b in batches:
        rids = [f"b{b}-{i}" for i in range(b)]
        for rid in rids:
            engine.add_request([rnd.randrange(100, 30000) for _ in range(prompt_len)],
                               SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True), request_id=rid)
        for _ in range(256):  # prefill until every stream decodes (bounded)
            engine.step()
            seqs, tokens, decodes = engine.last_step
            if seqs == b and tokens == decodes:
                break
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
        out[b] = statistics.median(times)
        for rid in rids:
            engine.abort_request(rid)
        while engine.has_unfinished():
            engine.step()
    return out


def child(args) -> None:
    from pdserve.engine import EngineConfig, LLMEngine

    def load():
        return LLMEngine(EngineConfig.from_kwargs(args.model, max_num_batched_tokens=2048, max_num_seqs=64,
                                                  kv_cache_memory_bytes=1 << 30))

    if args.child == "loader-alive":
        engine = load()  # this (main) thread lives on while another one steps
    else:
        box = {}
        loader = threading.Thread(target=lambda: box.setdefault("engine", load()), name="loader")
        loader.start()
        loader.join()  # ended: its OpenMP team with it
        engine = box["engine"]
    result = {}
    stepper = threading.Thread(target=lambda: result.update(
        _measure(engine, [int(b) for b in args.batches.split(",")], args.prompt_len, args.steps)), name="stepper")
    stepper.start()
    stepper.join()
    print(json.dumps({"mode": args.child, "ms": result}))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.model is None:
        from engine_throughput import default_model
        args.model = default_model()
    if args.child:
        return child(args)
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", args.model,
                   "--batches", args.batches, "--prompt-len", str(args.prompt_len), "--steps", str(args.steps)]
            if args.cpus:
                cmd = ["taskset", "-c", args.cpus, *cmd]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            ms = {int(k): v for k, v in json.loads(line)["ms"].items()}
            runs[mode].append(ms)
            print(f"  round {r + 1} {mode:13s} " + "  ".join(f"batch {b}: {ms[b]:.1f} ms" for b in batches),
                  flush=True)
    print()
    print("| decode step ms (median of rounds, [min-max]) | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    med = {}
    for mode in MODES:
        cells = []
        for b in batches:
            vals = [m[b] for m in runs[mode]]
            med[(mode, b)] = statistics.median(vals)
            cells.append(f"{med[(mode, b)]:.1f} [{min(vals):.1f}-{max(vals):.1f}]")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print("| alive / gone | " + " | ".join(f"{med[('loader-alive', b)] / med[('loader-gone', b)]:.2f}x"
                                         for b in batches) + " |")


if __name__ == "__main__":
    main()
