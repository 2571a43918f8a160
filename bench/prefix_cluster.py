"""A KV-aware 2P2D cluster against the same cluster KV-blind: multi-turn chats on shared
system prompts, a working set several times one worker's KV pool.

Modes, each a fresh cluster from the same derived topology, one after the other, driven by
the same requests:

- ``kv-aware``: every worker publishes KV events (the decode workers follow the prefill
  workers': prefix-aware dispatch, the router's view, loans), every worker has a second KV
  tier (``kv_offload_bytes``, a file on CPU), and workers lend and borrow cached prefixes
  (``network.kv_transport.lending``);
- ``kv-blind``: the same cluster with events, tier and loans off. Each worker's own prefix
  cache stays on (as in vLLM).

Workload: ``--systems`` system prompts of ``--system-len`` tokens; ``--chats`` chats, each on
one system prompt, of ``--turns`` turns: a turn's prompt is the whole history (the system
prompt, the earlier user messages and the replies the model gave) plus a new user message
of ``--user-len`` tokens; replies are ``--output-len`` tokens. A chat sticks to one decode
worker (as a session-affine load balancer sends it). Chats start as a Poisson process at
``--rate`` chats/s; after each reply the user thinks for ``--think-s`` on average
(exponential, drawn up front: every mode runs the same pauses), while the other chats' turns
push its history out of the pool. Every worker's KV pool holds ``--pool-tokens``; the
working set (the chats' histories at their last turn and the system prompts) is printed with
its ratio to one pool. A turn refused for want of room (``RESOURCE_EXHAUSTED``) is retried
as the OpenAI SDK retries a 429 (``--max-retries``, after the server's ``retry-after-ms``);
its TTFT counts from the first attempt.

Prints per mode TTFT p50/p90, TPOT p50, goodput (requests within ``--slo-ttft-ms`` and
``--slo-tpot-ms``, per second), where the prompt tokens came from (computed, pool hits,
second tier, read from a peer: the workers' own counters), and the ratios aware/blind.
Writes ``prefix_cluster.json`` and ``prefix_cluster.png`` (TTFT CDFs) under ``--out``.

    python bench/prefix_cluster.py                       # the default ~34M model, 2P2D on this host
    python bench/prefix_cluster.py --chats 48 --think-s 12 --out runs/prefix-cluster
    python bench/prefix_cluster.py --systems 6 --think-s 2 --out runs/pc27   # the heavy chat load of PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.host import add_autogroup_option, autogroups_off  # noqa: E402
from bench.metrics import json_safe  # noqa: E402


def pct(values, q: float) -> float | None:
    """The ``q``-th percentile (numpy's linear interpolation); None for no values."""
    import numpy as np

    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None

MODES = ("kv-aware", "kv-blind")
BASE_TOPOLOGY = Path(__file__).resolve().parents[1] / "configs" / "topologies" / "1p1d-local.yaml"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="model dir (default: make the default ~34M model under .cache/)")
    p.add_argument("--systems", type=int, default=3, help="distinct system prompts")
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="chats started per second (Poisson)")
    p.add_argument("--think-s", type=float, default=8.0,
                   help="mean pause between a reply and the chat's next turn (exponential): while a user "
                        "thinks, the other chats' turns push its history out of the pool")
    p.add_argument("--pool-tokens", type=int, default=4096, help="each worker's KV pool, in tokens")
    p.add_argument("--tier-bytes", type=int, default=256 << 20, help="kv-aware: each worker's second tier")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--max-retries", type=int, default=2,
                   help="a refused turn (RESOURCE_EXHAUSTED: its decode worker's KV pool full beside its streams) "
                        "is retried this many times after the server's retry-after-ms hint, as the OpenAI SDK "
                        "does by default (2); its TTFT counts from the first attempt. A turn refused after that "
                        "ends its chat. 0: no retries (sessions 21-26)")
    p.add_argument("--modes", default=",".join(MODES), help="which modes, in order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/prefix-cluster", help="directory for the JSON and the plot")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--client-nice", type=int, default=-10,
                   help="niceness of the client's event-loop thread while it drives the chats (root only; 0 leaves "
                        "it as is). The workers share the client's cores here: a starved client reads every stream "
                        "late at once, and its TTFTs then measure itself (asyncio's debug mode logged 0.6-1.0 s "
                        "callbacks in the client at niceness 0). The client's loop lag is reported either way")
    add_autogroup_option(p)
    return p.parse_args(argv)


# -- the workload ---------------------------------------------------------------------------
def make_chats(args, vocab: int) -> list[dict]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(3, vocab) for _ in range(args.system_len)] for _ in range(args.systems)]
    # Each chat's pauses are drawn here, not as replies come: every mode then runs the same chats
    # with the same pauses, and only the serving differs (drawn as replies came, a mode's order of
    # replies picked which chat got which pause, and the run's length with it).
    think = random.Random(args.seed + 2)
    chats = []
    for i in range(args.chats):
        chats.append({"system": systems[i % args.systems],
                      "users": [[rng.randrange(3, vocab) for _ in range(args.user_len)] for _ in range(args.turns)],
                      "thinks": [think.expovariate(1.0 / args.think_s) if args.think_s > 0 else 0.0
                                 for _ in range(args.turns - 1)]})
    return chats


def working_set_tokens(args, n_decode: int) -> int:
    """Tokens one decode worker's chats hold at their last turn (system prompts counted once)."""
    per_chat = args.turns * args.user_len + (args.turns - 1) * args.output_len
    chats = -(-args.chats // n_decode)
    return min(args.systems, chats) * args.system_len + chats * per_chat


def retry_delay_s(exc: BaseException, attempt: int, max_retries: int) -> float | None:
    """How long to wait before retrying a refused request, as the OpenAI SDK does: a refusal
    (RESOURCE_EXHAUSTED: the worker's QoS, e.g. its KV pool full) is retried up to
    ``max_retries`` times, after the server's ``retry-after-ms`` hint when it gives one (up to
    60 s), else after 0.5 s x 2^attempt (at most 8 s). None: do not retry (another error, or
    the retries are spent)."""
    import grpc

    if attempt >= max_retries or not isinstance(exc, grpc.aio.AioRpcError) or \
            exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms")
    try:
        ms = float(hint) if hint is not None else None
    except ValueError:
        ms = None
    if ms is not None and 0 < ms <= 60_000:
        return ms / 1e3
    return min(0.5 * 2 ** attempt, 8.0)


async def run_chats(targets: list[str], chats: list[dict], args) -> tuple[list[dict], list[float]]:
    """Every chat, turn after turn, on its decode worker: a record per request, and how late the
    client's own loop woke (ms, every 20 ms: a starved client delays every stream it reads)."""
    from pdserve.api import AsyncClient

    clients = [AsyncClient(t, timeout_s=args.request_timeout_s) for t in targets]
    rng = random.Random(args.seed + 1)
    starts, t = [], 0.0
    for _ in chats:
        starts.append(t)
        t += rng.expovariate(args.rate) if args.rate > 0 else 0.0
    records: list[dict] = []
    t0 = time.perf_counter()
    lags: list[float] = []  # how late the client's loop woke from a 20 ms sleep, ms

    async def watch_lag() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.02)
            lags.append((time.perf_counter() - t - 0.02) * 1e3)

    async def chat(i: int, c: dict) -> None:
        await asyncio.sleep(max(0.0, t0 + starts[i] - time.perf_counter()))
        client = clients[i % len(clients)]
        history = list(c["system"])
        for turn, user in enumerate(c["users"]):
            prompt = history + user
            rec = {"chat": i, "turn": turn, "prompt_len": len(prompt), "ttft_ms": None, "tpot_ms": None,
                   "error": None}
            st = time.perf_counter()
            first = last = None
            reply: list[int] = []
            rec["refusals"] = 0
            while True:
                try:
                    async for msg in client.stream(prompt, max_tokens=args.output_len, temperature=0.0,
                                                   ignore_eos=True, timeout_s=args.request_timeout_s):
                        now = time.perf_counter()
                        if msg.token_ids:
                            first = first or now
                            last = now
                            reply += list(msg.token_ids)
                        if msg.finish_reason:
                            from pdserve.api.client import breakdown_dict

                            b = breakdown_dict(msg.breakdown)
                            rec["route"] = b.get("route")
                            rec.update({k: b.get(k) for k in ("queue_wait_ms", "prefill_ms", "cached_tokens",
                                                              "predicted_ttft_ms")})
                            rec["server_ttft_ms"] = b.get("ttft_ms")  # arrival at the worker -> its first token
                    break
                except Exception as exc:  # noqa: BLE001  (recorded; the chat ends)
                    wait = retry_delay_s(exc, rec["refusals"], args.max_retries) if first is None else None
                    if wait is None:
                        rec["error"] = f"{exc.__class__.__name__}: {exc}"
                        records.append(rec)
                        return
                    rec["refusals"] += 1
                    await asyncio.sleep(wait)
            rec["ttft_ms"] = (first - st) * 1e3 if first else None
            if first and last and len(reply) > 1:
                rec["tpot_ms"] = (last - first) * 1e3 / (len(reply) - 1)
            rec["end_s"] = time.perf_counter() - t0
            records.append(rec)
            history = prompt + reply
            if turn + 1 < len(c["users"]):
                await asyncio.sleep(c["thinks"][turn])

    lag_task = asyncio.ensure_future(watch_lag())
    try:
        await asyncio.gather(*(chat(i, c) for i, c in enumerate(chats)))
    finally:
        lag_task.cancel()
        for c in clients:
            await c.close()
    return records, lags


# -- the clusters ----------------------------------------------------------------------------
def derive_topology(args, mode: str, model_dir: str, work: Path) -> Path:
    base = yaml.safe_load(BASE_TOPOLOGY.read_text())
    aware = mode == "kv-aware"
    topo = dict(base)
    topo["cluster"] = f"prefix-{mode}"
    topo["model"] = {"path": str(Path(model_dir).resolve())}
    for role in ("prefill", "decode"):
        spec = json.loads(json.dumps(base["roles"][role]))
        spec["replicas"] = 2
        spec["ports"] = {name: 0 for name in spec.get("ports", {})}
        engine = dict(spec["engine"])
        engine["kv_cache_memory_bytes"] = int(args.pool_tokens * args.kv_bytes_per_token)
        engine["max_model_len"] = args.pool_tokens
        if aware:
            engine.update(kv_events=True, kv_offload_bytes=args.tier_bytes)
        spec["engine"] = engine
        topo["roles"] = {**topo.get("roles", {}), role: spec}
    topo["router_policy"] = str(BASE_TOPOLOGY.parent.parent / "router" / "default.yaml")
    topo["network"] = {"kv_transport": {"lending": aware}}
    topo["run_dir"] = str((work / "runs").resolve())
    topo["queue"] = {**(base.get("queue") or {}), "name": f"prefix-{mode}-queue"}
    topo["ray"] = {**(base.get("ray") or {}), "namespace": f"prefix-{mode}"}
    path = work / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(topo, sort_keys=False))
    return path


def worker_stats(state) -> dict[str, dict]:
    import ray

    out = {}
    for a in state.actors:
        actor = ray.get_actor(a["name"], namespace=state.namespace)
        method = actor.get_stats if a["role"] == "prefill" else actor.stats
        out[a["worker_id"]] = ray.get(method.remote(), timeout=30)
    return out


def token_sources(stats: dict[str, dict]) -> dict[str, int]:
    """Prompt tokens the cluster's engines computed, found in their pools, loaded back from
    their second tiers, or read from a peer (both roles' counters)."""
    out = {"computed": 0, "pool": 0, "tier": 0, "peer": 0}
    for wid, s in stats.items():
        tier = s.get("tier_loaded_tokens", 0)
        if wid.startswith("prefill"):
            computed, cached, peer = s.get("tokens_computed", 0), s.get("prompt_tokens_cached", 0), \
                s.get("borrowed_tokens", 0)
        else:
            computed, cached = s.get("num_prompt_tokens_computed", 0), s.get("num_prompt_tokens_cached", 0)
            peer = (s.get("borrowing") or {}).get("borrowed_tokens", 0)
        out["computed"] += computed
        out["tier"] += tier
        out["peer"] += peer
        out["pool"] += max(0, cached - tier - peer)
    return out


def run_mode(args, mode: str, model_dir: str, chats: list[dict], work: Path, log) -> dict:
    import ray

    from pdserve.control.topology import load_topology
    from pdserve.launcher import Launcher, state_path

    path = derive_topology(args, mode, model_dir, work)
    topo = load_topology(path)
    state_path(topo).unlink(missing_ok=True)
    launcher = Launcher(topo, str(path), model_dir, progress=lambda line: log(f"  [{mode}] {line}"))
    state = launcher.up()
    try:
        targets = [e["grpc"] for e in state.decode_endpoints]
        log(f"  [{mode}] up: {len(targets)} decode workers; {args.chats} chats x {args.turns} turns ...")
        t0 = time.perf_counter()
        # Linux niceness is per thread: this one (the client's loop) only, not Ray's threads.
        reniced = args.client_nice != 0 and os.geteuid() == 0
        if reniced:
            os.setpriority(os.PRIO_PROCESS, 0, args.client_nice)
        try:
            records, lags = asyncio.run(run_chats(targets, chats, args))
        finally:
            if reniced:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
        duration = time.perf_counter() - t0
        stats = worker_stats(state)
    finally:
        launcher.down(state)
        state_path(topo).unlink(missing_ok=True)
        ray.shutdown()
    ok = [r for r in records if r["error"] is None and r["ttft_ms"] is not None]
    good = [r for r in ok if r["ttft_ms"] <= args.slo_ttft_ms and (r["tpot_ms"] or 0) <= args.slo_tpot_ms]
    later = [r["ttft_ms"] for r in ok if r["turn"] > 0]
    server = [r["server_ttft_ms"] for r in ok if r.get("server_ttft_ms") is not None]
    return {"mode": mode, "client_nice": args.client_nice if reniced else 0,
            "client_lag_p99_ms": pct(lags, 99) if lags else None, "client_lag_max_ms": max(lags, default=None),
            "server_ttft_p90_ms": pct(server, 90) if server else None,
            "requests": len(records), "completed": len(ok), "duration_s": duration,
            "ttft_p50_ms": pct([r["ttft_ms"] for r in ok], 50), "ttft_p90_ms": pct([r["ttft_ms"] for r in ok], 90),
            "later_turns_ttft_p90_ms": pct(later, 90) if later else None,
            "tpot_p50_ms": pct([r["tpot_ms"] for r in ok if r["tpot_ms"]], 50),
            "goodput_rps": len(good) / duration, "good": len(good), "sources": token_sources(stats),
            "refusals": sum(r.get("refusals", 0) for r in records),
            "failed": sum(1 for r in records if r["error"] is not None),
            "records": records, "stats": stats}


def report(args, results: dict[str, dict], working_set: int) -> None:
    print(f"\n## KV-aware vs KV-blind, 2P2D, {args.chats} chats x {args.turns} turns on {args.systems} system "
          f"prompts of {args.system_len} tokens; pool {args.pool_tokens} tokens per worker, working set per "
          f"decode worker {working_set} tokens ({working_set / args.pool_tokens:.1f}x one pool)")
    print(f"SLO: TTFT <= {args.slo_ttft_ms:.0f} ms, TPOT <= {args.slo_tpot_ms:.0f} ms\n")
    print("| mode | done | TTFT p50 ms | TTFT p90 ms | later turns p90 ms | TPOT p50 ms | goodput req/s | "
          "computed | pool | tier | peer | server TTFT p90 ms | refusals retried / turns failed | "
          "client loop lag p99 / max ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results.values():
        s = r["sources"]
        total = max(1, sum(s.values()))
        print(f"| {r['mode']} | {r['completed']}/{r['requests']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
              f"{r['later_turns_ttft_p90_ms'] or 0:.0f} | {r['tpot_p50_ms']:.1f} | {r['goodput_rps']:.2f} | "
              f"{s['computed'] / total:.0%} | {s['pool'] / total:.0%} | {s['tier'] / total:.0%} | "
              f"{s['peer'] / total:.0%} | {r['server_ttft_p90_ms'] or 0:.0f} | "
              f"{r.get('refusals', 0)} / {r.get('failed', 0)} | "
              f"{r['client_lag_p99_ms'] or 0:.0f} / {r['client_lag_max_ms'] or 0:.0f} |")
    if set(MODES) <= set(results):
        a, b = results["kv-aware"], results["kv-blind"]
        print(f"\nkv-aware vs kv-blind: TTFT p90 {b['ttft_p90_ms'] / a['ttft_p90_ms']:.2f}x better, "
              f"goodput {a['goodput_rps'] / max(b['goodput_rps'], 1e-9):.2f}x")


def plot(results: dict[str, dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results.values():
        xs = sorted(x["ttft_ms"] for x in r["records"] if x["ttft_ms"] is not None)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["mode"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT, multi-turn chats, 2P2D")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "prefix_cluster.png", dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench.engine_throughput import default_model
    from pdserve.engine.config import ModelConfig

    model_dir = args.model or default_model()
    m = ModelConfig.from_dir(model_dir)
    args.kv_bytes_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4  # float32 on CPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chats = make_chats(args, m.vocab_size)
    working_set = working_set_tokens(args, 2)
    need = args.system_len + args.turns * args.user_len + (args.turns - 1) * args.output_len
    if need + args.output_len > args.pool_tokens:
        raise SystemExit(f"the last turn's prompt ({need} tokens) and its reply do not fit one pool of "
                         f"{args.pool_tokens} tokens: raise --pool-tokens or shorten the chats")

    def log(line):
        print(line, file=sys.stderr, flush=True)

    results = {}
    with autogroups_off(args.autogroups, log) as host:
        for mode in args.modes.split(","):
            log(f"mode {mode} ...")
            results[mode] = run_mode(args, mode, model_dir, chats, out, log)
    report(args, results, working_set)
    (out / "prefix_cluster.json").write_text(json.dumps(json_safe({"args": vars(args), "host": host,
                                                                   "results": results}), indent=1))
    plot(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
