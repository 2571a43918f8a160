"""`pdserve policy check|explain`: validate policy files offline, and show
what the router would do with one request on a described cluster.

The only module of pdserve.router that reads files and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from pdserve.common.spec_rule import spec_k, tokens_per_step
from pdserve.router.costs import BYTES_PER_MS_PER_GB_PER_S, CostEstimates
from pdserve.router.decide import decide
from pdserve.router.loader import PolicyError, detect_kind, load_policy_file, parse_any
from pdserve.router.qos import admit
from pdserve.router.values import ClusterSnapshot, RequestFeatures

# Llama-3-8B in bf16: 128 KiB of KV per token; the worker passes its model's value.
DEFAULT_KV_BYTES_PER_TOKEN = 128 * 1024


def costs_line(costs) -> str:
    """The cost estimates a decision used, in one line (this explain and `pdserve sim run --explain`)."""
    return (f"prefill local {costs.prefill_local_ms_per_token:.4g} ms/token, remote "
            f"{costs.prefill_remote_ms_per_token:.4g} ms/token; transfer "
            f"{costs.transfer_bytes_per_ms / BYTES_PER_MS_PER_GB_PER_S:g} GB/s + "
            f"{costs.transfer_setup_ms:.4g} ms setup, {costs.kv_bytes_per_token} B/token; decode "
            f"{costs.decode_ms_per_token:.4g} ms/token, step {costs.decode_step_ms:.4g} ms; TTFT residual local "
            f"{costs.ttft_residual_local_ms:.3g} ms, remote {costs.ttft_residual_remote_ms:.3g} ms")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``policy`` with its ``check`` and ``explain`` subcommands."""
    policy = subparsers.add_parser(
        "policy",
        help="validate router/autoscale policy files; explain a routing decision",
        description="Validate router and autoscale policy YAML, or explain the routing "
        "and admission decision for one request on a described cluster.",
    )
    policy.set_defaults(func=lambda args: _usage(policy))
    sub = policy.add_subparsers(dest="policy_command", metavar="SUBCOMMAND")

    check = sub.add_parser(
        "check",
        help="validate policy files (router or autoscale, detected per file)",
        description="Validate each FILE against its schema. A file with a top-level "
        "`autoscale` key is an autoscale policy, anything else a router policy. Prints "
        "OK or every problem as FILE:LINE:COLUMN: key.path: message. Exit 0 if all are valid, 1 otherwise.",
    )
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(func=run_check)

    explain = sub.add_parser(
        "explain",
        help="print the routing + admission decision for one request, step by step",
        description="Load a router policy and print what it decides for one request: "
        "route, reason, predicted TTFT of each route, the reasoning line by line, and "
        "the QoS admission. Costs default to the policy's seeds (what a fresh worker uses).",
    )
    explain.add_argument("file", metavar="FILE", help="router policy YAML")
    req = explain.add_argument_group("request")
    req.add_argument("--prompt-len", type=int, metavar="N", required=True, help="prompt tokens")
    req.add_argument("--cached-len", type=int, metavar="N", default=0,
                     help="prompt tokens already in the prefix cache")
    req.add_argument("--remote-cached-len", type=int, metavar="N", default=0,
                     help="prompt tokens the prefill worker with the longest cached prefix holds")
    req.add_argument("--peer-reads", action="store_true",
                     help="this worker borrows prefixes: a local prefill reads --remote-cached-len past "
                          "--cached-len from the prefill worker holding it, when cheaper")
    req.add_argument("--tier-cached-len", type=int, metavar="N", default=0,
                     help="prompt tokens past --cached-len that this worker's second KV tier holds "
                          "(kv_offload_bytes): loaded back instead of computed when cheaper")
    req.add_argument("--priority", choices=("high", "normal", "low"), default="normal")
    req.add_argument("--override", choices=("auto", "local", "remote"), default="auto")
    req.add_argument("--ttft-slo-ms", type=float, metavar="MS", default=None,
                     help="the request's own TTFT target")
    req.add_argument("--max-tokens", type=int, metavar="N", default=None)
    req.add_argument("--lora-adapter", action="store_true",
                     help="it runs under a LoRA adapter (docs/lora.md): remote only with --lora-pool-size > 0")
    req.add_argument("--lora-held-remote", action="store_true",
                     help="a prefill worker holds its adapter already (else the remote route loads it first: "
                          "--lora-load-ms)")
    cl = explain.add_argument_group("cluster snapshot")
    cl.add_argument("--queue-depth", type=int, metavar="N", default=0, help="tasks in the prefill queue")
    cl.add_argument("--queue-tokens", type=int, metavar="N", default=0, help="tokens in the prefill queue")
    cl.add_argument("--pool-size", type=int, metavar="N", default=1,
                    help="live prefill workers (0 = empty pool)")
    cl.add_argument("--decode-active", type=int, metavar="N", default=0,
                    help="requests decoding on this worker")
    cl.add_argument("--decode-waiting", type=int, metavar="N", default=0,
                    help="requests waiting on this worker")
    cl.add_argument("--local-queue-tokens", type=int, metavar="N", default=0,
                    help="tokens waiting for local prefill on this worker")
    cl.add_argument("--decode-backlog-tokens", type=int, metavar="N", default=0,
                    help="decode tokens ahead of a new request's slot")
    cl.add_argument("--kv-usage", type=float, metavar="F", default=0.0, help="KV usage of this worker, 0-1")
    cl.add_argument("--arrival-rate", type=float, metavar="R", default=0.0,
                    help="requests/s this worker receives (the cost model's blocking penalty)")
    cl.add_argument("--lora-pool-size", type=int, metavar="N", default=0,
                    help="live prefill workers that run LoRA adapters (enable_lora; at most --pool-size)")
    co = explain.add_argument_group("calibrated costs (default: the policy's seeds)")
    co.add_argument("--kv-bytes-per-token", type=int, metavar="N", default=DEFAULT_KV_BYTES_PER_TOKEN,
                    help="KV bytes per token of the model (default: Llama-3-8B bf16, 131072)")
    co.add_argument("--prefill-local-ms-per-token", type=float, metavar="MS")
    co.add_argument("--prefill-remote-ms-per-token", type=float, metavar="MS")
    co.add_argument("--decode-ms-per-token", type=float, metavar="MS")
    co.add_argument("--decode-step-ms", type=float, metavar="MS")
    co.add_argument("--transfer-gb-per-s", type=float, metavar="GBPS")
    co.add_argument("--transfer-setup-ms", type=float, metavar="MS")
    co.add_argument("--lora-load-ms", type=float, metavar="MS",
                    help="a prefill worker loading a LoRA adapter it does not hold (default: the policy's "
                         "cost_model.lora_load_ms)")
    co.add_argument("--tier-load-ms-per-token", type=float, metavar="MS",
                    help="loading one token's KV back from the second tier (default 0: free beside computing)")
    sp = explain.add_argument_group("speculative decoding on this worker (speculative_config; default: none)")
    sp.add_argument("--spec-k", type=int, metavar="K", default=0,
                    help="num_speculative_tokens: proposals per step (0 = the worker does not speculate)")
    sp.add_argument("--spec-disable-by-batch-size", type=int, metavar="N", default=32,
                    help="disable_by_batch_size: no proposals in a step whose running batch is larger (default 32)")
    sp.add_argument("--spec-acceptance", type=float, metavar="F", default=None,
                    help="the fraction of proposals accepted (0-1; a worker's pdserve_spec_decode_* metrics): "
                         "a stream then gets 1 + F + ... + F^k tokens a step, and the TPOT the router uses is "
                         "--decode-step-ms over that")
    explain.set_defaults(func=run_explain)


def run_check(args: argparse.Namespace) -> int:
    """``pdserve policy check FILE...``: 0 if every file is valid, else 1."""
    failed = 0
    for name in args.files:
        try:
            with open(name, encoding="utf-8") as f:
                text = f.read()
            kind, policy = detect_kind(text, name), parse_any(text, name)
        except PolicyError as exc:
            failed += 1
            print(f"{name}: INVALID", file=sys.stdout)
            print(str(exc), file=sys.stdout)
            continue
        except OSError as exc:
            failed += 1
            print(f"{name}: cannot read: {exc.strerror or exc}")
            continue
        summary = ""
        if kind == "router":
            summary = f", mode {policy.router.mode}"
            if policy.router.mode == "conditional":
                summary += f", policy {policy.router.policy}"
        print(f"{name}: OK ({kind} policy{summary})")
    return 1 if failed else 0


def run_explain(args: argparse.Namespace) -> int:
    """``pdserve policy explain FILE --prompt-len N ...``: print decision and reasoning."""
    try:
        _check_snapshot_flags(args)
        policy = load_policy_file(args.file)
        costs = _costs(args, policy)
        features = RequestFeatures(
            prompt_len=args.prompt_len, cached_len=args.cached_len, remote_cached_len=args.remote_cached_len,
            tier_cached_len=args.tier_cached_len, peer_reads=args.peer_reads,
            priority=args.priority,
            ttft_slo_ms=args.ttft_slo_ms, override=args.override, max_tokens=args.max_tokens,
            lora_adapter=args.lora_adapter, lora_held_remote=args.lora_held_remote,
        )
        snapshot = ClusterSnapshot(
            costs=costs,
            prefill_queue_depth=args.queue_depth,
            prefill_queue_tokens=args.queue_tokens,
            prefill_pool_size=args.pool_size,
            decode_active_requests=args.decode_active,
            decode_waiting_requests=args.decode_waiting,
            local_prefill_queue_tokens=args.local_queue_tokens,
            decode_backlog_tokens=args.decode_backlog_tokens,
            decode_kv_usage=args.kv_usage,
            arrival_rate_per_s=args.arrival_rate,
            lora_pool_size=min(args.lora_pool_size, args.pool_size),
        )
        snapshot = _speculating(args, snapshot)
    except PolicyError as exc:
        print(f"{args.file}: INVALID\n{exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"pdserve policy explain: error: {exc}", file=sys.stderr)
        return 1

    decision = decide(features, snapshot, policy, explain=True)
    admission = admit(features, snapshot, policy)
    r = policy.router
    print(f"policy: {args.file} (mode {r.mode}, policy {r.policy})")
    print(
        f"request: prompt_len {features.prompt_len}, cached_len {features.cached_len}, "
        f"remote_cached_len {features.remote_cached_len}, tier_cached_len {features.tier_cached_len}, "
        f"eff_len {features.eff_len}, priority {features.priority.label}, override {features.override}"
    )
    print(
        f"cluster: prefill queue {snapshot.prefill_queue_depth} tasks / "
        f"{snapshot.prefill_queue_tokens} tokens, pool {snapshot.prefill_pool_size} workers, "
        f"decode {snapshot.decode_active_requests} active / {snapshot.decode_waiting_requests} waiting, "
        f"kv usage {snapshot.decode_kv_usage:.2f}, arrivals {snapshot.arrival_rate_per_s:g}/s"
    )
    print(f"costs: {costs_line(costs)}")
    print("reasoning:")
    for line in decision.trace:
        print(f"  {line}")
    score = "" if decision.score is None else f", score {decision.score:g}"
    print(f"decision: {decision.route} ({decision.reason}{score})")
    print(
        f"predicted TTFT: local {decision.predicted_ttft_local_ms:.1f} ms, "
        f"remote {decision.predicted_ttft_remote_ms:.1f} ms"
    )
    verdict = "admit" if admission.ok else "refuse"
    print(f"admission: {verdict} ({admission.reason}): {admission.detail}")
    return 0


def _costs(args: argparse.Namespace, policy) -> CostEstimates:
    if args.kv_bytes_per_token <= 0:
        raise ValueError(f"--kv-bytes-per-token must be > 0 (got {args.kv_bytes_per_token})")
    flags = {  # estimate name -> (flag, value given)
        "prefill_local_ms_per_token": ("--prefill-local-ms-per-token", args.prefill_local_ms_per_token),
        "prefill_remote_ms_per_token": ("--prefill-remote-ms-per-token", args.prefill_remote_ms_per_token),
        "decode_ms_per_token": ("--decode-ms-per-token", args.decode_ms_per_token),
        "decode_step_ms": ("--decode-step-ms", args.decode_step_ms),
        "transfer_bytes_per_ms": ("--transfer-gb-per-s", args.transfer_gb_per_s),
        "transfer_setup_ms": ("--transfer-setup-ms", args.transfer_setup_ms),
        "tier_load_ms_per_token": ("--tier-load-ms-per-token", args.tier_load_ms_per_token),
        "lora_load_ms": ("--lora-load-ms", args.lora_load_ms),
    }
    changes = {}
    for name, (flag, value) in flags.items():
        if value is None:
            continue
        if value < 0 or (value == 0 and name not in ("transfer_setup_ms", "tier_load_ms_per_token", "lora_load_ms")):
            raise ValueError(f"{flag} must be > 0 (got {value})")
        changes[name] = value * BYTES_PER_MS_PER_GB_PER_S if name == "transfer_bytes_per_ms" else value
    seeded = CostEstimates.seed(policy.router.cost_model, args.kv_bytes_per_token)
    return dataclasses.replace(seeded, **changes)


def _speculating(args: argparse.Namespace, snapshot: ClusterSnapshot) -> ClusterSnapshot:
    """``snapshot`` with the worker's speculative decoding from the --spec-* flags: the k a new
    stream gets (the engine's load rule, common/spec_rule.py) and, with --spec-acceptance, the
    tokens a step then gives it, the decode step's time divided by them (what a speculating
    worker's cost model measures)."""
    if not 0 <= args.spec_k <= 16:
        raise ValueError(f"--spec-k is num_speculative_tokens, 0-16 (got {args.spec_k})")
    if args.spec_disable_by_batch_size < 1:
        raise ValueError(f"--spec-disable-by-batch-size must be >= 1 (got {args.spec_disable_by_batch_size})")
    acceptance = args.spec_acceptance
    if acceptance is not None and not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"--spec-acceptance is a fraction 0-1 (got {acceptance})")
    if acceptance is not None and not args.spec_k:
        raise ValueError("--spec-acceptance needs --spec-k (the worker's num_speculative_tokens)")
    if not args.spec_k:
        return snapshot
    k = spec_k(args.spec_k, args.spec_disable_by_batch_size, snapshot.decode_active_requests + 1)
    per_step = tokens_per_step(k, acceptance) if acceptance is not None else 1.0
    costs = dataclasses.replace(snapshot.costs, decode_step_ms=snapshot.costs.decode_step_ms / per_step)
    return dataclasses.replace(snapshot, costs=costs, spec_k=k, spec_tokens_per_step=per_step)


def _check_snapshot_flags(args: argparse.Namespace) -> None:
    for flag in ("queue_depth", "queue_tokens", "pool_size", "decode_active", "decode_waiting",
                 "local_queue_tokens", "decode_backlog_tokens", "lora_pool_size"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0 (got {getattr(args, flag)})")
    if not (args.arrival_rate >= 0.0 and math.isfinite(args.arrival_rate)):
        raise ValueError(f"--arrival-rate is requests per second >= 0 (got {args.arrival_rate})")
    if not 0.0 <= args.kv_usage <= 1.0:
        raise ValueError(f"--kv-usage is a fraction 0-1 (got {args.kv_usage})")


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run ``policy ...`` without the pdserve root (``python -m pdserve.router.cli``)."""
    parser = argparse.ArgumentParser(prog="pdserve")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
