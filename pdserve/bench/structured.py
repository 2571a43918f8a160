"""Structured outputs' cost in the engine: constrained against unconstrained decoding, side by side.

Two measurements on one engine (`LLMEngine`, this machine's CPU), alternating the two sides
every round so drift hits both alike:

1. **Throughput.** ``--streams`` requests decode ``--output-len`` tokens at once, all free text
   (EOS ignored) or all under a JSON schema of ``--fields`` string fields (each up to 64
   characters, all required: no schema can close within the output length, so both sides
   generate the same number of tokens). Output tokens per second of the whole run (its prompts
   included, the same on both sides); the ratio constrained / free is the figure.
2. **Compile stalls.** ``--background`` free streams decode; after ``--warm-steps`` steps,
   ``--compile-grammars`` short requests arrive, each under a JSON schema of its own of
   ``--schema-properties`` properties (the round's salt in their names): never seen before on
   one side, compiled beforehand (cached) on the other, so the two sides run the same requests
   and differ only by the compiles. The background streams' inter-token latency p50 / p99 over
   the ``--window`` steps after the arrival is the figure (the ratio compiling / cached), with
   the step by which every arrival had its first token: grammars compile off the engine
   thread, at the lowest CPU priority, so the steps should not feel them.

    python -m pdserve.bench.structured                       # the default tiny model under .cache/
    python -m pdserve.bench.structured --model DIR --rounds 5 --json out.json

Prints min / median / max over ``--rounds`` rounds of each side and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: make the tiny model under .cache/)")
    p.add_argument("--streams", type=int, default=64, help="throughput: requests decoding at once")
    p.add_argument("--output-len", type=int, default=64, help="throughput: tokens each request generates")
    p.add_argument("--fields", type=int, default=16, help="throughput: string fields of the schema")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--background", type=int, default=16, help="stalls: free streams whose ITL is measured")
    p.add_argument("--compile-grammars", type=int, default=16, help="stalls: new grammars arriving at once")
    p.add_argument("--schema-properties", type=int, default=48,
                   help="stalls: properties of each new schema (its compile time grows with them)")
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument("--arrival-len", type=int, default=8, help="stalls: prompt tokens of each arrival")
    p.add_argument("--window", type=int, default=24, help="stalls: steps after the arrival whose ITL counts")
    p.add_argument("--stall-len", type=int, default=64, help="stalls: tokens each background stream generates")
    p.add_argument("--compile-nice", type=int, default=None,
                   help="the engine's structured_outputs_compile_nice (default: the engine's, 10)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def wide_schema(fields: int) -> dict:
    props = {f"field_{i}": {"type": "string", "maxLength": 64} for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def new_schema(salt: str, n: int) -> dict:
    """A schema no earlier round compiled (the salt is in every property name)."""
    props: dict[str, dict] = {}
    for i in range(n):
        kind = i % 4
        if kind == 0:
            props[f"{salt}_s{i}"] = {"type": "string", "maxLength": 16}
        elif kind == 1:
            props[f"{salt}_n{i}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
        elif kind == 2:
            props[f"{salt}_e{i}"] = {"enum": [f"{salt}-a{i}", f"{salt}-b{i}", "c"]}
        else:
            props[f"{salt}_o{i}"] = {"type": "object", "properties": {"x": {"type": "boolean"},
                                                                     "y": {"type": "array", "maxItems": 4,
                                                                           "items": {"type": "number"}}},
                                     "required": ["x"]}
    return {"type": "object", "properties": props, "required": list(props)[: n // 2]}


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_throughput(eng, args, constrained: bool, rnd: int) -> dict:
    from pdserve.engine import SamplingParams

    spec = {"json": wide_schema(args.fields)} if constrained else None
    ps = prompts(args.streams, args.prompt_len, eng.model_config.vocab_size, args.seed + rnd)
    t0 = time.perf_counter()
    for i, p in enumerate(ps):
        eng.add_request(p, SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                                          structured_outputs=spec), request_id=f"t{rnd}-{i}")
    tokens = 0
    while eng.has_work():
        tokens += sum(len(d.new_token_ids) for d in eng.step())
    elapsed = time.perf_counter() - t0
    finished = [eng.release(f"t{rnd}-{i}") for i in range(len(ps))]
    return {"tok_s": tokens / elapsed, "tokens": tokens, "s": elapsed,
            "length_finishes": sum(o is not None and o.finish_reason == "length" for o in finished)}


def run_stalls(eng, args, compiling: bool, rnd: int) -> dict:
    """Background ITL over the ``--window`` steps after the arrivals. Both sides get the same
    arrivals, each under a schema of its own: compiled beforehand (cached) on one side, new on
    the other, so the only difference is the compiles running beside the steps."""
    from pdserve.engine import SamplingParams

    vocab = eng.model_config.vocab_size
    salt = f"r{rnd}{'c' if compiling else 'w'}{time.monotonic_ns() % 100000}"
    schemas = [new_schema(f"{salt}x{i}", args.schema_properties) for i in range(args.compile_grammars)]
    if not compiling:
        for schema in schemas:  # cached before they arrive
            eng.validate_input([5], SamplingParams(structured_outputs={"json": schema}))
    bg = prompts(args.background, args.prompt_len, vocab, args.seed + 100 + rnd)
    for i, p in enumerate(bg):
        eng.add_request(p, SamplingParams(max_tokens=args.stall_len, temperature=0.0, ignore_eos=True),
                        request_id=f"bg{rnd}-{i}")
    background = {f"bg{rnd}-{i}" for i in range(len(bg))}
    for _ in range(args.warm_steps):
        eng.step()
    arrivals = prompts(args.compile_grammars, args.arrival_len, vocab, args.seed + 200 + rnd)
    waiting = set()
    for i, (p, schema) in enumerate(zip(arrivals, schemas)):
        eng.add_request(p, SamplingParams(max_tokens=16, temperature=0.0, structured_outputs={"json": schema}),
                        request_id=f"new{rnd}-{i}")
        waiting.add(f"new{rnd}-{i}")
    last = arrived = time.perf_counter()
    itl_ms: list[float] = []
    steps = admitted_at = 0
    admitted_ms = 0.0
    while eng.has_work():
        deltas = eng.step()
        now = time.perf_counter()
        steps += 1
        waiting -= {d.request_id for d in deltas if d.new_token_ids or d.finished}
        if not waiting and not admitted_at:
            admitted_at, admitted_ms = steps, (now - arrived) * 1e3
        if steps <= args.window and any(d.request_id in background and d.new_token_ids for d in deltas):
            itl_ms.append((now - last) * 1e3)
        last = now
    for rid in list(background) + [f"new{rnd}-{i}" for i in range(len(arrivals))]:
        eng.release(rid)
    itl_ms.sort()
    p99 = itl_ms[min(len(itl_ms) - 1, int(0.99 * len(itl_ms)))]
    return {"itl_p50_ms": statistics.median(itl_ms), "itl_p99_ms": p99, "steps": len(itl_ms),
            "all_first_tokens_after_steps": admitted_at, "all_first_tokens_after_ms": admitted_ms}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.bench.engine_throughput import default_model
    from pdserve.engine import LLMEngine
    from pdserve.engine.config import EngineConfig

    model = args.model or default_model()
    extra = {} if args.compile_nice is None else {"structured_outputs_compile_nice": args.compile_nice}
    eng = LLMEngine(EngineConfig.from_kwargs(model, enable_prefix_caching=False, **extra))
    # warm-up: the kernels and one grammar of each shape
    run_throughput(eng, argparse.Namespace(**{**vars(args), "streams": 4, "output_len": 4}), True, -1)
    run_throughput(eng, argparse.Namespace(**{**vars(args), "streams": 4, "output_len": 4}), False, -1)
    res: dict[str, dict[str, list[float]]] = {"throughput": {"free": [], "constrained": []},
                                              "stalls_p99": {"cached": [], "compiling": []},
                                              "stalls_p50": {"cached": [], "compiling": []},
                                              "first_tokens_ms": {"cached": [], "compiling": []}}
    for rnd in range(args.rounds):
        order = [False, True] if rnd % 2 == 0 else [True, False]
        for constrained in order:
            t = run_throughput(eng, args, constrained, rnd)
            res["throughput"]["constrained" if constrained else "free"].append(t["tok_s"])
            print(f"round {rnd} throughput {'constrained' if constrained else 'free'}: {t['tok_s']:.1f} tok/s "
                  f"({t['tokens']} tokens, {t['length_finishes']}/{args.streams} ran to length)", file=sys.stderr)
        for constrained in order:
            s = run_stalls(eng, args, constrained, rnd)
            side = "compiling" if constrained else "cached"
            res["stalls_p99"][side].append(s["itl_p99_ms"])
            res["stalls_p50"][side].append(s["itl_p50_ms"])
            res["first_tokens_ms"][side].append(s["all_first_tokens_after_ms"])
            print(f"round {rnd} stalls {side}: ITL p50 {s['itl_p50_ms']:.1f} ms p99 {s['itl_p99_ms']:.1f} ms "
                  f"over {s['steps']} steps; every arrival had its first token after "
                  f"{s['all_first_tokens_after_steps']} steps ({s['all_first_tokens_after_ms']:.0f} ms)",
                  file=sys.stderr)
    eng.close()
    tp = res["throughput"]
    out = {
        "config": {k: v for k, v in vars(args).items() if k != "json"} | {"model": model},
        "throughput_tok_s": {k: spread(v) for k, v in tp.items()},
        "throughput_ratio": statistics.median(tp["constrained"]) / statistics.median(tp["free"]),
        "background_itl_p99_ms": {k: spread(v) for k, v in res["stalls_p99"].items()},
        "background_itl_p50_ms": {k: spread(v) for k, v in res["stalls_p50"].items()},
        "arrivals_all_first_tokens_ms": {k: spread(v) for k, v in res["first_tokens_ms"].items()},
        "itl_p99_ratio": (statistics.median(res["stalls_p99"]["compiling"])
                          / statistics.median(res["stalls_p99"]["cached"])),
    }
    for name, d in (("throughput tok/s", out["throughput_tok_s"]),
                    ("background ITL p99 ms", out["background_itl_p99_ms"]),
                    ("arrivals' first tokens ms", out["arrivals_all_first_tokens_ms"])):
        for side, s in d.items():
            print(f"{name:22s} {side:12s} min {s['min']:8.2f}  median {s['median']:8.2f}  max {s['max']:8.2f}")
    print(f"constrained / free throughput (medians): {out['throughput_ratio']:.3f}x (target >= 0.9x)")
    print(f"background ITL p99 while {args.compile_grammars} new grammars compile / with them cached (medians): "
          f"{out['itl_p99_ratio']:.3f}x (target <= 1.2x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
