"""Speculative decoding in the engine: n-gram (or draft-model) proposals against none, at
several batch sizes.

One engine (`LLMEngine`, this machine's device), its speculation switched on and off between
runs (the same weights and pool on both sides), the two sides alternating every round so that
drift hits both alike. The workload is one where proposals can be accepted: each prompt is a
random prefix P, the model's own greedy continuation C of P (``--echo-len`` tokens, computed
first without speculation), then P again, so that what the model writes next is likely C
again, which prompt lookup finds in the prompt (``--workload repeat`` instead: a random phrase
of ``--prefix-len`` tokens said over and over, for a model, such as the random tiny one, whose
continuation of P is not stable). Each request generates ``--output-len`` tokens
greedily (EOS ignored).

For each batch size of ``--batches`` and each side: output tokens per second of the whole run
(prompts included, the same on both sides), TPOT p50 (per request: (last token time - first
token time) / (tokens - 1), then the median over requests), and beside the n-gram figures
the acceptance rate (accepted / proposed tokens) and the mean tokens per verification.
The load rule applies as configured (``--disable-by-batch-size``: at a larger batch no
request speculates, so that side is the plain engine).

    python -m pdserve.bench.spec                        # the default tiny model under .cache/
    python -m pdserve.bench.spec --batches 1,2 --rounds 1 --output-len 16   # a quick smoke run
    python -m pdserve.bench.spec --model DIR --device cuda --rounds 5 --json out.json
    python -m pdserve.bench.spec --method draft_model --draft-model SMALL_DIR --model DIR   # a draft model
    python -m pdserve.bench.spec --method draft_model --draft-layers 1 --model DIR   # the target's first layer

With ``--method draft_model`` the speculating side's proposals are the draft model's (its
``--num-speculative-tokens`` tokens, engine/spec_draft.py) and its label is
``draft_model`` instead of ``ngram``.

``--temperature T`` makes every request sample (unseeded) at T instead of greedily. With a draft
model, ``--draft-sampling`` says how its proposals are made: ``probabilistic`` (drawn from the
draft's distribution and verified against it), ``greedy`` (its argmax) or ``both``: two
speculating sides in the same run, ``draft_model:drawn`` and ``draft_model:argmax``, each
against the same plain side.

    python -m pdserve.bench.spec --method draft_model --draft-layers 1 --damp-after 0.1 \
        --temperature 1 --draft-sampling both --batches 1,8 --rounds 5   # drawn vs argmax proposals

Prints min / median / max over ``--rounds`` rounds of each figure and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: make the tiny model under .cache/)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batches", default="1,8,64", help="batch sizes, comma-separated")
    p.add_argument("--workload", choices=("echo", "repeat"), default="echo")
    p.add_argument("--prefix-len", type=int, default=32, help="tokens of each prompt's random prefix P")
    p.add_argument("--echo-len", type=int, default=64, help="tokens of the model's own continuation C in the prompt")
    p.add_argument("--output-len", type=int, default=64, help="tokens each request generates")
    p.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    p.add_argument("--draft-model", default=None, help="the draft model's dir (--method draft_model)")
    p.add_argument("--damp-after", type=float, default=None, metavar="SCALE",
                   help="with --draft-layers on a random model: benchmark a copy of the target whose layers "
                        "after the draft's have their output projections (o_proj, down_proj) scaled by SCALE, "
                        "so that the early-exit draft agrees with it in part (random layers otherwise "
                        "scramble the output: acceptance 0); the target still computes every layer")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="--method draft_model without a draft: make one from the target's first N layers "
                        "(its embeddings, final norm and LM head kept; written once beside the target "
                        "under .cache/models), an early-exit draft with the target's tokenizer")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="the load rule's batch threshold (default: the engine's, 32)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--disable-by-cost", choices=("auto", "on", "off"), default="auto",
                   help="speculative_config.disable_by_cost: auto (the engine's default: on for a draft model "
                        "or EAGLE head, off for n-gram), on, or off (every step under the batch rule speculates)")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="unmeasured rounds of both sides at each batch size first (the kernels warm, and "
                        "the measured-cost rule of a draft model or EAGLE head has its figures)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the requests' temperature (default 0: greedy); above 0 they sample, unseeded")
    p.add_argument("--draft-sampling", choices=("probabilistic", "greedy", "both"), default="probabilistic",
                   help="--method draft_model: proposals drawn from the draft's distribution, its argmax, or "
                        "both as two sides of one run (default probabilistic)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def first_layers_draft(model_dir: str, layers: int) -> str:
    """A draft model made of ``model_dir``'s first ``layers`` decoder layers, with its embeddings,
    final norm, LM head and tokenizer (an early-exit draft, as in LayerSkip): written once to
    ``<model_dir>-first<layers>`` and reused."""
    import shutil

    from safetensors.torch import load_file, save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    total = int(cfg.get("num_hidden_layers", 0))
    if not 1 <= layers < total:
        raise SystemExit(f"--draft-layers: between 1 and {total - 1} for this {total}-layer model, not {layers}")
    out = f"{model_dir.rstrip('/')}-first{layers}"
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weights: dict = {}
    for name in sorted(os.listdir(model_dir)):
        src = os.path.join(model_dir, name)
        if name.endswith(".safetensors"):
            for key, value in load_file(src).items():
                parts = key.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                    continue
                weights[key] = value
        elif name not in ("config.json", "model.safetensors.index.json") and os.path.isfile(src):
            shutil.copy(src, tmp)
    save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    cfg["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists follow the kept layers
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:layers]
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, out)
    return out


def damped_target(model_dir: str, keep: int, scale: float) -> str:
    """A copy of ``model_dir`` whose layers from ``keep`` on add ``scale`` times their attention
    and MLP outputs to the residual (o_proj and down_proj scaled): a random model standing in for a
    trained one whose first layers already predict most tokens. Written once, reused."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = f"{model_dir.rstrip('/')}-damped{keep}x{scale:g}"
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp)
    for name in os.listdir(tmp):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(tmp, name)
        weights = load_file(path)
        for key in weights:
            parts = key.split(".")
            if ("layers" in parts and int(parts[parts.index("layers") + 1]) >= keep
                    and parts[-2] in ("o_proj", "down_proj")):
                weights[key] = weights[key] * scale
        save_file(weights, path, metadata={"format": "pt"})
    os.replace(tmp, out)
    return out


def spec_config(args) -> dict:
    if args.method == "draft_model":
        if args.damp_after is not None:
            if args.draft_layers is None:
                raise SystemExit("--damp-after needs --draft-layers N")
            args.model = damped_target(args.model, args.draft_layers, args.damp_after)
        if args.draft_layers is not None and not args.draft_model:
            args.draft_model = first_layers_draft(args.model, args.draft_layers)
        if not args.draft_model:
            raise SystemExit("--method draft_model needs --draft-model DIR or --draft-layers N")
        cfg = {"method": "draft_model", "model": args.draft_model,
               "num_speculative_tokens": args.num_speculative_tokens,
               "draft_sampling": "greedy" if args.draft_sampling == "greedy" else "probabilistic"}
    else:
        cfg = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
               "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    if args.disable_by_batch_size is not None:
        cfg["disable_by_batch_size"] = args.disable_by_batch_size
    if args.disable_by_cost != "auto":
        cfg["disable_by_cost"] = args.disable_by_cost == "on"
    return cfg


def echo_prompts(eng, args, n: int) -> list[list[int]]:
    """P + C + P for ``n`` random prefixes P (C: the model's greedy continuation of P)."""
    from pdserve.engine import SamplingParams

    rng = random.Random(args.seed)
    vocab = eng.model_config.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(args.prefix_len)] for _ in range(n)]
    if args.workload == "repeat":
        return [(p * (2 + args.echo_len // len(p)))[:2 * args.prefix_len + args.echo_len] for p in prefixes]
    ids = [eng.add_request(p, SamplingParams(max_tokens=args.echo_len, temperature=0.0, ignore_eos=True)).request_id
           for p in prefixes]
    while eng.has_work():
        eng.step()
    outs = [eng.release(i) for i in ids]
    return [p + list(o.token_ids) + p for p, o in zip(prefixes, outs) if o is not None]


def run_once(eng, prompts: list[list[int]], output_len: int, tag: str, temperature: float = 0.0) -> dict:
    from pdserve.engine import SamplingParams

    s = eng.stats
    proposed0, accepted0, drafts0 = s.num_spec_draft_tokens, s.num_spec_accepted_tokens, s.num_spec_drafts
    t0 = time.perf_counter()
    rids = [eng.add_request(p, SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True),
                            request_id=f"{tag}-{i}").request_id for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    tokens = 0
    while eng.has_work():
        deltas = eng.step()
        now = time.perf_counter()
        for d in deltas:
            if d.new_token_ids:
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                count[d.request_id] = count.get(d.request_id, 0) + len(d.new_token_ids)
                tokens += len(d.new_token_ids)
    elapsed = time.perf_counter() - t0
    for r in rids:
        eng.release(r)
    tpots = [(last[r] - first[r]) / (count[r] - 1) for r in rids if count.get(r, 0) > 1]
    proposed, accepted = s.num_spec_draft_tokens - proposed0, s.num_spec_accepted_tokens - accepted0
    drafts = s.num_spec_drafts - drafts0
    return {"tok_s": tokens / elapsed, "tpot_p50_ms": 1e3 * statistics.median(tpots) if tpots else float("nan"),
            "acceptance": accepted / proposed if proposed else 0.0, "proposed": proposed,
            "tokens_per_verification": (accepted + drafts) / drafts if drafts else 1.0}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def speculating_sides(args) -> list[str]:
    """The speculating sides' labels: the method's, or with ``--draft-sampling both`` one per way
    of proposing."""
    if args.method == "draft_model" and args.draft_sampling == "both":
        return [f"{args.method}:drawn", f"{args.method}:argmax"]
    return [args.method]


def use_side(eng, decoder, side: str, costs: dict) -> None:
    """Speculation off (``off``) or on, with the side's way of proposing and its own
    measured-cost rule (``costs``, by side: one side's step times must not decide for another)."""
    eng.spec = None if side == "off" else decoder
    if side != "off" and decoder.draft is not None and ":" in side:
        decoder.draft.sample_drafts = side.endswith(":drawn")
    if side != "off" and decoder.cost is not None:
        from pdserve.engine.spec_cost import SpecCostRule

        decoder.cost = costs.setdefault(side, decoder.cost if not costs else SpecCostRule())


def measure(eng, decoder, prompts: list[list[int]], args) -> dict:
    """Every batch size, every side, ``--rounds`` rounds (the sides' order rotating): each
    figure's values."""
    res: dict = {}
    sides = ["off", *speculating_sides(args)]
    costs: dict = {}
    for b in [int(x) for x in args.batches.split(",")]:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for rnd in range(args.warmup_rounds):  # unmeasured: each side's kernels, and the cost rule's figures
            for side in sides:
                use_side(eng, decoder, side, costs)
                run_once(eng, batch, args.output_len, f"b{b}-warm{rnd}-{side}", args.temperature)
        for rnd in range(args.rounds):
            for side in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
                use_side(eng, decoder, side, costs)
                r = run_once(eng, batch, args.output_len, f"b{b}-{rnd}-{side}", args.temperature)
                runs[side].append(r)
                print(f"batch {b} round {rnd} {side:11s}: {r['tok_s']:8.1f} tok/s  TPOT p50 {r['tpot_p50_ms']:7.2f} ms"
                      + (f"  acceptance {r['acceptance']:.2f}" if side != "off" else ""), file=sys.stderr)
        res[b] = {side: {k: spread([r[k] for r in rs]) for k in rs[0]} for side, rs in runs.items()}
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.bench.engine_throughput import default_model
    from pdserve.engine import LLMEngine
    from pdserve.engine.config import EngineConfig

    model = args.model = args.model or default_model()
    batches = [int(x) for x in args.batches.split(",")]
    spec = spec_config(args)  # (--damp-after: the target is the damped copy)
    model = args.model
    eng = LLMEngine(EngineConfig.from_kwargs(model, device=args.device, enable_prefix_caching=False,
                                             max_num_seqs=max(batches), speculative_config=spec))
    decoder = eng.spec
    eng.spec = None
    prompts = echo_prompts(eng, args, min(max(batches), 16))
    run_once(eng, prompts[:2], 4, "warm")  # warm-up: the kernels of both sides
    eng.spec = decoder
    run_once(eng, prompts[:2], 4, f"warm-{args.method}")
    res = measure(eng, decoder, prompts, args)
    eng.close()
    print(f"{'batch':>5s} {'side':18s} {'tok/s (median)':>15s} {'TPOT p50 ms':>12s} {'acceptance':>10s} "
          f"{'tok/verif':>9s}")
    for b, sides in res.items():
        for side, figs in sides.items():
            acc = f"{figs['acceptance']['median']:10.2f} {figs['tokens_per_verification']['median']:9.2f}" \
                if side != "off" else f"{'':10s} {'':9s}"
            print(f"{b:5d} {side:18s} {figs['tok_s']['median']:15.1f} {figs['tpot_p50_ms']['median']:12.2f} {acc}")
        for side in speculating_sides(args):
            speed = sides[side]["tok_s"]["median"] / sides["off"]["tok_s"]["median"]
            print(f"{b:5d} {side} / off tokens/s (medians): {speed:.3f}x")
    if args.json:
        out = {"config": {k: v for k, v in vars(args).items() if k != "json"} | {"model": model},
               "results": {str(b): sides for b, sides in res.items()}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
