"""What each KV mechanism buys a 2P2D cluster, at equal memory: multi-turn chats on shared
system prompts, a working set several times one worker's KV pool.

Modes, each a fresh cluster from the same derived topology, one after the other, driven by
the same requests (the same chats, the same pauses):

- ``blind``: each worker's own prefix cache only (as in vLLM); no events, tier or loans;
- ``tier``: every worker also keeps a second KV tier (``kv_offload_bytes``, a file on CPU);
- ``routing``: every worker publishes KV events and the decode workers follow the prefill
  workers': the router's local/remote decision and the queue's dispatch use who holds which
  prefix (``kv_events``);
- ``routing+lending``: that, and workers lend and borrow cached prefixes
  (``network.kv_transport.lending``). Lending finds its holders through the same view, so it
  has no row without routing: its share is this row against ``routing``;
- ``all``: events, loans and the tier.

``kv-blind`` and ``kv-aware`` name ``blind`` and ``all`` (the modes of sessions 21-28).

**Equal memory** (``--memory equal``, the default): every mode has the same KV bytes per
worker. A mode with a tier gets a pool of ``--pool-tokens`` and a tier of ``--tier-bytes``
(default: as many bytes as the pool); a mode without one gets those bytes in its pool. So
the tier row says whether a tier beats the same bytes as pool, and no row wins by having
more memory. ``--memory pool`` gives every mode the same pool and only the tier modes a
tier (the setup of sessions 21-28, which favours them).

Workload: ``--systems`` system prompts of ``--system-len`` tokens; ``--chats`` chats, each on
one system prompt, of ``--turns`` turns: a turn's prompt is the whole history (the system
prompt, the earlier user messages and the replies the model gave) plus a new user message
of ``--user-len`` tokens; replies are ``--output-len`` tokens. A chat sticks to one decode
worker (as a session-affine load balancer sends it). Chats start as a Poisson process at
``--rate`` chats/s; after each reply the user thinks for ``--think-s`` on average
(exponential, drawn up front: every mode runs the same pauses), while the other chats' turns
push its history out of the pool. The working set (the chats' histories at their last turn
and the system prompts) is printed with its ratio to one pool. A turn refused for want of
room (``RESOURCE_EXHAUSTED``) is retried as the OpenAI SDK retries a 429
(``--max-retries``, after the server's ``retry-after-ms``); its TTFT counts from the first
attempt.

``--reps N`` runs every mode N times, the order rotated each repetition (a mode is not
always first on a cold host). Prints per run TTFT p50/p90, TPOT p50, goodput (requests
within ``--slo-ttft-ms`` and ``--slo-tpot-ms``, per second), where the prompt tokens came
from (computed, pool hits, second tier, read from a peer: the workers' own counters); then
per mode the median and the range over the repetitions, and each mode against ``blind``
within a repetition. Writes ``prefix_cluster.json`` and ``prefix_cluster.png`` (TTFT CDFs,
the first repetition) under ``--out``.

    python bench/prefix_cluster.py --reps 3                        # every mode, 3 times, the default load
    python bench/prefix_cluster.py --reps 3 --systems 6 --think-s 3 --out runs/pc-heavy
    python bench/prefix_cluster.py --modes blind,all --memory pool   # the unequal setup of sessions 21-28
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

# what each mode turns on
MECHANISMS = {"blind": frozenset(), "tier": frozenset({"tier"}), "routing": frozenset({"routing"}),
              "routing+lending": frozenset({"routing", "lending"}),
              "all": frozenset({"tier", "routing", "lending"})}
ALIASES = {"kv-blind": "blind", "kv-aware": "all"}
MODES = tuple(MECHANISMS)
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
    p.add_argument("--tier-bytes", type=int, default=None,
                   help="each worker's second tier in the modes that have one (default: the pool's bytes)")
    p.add_argument("--memory", choices=("equal", "pool"), default="equal",
                   help="equal: a mode without a tier gets the tier's bytes in its pool, so every mode has the "
                        "same KV bytes per worker; pool: every mode the same pool, only the tier modes a tier")
    p.add_argument("--reps", type=int, default=1, help="repetitions of every mode, the order rotated each time")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="print the tables of a recorded run (its prefix_cluster.json) again; runs nothing")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--max-retries", type=int, default=2,
                   help="a refused turn (RESOURCE_EXHAUSTED: its decode worker's KV pool full beside its streams) "
                        "is retried this many times after the server's retry-after-ms hint, as the OpenAI SDK "
                        "does by default (2); its TTFT counts from the first attempt. A turn refused after that "
                        "ends its chat. 0: no retries (sessions 21-26)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"which modes, in order: {', '.join(MODES)} (kv-blind, kv-aware: blind, all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/prefix-cluster", help="directory for the JSON and the plot")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--client-nice", type=int, default=-10,
                   help="niceness of the client's event-loop thread while it drives the chats (root only; 0 leaves "
                        "it as is). The workers share the client's cores here: a starved client reads every stream "
                        "late at once, and its TTFTs then measure itself (asyncio's debug mode logged 0.6-1.0 s "
                        "callbacks in the client at niceness 0). The client's loop lag is reported either way")
    add_autogroup_option(p)
    args = p.parse_args(argv)
    modes = [ALIASES.get(m.strip(), m.strip()) for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MECHANISMS]
    if unknown or not modes:
        p.error(f"--modes: unknown mode(s) {', '.join(unknown) or '(none given)'}; choose from "
                f"{', '.join(MODES)} (or kv-blind, kv-aware)")
    if len(set(modes)) != len(modes):
        p.error(f"--modes: a mode is named twice ({args.modes})")
    if args.reps < 1:
        p.error(f"--reps must be >= 1 (got {args.reps})")
    if args.tier_bytes is not None and args.tier_bytes < 0:
        p.error(f"--tier-bytes must be >= 0 (got {args.tier_bytes})")
    args.mode_list = modes
    return args


def memory_of(args, mode: str) -> tuple[int, int]:
    """(pool bytes, tier bytes) of each worker in ``mode``: with ``--memory equal`` a mode
    without a tier holds the tier's bytes in its pool."""
    pool = int(args.pool_tokens * args.kv_bytes_per_token)
    tier = pool if args.tier_bytes is None else args.tier_bytes
    if "tier" in MECHANISMS[mode]:
        return pool, tier
    return (pool + tier if args.memory == "equal" else pool), 0


def rep_order(modes: list[str], rep: int) -> list[str]:
    """The modes of repetition ``rep`` (0-based): rotated by one each time."""
    k = rep % len(modes)
    return modes[k:] + modes[:k]


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
    on = MECHANISMS[mode]
    pool_bytes, tier_bytes = memory_of(args, mode)
    slug = mode.replace("+", "-")
    topo = dict(base)
    topo["cluster"] = f"prefix-{slug}"
    topo["model"] = {"path": str(Path(model_dir).resolve())}
    for role in ("prefill", "decode"):
        spec = json.loads(json.dumps(base["roles"][role]))
        spec["replicas"] = 2
        spec["ports"] = {name: 0 for name in spec.get("ports", {})}
        engine = dict(spec["engine"])
        engine["kv_cache_memory_bytes"] = pool_bytes
        engine["max_model_len"] = args.pool_tokens  # the same longest prompt in every mode
        engine["kv_events"] = "routing" in on
        if tier_bytes:
            engine["kv_offload_bytes"] = tier_bytes
        spec["engine"] = engine
        topo["roles"] = {**topo.get("roles", {}), role: spec}
    topo["router_policy"] = str(BASE_TOPOLOGY.parent.parent / "router" / "default.yaml")
    topo["network"] = {"kv_transport": {"lending": "lending" in on}}
    topo["run_dir"] = str((work / "runs").resolve())
    topo["queue"] = {**(base.get("queue") or {}), "name": f"prefix-{slug}-queue"}
    topo["ray"] = {**(base.get("ray") or {}), "namespace": f"prefix-{slug}"}
    path = work / f"{slug}.yaml"
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

    from pdserve.cluster.topology import load_topology
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


def spread(values) -> str:
    """'median [min-max]' of a mode's repetitions ('-' for none)."""
    import statistics

    values = [v for v in values if v is not None]
    if not values:
        return "-"
    fmt = (lambda v: f"{v:.2f}") if max(values) < 10 else (lambda v: f"{v:,.0f}")
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} [{fmt(min(values))}-{fmt(max(values))}]"


def shares(r: dict) -> dict[str, float]:
    s = r["sources"]
    total = max(1, sum(s.values()))
    return {k: v / total for k, v in s.items()}


def baseline_of(mode: str) -> str | None:
    """What a mode is compared with: the KV-blind cluster of the same memory layout (``tier``
    for a mode with a tier, ``blind`` for one without; ``tier`` itself against ``blind``, the
    same bytes as pool)."""
    if mode == "blind":
        return None
    return "tier" if "tier" in MECHANISMS[mode] and mode != "tier" else "blind"


def report(args, runs: list[dict], working_set: int) -> None:
    pool_tokens = args.pool_tokens
    print(f"\n## What each KV mechanism buys, 2P2D, {args.chats} chats x {args.turns} turns on {args.systems} "
          f"system prompts of {args.system_len} tokens, {args.think_s:g} s mean pause; working set per decode "
          f"worker {working_set} tokens ({working_set / pool_tokens:.1f}x a {pool_tokens}-token pool); "
          f"memory: {args.memory}")
    print(f"SLO: TTFT <= {args.slo_ttft_ms:.0f} ms, TPOT <= {args.slo_tpot_ms:.0f} ms; {args.reps} repetition(s)\n")
    print("| rep | mode | pool / tier MiB per worker | done | TTFT p50 ms | TTFT p90 ms | later turns p90 ms | "
          "TPOT p50 ms | goodput req/s | computed | pool | tier | peer | server TTFT p90 ms | "
          "refusals retried / turns failed | client loop lag p99 / max ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        sh = shares(r)
        print(f"| {r['rep']} | {r['mode']} | {r['pool_bytes'] / 2**20:.0f} / {r['tier_bytes'] / 2**20:.0f} | "
              f"{r['completed']}/{r['requests']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
              f"{r['later_turns_ttft_p90_ms'] or 0:.0f} | {r['tpot_p50_ms']:.1f} | {r['goodput_rps']:.2f} | "
              f"{sh['computed']:.0%} | {sh['pool']:.0%} | {sh['tier']:.0%} | {sh['peer']:.0%} | "
              f"{r['server_ttft_p90_ms'] or 0:.0f} | {r.get('refusals', 0)} / {r.get('failed', 0)} | "
              f"{r['client_lag_p99_ms'] or 0:.0f} / {r['client_lag_max_ms'] or 0:.0f} |")
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    by = {(r["rep"], r["mode"]): r for r in runs}
    print(f"\nPer mode, median [min-max] over {args.reps} repetition(s). 'vs' compares a mode with its baseline "
          "within each repetition (the baseline's TTFT p90 over the mode's: higher is better; the mode's goodput "
          "over the baseline's): a mode with a tier against `tier` (the same pool and the same tier, KV-blind), "
          "the others and `tier` itself against `blind`:\n")
    print("| mode | baseline | TTFT p90 ms | goodput req/s | within SLO | prompt tokens computed | TTFT p90 vs "
          "baseline | goodput vs baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for m in modes:
        mine = [r for r in runs if r["mode"] == m]
        vs_ttft, vs_good = [], []
        base_mode = baseline_of(m)
        for r in mine:
            base = by.get((r["rep"], base_mode)) if base_mode else None
            if base is not None:
                vs_ttft.append(base["ttft_p90_ms"] / r["ttft_p90_ms"] if r["ttft_p90_ms"] else None)
                vs_good.append(r["goodput_rps"] / base["goodput_rps"] if base["goodput_rps"] else None)
        within = [r["good"] / r["requests"] if r["requests"] else None for r in mine]
        print(f"| {m} | {base_mode or '-'} | {spread([r['ttft_p90_ms'] for r in mine])} | "
              f"{spread([r['goodput_rps'] for r in mine])} | "
              f"{spread([w * 100 if w is not None else None for w in within])} % | "
              f"{spread([shares(r)['computed'] * 100 for r in mine])} % | "
              f"{spread(vs_ttft) + 'x' if vs_ttft else '-'} | {spread(vs_good) + 'x' if vs_good else '-'} |")


def plot(runs: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in [r for r in runs if r["rep"] == 1]:
        xs = sorted(x["ttft_ms"] for x in r["records"] if x["ttft_ms"] is not None)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["mode"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT, multi-turn chats, 2P2D")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "prefix_cluster.png", dpi=120)


def reprint(path: str) -> int:
    data = json.loads(Path(path).read_text())
    args = argparse.Namespace(**data["args"])
    report(args, data["runs"], data["working_set_tokens"])
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return reprint(args.report)
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

    runs: list[dict] = []
    with autogroups_off(args.autogroups, log) as host:
        for rep in range(args.reps):
            for mode in rep_order(args.mode_list, rep):
                log(f"repetition {rep + 1}/{args.reps}, mode {mode} ...")
                r = run_mode(args, mode, model_dir, chats, out, log)
                r["rep"] = rep + 1
                r["pool_bytes"], r["tier_bytes"] = memory_of(args, mode)
                runs.append(r)
                # written after every run: a long study interrupted keeps what it measured
                (out / "prefix_cluster.json").write_text(json.dumps(json_safe(
                    {"args": vars(args), "host": host, "working_set_tokens": working_set, "runs": runs}), indent=1))
    report(args, runs, working_set)
    plot(runs, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
