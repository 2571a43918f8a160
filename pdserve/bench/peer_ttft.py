"""One request at a time: time to first token by prompt length, pdserve against `vllm serve`.

    python bench/peer_ttft.py --cpus 0,1                        # vllm and colocated, 100-950 tokens
    python bench/peer_ttft.py --systems vllm,colocated --lengths 100,500,950 --reps 10

Under load a TTFT p99 (bench/peer_serve.py) is the longest prompts' prefill plus the queue in
front of them; this separates the first part. Each system is started as bench/peer_serve.py
starts it (same cores, same model directory, same engine limits) and sent, one at a time with
``--gap-s`` between them, streaming ``/v1/completions`` requests of ``max_tokens`` 1 whose
prompts are random token ids: every request its own prompt, so no prefix cache helps (seeded by
length and repetition: every system gets the same prompts). TTFT is the time to the first streamed chunk, as
`vllm bench serve` measures it. The table gives, per length, each system's median [min-max]
over ``--reps`` requests (after ``--warmup`` discarded ones) and vLLM's median over the system's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.bench.peer_serve import SERVED_NAME, PeerConfig, Server

LENGTHS = (100, 250, 500, 750, 950)


def first_token_ms(url: str, prompt: list[int], timeout_s: float = 60.0) -> float:
    """One streaming completion of ``prompt`` (token ids), max_tokens 1: ms to its first chunk."""
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "stream": True,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for line in resp:
            if line.startswith(b"data:"):
                ms = (time.perf_counter() - t0) * 1000.0
                resp.read()  # the rest of the stream, so the next request starts on an idle server
                return ms
    raise RuntimeError(f"{url}: the stream ended without a chunk")


def probe(url: str, lengths, reps: int, warmup: int, gap_s: float, vocab: int, seed: int) -> dict:
    """Per length: the TTFTs (ms) of ``reps`` requests, each with a prompt of its own."""
    out: dict[str, list[float]] = {}
    for n in lengths:
        times = []
        for rep in range(warmup + reps):
            rng = random.Random(f"{seed}-{n}-{rep}")
            ms = first_token_ms(url, [rng.randrange(100, vocab) for _ in range(n)])
            if rep >= warmup:
                times.append(ms)
            time.sleep(gap_s)
        out[str(n)] = times
    return out


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def format_table(doc: dict) -> str:
    systems = list(doc["results"])
    head = "| prompt tokens | " + " | ".join(f"{s} TTFT ms" for s in systems)
    others = [s for s in systems if s != "vllm"]
    if "vllm" in systems:
        head += " | " + " | ".join(f"{s} vs vLLM" for s in others)
    lines = [head + " |", "|" + "---|" * (1 + len(systems) + (len(others) if "vllm" in systems else 0))]
    for n in doc["config"]["lengths"]:
        row = [str(n)]
        stats = {s: summary(doc["results"][s][str(n)]) for s in systems}
        row += [f"{v['median']:.1f} [{v['min']:.1f}-{v['max']:.1f}]" for v in stats.values()]
        if "vllm" in systems:  # vLLM's median over the system's: above 1.0x the system is faster
            row += [f"{stats['vllm']['median'] / stats[s]['median']:.2f}x" for s in others]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from pdserve.bench.host import add_autogroup_option, autogroups_off

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--systems", default="vllm,colocated", help="vllm, colocated, 1p1d (as bench/peer_serve.py)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=10, help="requests per length and system (each its own prompt)")
    p.add_argument("--warmup", type=int, default=2, help="requests per length discarded first")
    p.add_argument("--gap-s", type=float, default=0.2, help="idle time between two requests")
    p.add_argument("--cpus", default="", help="cores for every server, e.g. 0,1 (default: all of this process's)")
    p.add_argument("--model", default="", help="model directory (default: the one `pdserve up` makes)")
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--work-dir", default=str(Path(PeerConfig().work_dir).with_name("peer-ttft")))
    p.add_argument("--output", default=None, help="write the JSON document (every TTFT) here too")
    add_autogroup_option(p)
    args = p.parse_args(argv)
    cfg = PeerConfig(systems=args.systems.split(","), cpus=args.cpus, model=args.model, port=args.port,
                     work_dir=args.work_dir)
    if not cfg.model:
        from pdserve.bench.sweep import base_model_dir

        cfg.model = base_model_dir(cfg.topology)
    vocab = json.loads((Path(cfg.model) / "config.json").read_text())["vocab_size"]
    lengths = [int(n) for n in args.lengths.split(",")]
    doc: dict = {"config": {**vars(args), "lengths": lengths, "model": cfg.model}, "results": {}}
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    with autogroups_off(args.autogroups) as host:
        for system in cfg.systems:
            server = Server(cfg, system, log)
            try:
                server.start()
                doc["results"][system] = probe(server.url, lengths, args.reps, args.warmup, args.gap_s, vocab, seed=0)
                log(f"{system}: " + ", ".join(f"{n}: {statistics.median(t):.1f} ms"
                                             for n, t in doc["results"][system].items()))
            finally:
                server.stop()
    doc["host"] = host
    print(format_table(doc))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
