"""pdserve's engine against vLLM's CPU build, side by side in one run (engine_throughput.py --peer vllm).

pdserve runs in this process; vLLM runs in its own virtualenv (bench/vllm_peer.py in a
subprocess, JSON lines over its stdin/stdout), so neither install touches the other. Both
engines stay up for the whole run: start-up is timed once, each batch size is warmed up once
per engine, then the timed rounds alternate which engine goes first.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

MARK = "PEER-RESULT "
HERE = os.path.dirname(os.path.abspath(__file__))


class PdserveSide:
    name = "pdserve"

    def __init__(self, model: str, args):
        import torch

        from pdserve.engine import EngineConfig, LLMEngine

        torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        self.engine = LLMEngine(EngineConfig.from_kwargs(
            model, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(args.batch_sizes),
            kv_cache_memory_bytes=args.kv_cache_memory_bytes or (256 << 20), enable_prefix_caching=False,
            linear_backend=args.linear_backend))
        self.startup_s = time.perf_counter() - t0
        self.detail = (f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
                       f"linear {self.engine.runner.linear_backend}, attention {self.engine.runner.backend.name}")

    def run(self, prompts, output_len: int):
        from pdserve.engine import SamplingParams

        eng = self.engine
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        reqs = [eng.add_request(p, params) for p in prompts]
        while eng.has_unfinished():
            for d in eng.step():
                if d.finished:
                    eng.release(d.request_id)
        return time.perf_counter() - t0, [list(r.output_token_ids) for r in reqs]

    def close(self):
        pass


class VllmSide:
    name = "vLLM"

    def __init__(self, model: str, args):
        python = args.vllm_python
        if not os.path.isfile(python):
            raise SystemExit(f"--peer vllm: no vLLM virtualenv at {python}; run `make vllm-venv` "
                             "(or pass --vllm-python PATH)")
        self.timeout = args.peer_timeout
        settings = {"model": model, "max_num_batched_tokens": args.max_num_batched_tokens,
                    "max_num_seqs": max(args.batch_sizes),
                    "kv_cache_memory_bytes": args.kv_cache_memory_bytes or (256 << 20),
                    "enforce_eager": args.vllm_enforce_eager}
        env = dict(os.environ)
        # vLLM's CPU build binds its OpenMP threads to these cores; same count as pdserve's.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        self.log_path = os.path.join(args.log_dir, "vllm_peer.log")
        os.makedirs(args.log_dir, exist_ok=True)
        self._log = open(self.log_path, "w")
        print(f"starting vLLM ({python}); its log: {self.log_path}", file=sys.stderr)
        self.proc = subprocess.Popen([python, os.path.join(HERE, "vllm_peer.py"), json.dumps(settings)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._answer("start-up")
        self.startup_s = ready["startup_s"]
        self.detail = f"vllm-cpu {ready['version']}, OMP threads bound to {env['VLLM_CPU_OMP_THREADS_BIND']}" + (
            ", enforce_eager" if args.vllm_enforce_eager else "")

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._lines.put(json.loads(line[len(MARK):]))
        self._lines.put(None)

    def _answer(self, what: str) -> dict:
        try:
            msg = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise SystemExit(f"vLLM gave no answer to the {what} within {self.timeout:.0f} s "
                             f"(--peer-timeout); see {self.log_path}") from None
        if msg is None:
            raise SystemExit(f"vLLM exited during the {what} (code {self.proc.wait(10)}); see {self.log_path}")
        return msg

    def run(self, prompts, output_len: int):
        self.proc.stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}) + "\n")
        self.proc.stdin.flush()
        msg = self._answer("round")
        return msg["seconds"], msg["outputs"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def _spread(values):
    return min(values), statistics.median(values), max(values)


def run_peer_comparison(args, model: str, cfg: dict, prompts) -> int:
    args.batch_sizes = sorted({int(b) for b in args.batches.split(",")}, reverse=True)
    if max(args.batch_sizes) > len(prompts):
        raise SystemExit(f"--batches {args.batches}: the largest exceeds --num-prompts {len(prompts)}")
    args.log_dir = os.path.join("runs", "engine-peer")
    out_len = args.output_len
    print(f"model {model}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab "
          f"{cfg['vocab_size']}; float32; {out_len} output tokens per prompt (greedy, EOS ignored); "
          f"{args.max_num_batched_tokens}-token step budget; prefix caching off; {args.rounds} rounds")
    sides = [PdserveSide(model, args)]
    try:
        sides.append(VllmSide(model, args))
        for s in sides:
            print(f"  {s.name:8s} start-up {s.startup_s:6.1f} s  ({s.detail})")
        results = {(s.name, b): [] for s in sides for b in args.batch_sizes}
        outputs = {}
        for b in args.batch_sizes:  # warm-up: first calls, thread pools, compiled graphs
            for s in sides:
                _, outputs[(s.name, b)] = s.run(prompts[:b], out_len)
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for b in args.batch_sizes:
                for s in order:
                    dt, outs = s.run(prompts[:b], out_len)
                    results[(s.name, b)].append(dt)
                    if outs != outputs[(s.name, b)]:
                        print(f"  note: {s.name} batch {b} round {r + 1} differs from its own warm-up output",
                              file=sys.stderr)
                    print(f"  round {r + 1} batch {b:3d} {s.name:8s} {b * out_len / dt:8.1f} tok/s", file=sys.stderr)
    finally:
        for s in sides[1:]:
            s.close()
    print(f"\n| output tok/s (min / median / max of {args.rounds}) | " + " | ".join(
        f"batch {b}" for b in args.batch_sizes) + " |")
    print("|---|" + "---|" * len(args.batch_sizes))
    report = {"rounds": args.rounds, "output_len": out_len, "startup_s": {s.name: s.startup_s for s in sides}}
    med = {}
    for s in sides:
        cells = []
        for b in args.batch_sizes:
            lo, mid, hi = _spread([b * out_len / dt for dt in results[(s.name, b)]])
            step_ms = statistics.median(results[(s.name, b)]) / out_len * 1e3
            med[(s.name, b)] = mid
            cells.append(f"{lo:.1f} / **{mid:.1f}** / {hi:.1f} ({step_ms:.1f} ms/step)")
            report[f"{s.name}_batch{b}"] = {"tok_s_min": lo, "tok_s_median": mid, "tok_s_max": hi,
                                            "ms_per_step_median": step_ms}
        print(f"| {s.name} ({s.detail}) | " + " | ".join(cells) + " |")
    print()
    for b in args.batch_sizes:
        a, v = outputs[("pdserve", b)], outputs[("vLLM", b)]
        same = sum(x == y for x, y in zip(a, v))
        ratio = med[("pdserve", b)] / med[("vLLM", b)]
        report[f"ratio_batch{b}"] = ratio
        report[f"identical_batch{b}"] = same
        print(f"batch {b:3d}: pdserve / vLLM = {ratio:.2f}x (medians); token-identical outputs {same}/{len(a)}")
        for i, (x, y) in enumerate(zip(a, v)):
            if x != y:
                k = next(j for j, (p, q) in enumerate(zip(x, y)) if p != q)
                print(f"  prompt {i}: first disagreement at output token {k} ({x[k]} vs {y[k]})")
    print("per-step time = round time / output length (every sequence decodes once per step); "
          "start-up = engine construction, model load included")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
