"""Remote-prefill TTFT across hosts vs on one host, and the router's estimate following the link.

    sudo python bench/hosts_ttft.py [--prompts 6] [--prompt-len 1200] [--slow-mbit 40] [--json PATH]

Three network-namespace hosts (head, prefill, decode; bench/chaos_hosts.py) with a Ray
node each. Two 1P1D clusters run side by side in that Ray cluster:

  two hosts   prefill worker on the prefill host, decode worker on the decode host: the
              KV pages cross a link (UCX over TCP)
  one host    both workers on the head host, same settings: the pages stay on the host

For each, the same long prompts are sent one at a time, forced local then forced remote
(interleaved per prompt), and the bench reports the median TTFT of each route, the remote
overhead (remote - local) and its transfer part (`transfer_ms`: the KV complete on the
prefill host until the decode side has it) with the effective GB/s.

Then the prefill host's link is slowed to ``--slow-mbit`` (tc tbf) and forced-remote
requests run again on the two-host cluster: the transfer time grows, and the router's
cost model (which learns the transfer bandwidth from these measurements) raises its
remote TTFT estimate for the next `auto` request; its route and reason are printed before
and after. Needs root; everything made is removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

MAX_TOKENS = 4


def _topology(name: str, model_dir: str, etcd: str, work: Path, plan: dict, prefill_on: str, decode_on: str) -> Path:
    from pdserve.bench.chaos_hosts import place

    # No prefix cache: every request prefills (and moves) its whole prompt, whatever ran before.
    engine = {"device": "cpu", "attention_backend": "torch", "dtype": "float32", "enable_prefix_caching": False,
              "max_num_batched_tokens": 2048, "kv_cache_memory_bytes": 128 << 20}
    topo = {"cluster": name, "model": {"path": model_dir},
            "roles": {"prefill": {"replicas": 1, "engine": engine, "resources": {"num_cpus": 0.5}},
                      "decode": {"replicas": 1, "engine": engine, "resources": {"num_cpus": 0.5},
                                 "ports": {"grpc": 0, "http": 0}}},
            "router_policy": str(Path(__file__).resolve().parents[1] / "configs" / "router" / "default.yaml"),
            "etcd": {"endpoints": [etcd], "lease_ttl_s": 5}, "queue": {"name": f"{name}-queue"},
            "run_dir": str(work / name)}
    topo = place(topo, {**plan, "prefill": plan[prefill_on], "decode": plan[decode_on]})
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


async def _one(target: str, prompt: list[int], route: str) -> dict:
    from pdserve.api import AsyncClient

    async with AsyncClient(target) as c:
        out = await c.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, route=route,
                               priority="high", timeout_s=120)
    return {"tokens": list(out.token_ids), **out.breakdown}


def _med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key)]
    return statistics.median(vals) if vals else float("nan")


def measure(targets: dict[str, str], prompts: list[list[int]], log) -> dict:
    """TTFT local vs remote per placement, interleaved per prompt (same machine state)."""
    rows = {k: {"local": [], "remote": []} for k in targets}
    for i, p in enumerate(prompts):
        for k, target in targets.items():
            for route in ("local", "remote"):
                r = asyncio.run(_one(target, p, route))
                if r["route"] != route:
                    raise RuntimeError(f"{k}: prompt {i} asked {route} but went {r['route']}: {r.get('reason')}")
                rows[k][route].append(r)
        log(f"  prompt {i + 1}/{len(prompts)} done")
    out = {}
    for k, by in rows.items():
        if [r["tokens"] for r in by["local"]] != [r["tokens"] for r in by["remote"]]:
            raise RuntimeError(f"{k}: remote output differs from local")
        local, remote = _med(by["local"], "ttft_ms"), _med(by["remote"], "ttft_ms")
        xfer, nbytes = _med(by["remote"], "transfer_ms"), _med(by["remote"], "transfer_bytes")
        out[k] = {"ttft_local_ms": local, "ttft_remote_ms": remote, "remote_overhead_ms": remote - local,
                  "transfer_ms": xfer, "transfer_bytes": nbytes, "transfer_gb_per_s": nbytes / xfer / 1e6,
                  "n": len(prompts)}
    return out


def child(args) -> int:
    import ray

    from pdserve.bench.sweep import base_model_dir
    from pdserve.cluster.etcd_server import EmbeddedEtcd
    from pdserve.cluster.topology import load_topology
    from pdserve.launcher import Launcher, state_path

    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    plan = json.loads(args.host_plan)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = base_model_dir("configs/topologies/1p1d-local.yaml")
    etcd = EmbeddedEtcd(work / "etcd", host=plan["head"]["addr"]).start()
    launched = []
    try:
        targets = {}
        for name, pre, dec in (("two-hosts", "prefill", "decode"), ("one-host", "head", "head")):
            path = _topology(name, model_dir, etcd.endpoint, work, plan, pre, dec)
            launcher = Launcher(load_topology(path), str(path), model_dir, progress=lambda m: log(f"  {m}"))
            if ray.is_initialized():
                ray.shutdown()  # each launcher connects its own driver (the workers are detached)
            state = launcher.up()
            launched.append((launcher, state, state_path(launcher.topo)))
            targets[name] = state.decode_endpoints[0]["grpc"]
        vocab = 31000
        prompts = [[(s * 7919 + i * 104729) % vocab + 3 for i in range(args.prompt_len)] for s in range(args.prompts)]
        log(f"bench: {args.prompts} prompts of {args.prompt_len} tokens, local and remote, on both placements")
        result = {"placements": measure(targets, prompts, log)}
        # The router's view of the two-host cluster before and after its link slows down.
        probe = [(7 * i + 11) % vocab + 3 for i in range(args.prompt_len)]
        before = asyncio.run(_one(targets["two-hosts"], probe, "auto"))
        from pdserve.bench.netns import Host

        prefill = Host("prefill", plan["prefill"]["netns"], plan["prefill"]["addr"], "")
        prefill.limit_rate(args.slow_mbit)
        try:
            slow = [asyncio.run(_one(targets["two-hosts"], p, "remote")) for p in prompts[: max(3, args.prompts // 2)]]
            after = asyncio.run(_one(targets["two-hosts"], probe[1:] + probe[:1], "auto"))
        finally:
            prefill.limit_rate(None)
        keys = ("route", "reason", "predicted_ttft_local_ms", "predicted_ttft_remote_ms")
        result["slow_link"] = {"mbit": args.slow_mbit, "transfer_ms": _med(slow, "transfer_ms"),
                               "ttft_remote_ms": _med(slow, "ttft_ms"),
                               "auto_before": {k: before.get(k) for k in keys},
                               "auto_after": {k: after.get(k) for k in keys}}
    finally:
        for launcher, state, path in reversed(launched):
            try:
                launcher.down(state)
                path.unlink(missing_ok=True)
            except Exception as exc:  # noqa: BLE001
                log(f"  down failed: {exc!r}")
        etcd.stop()
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def print_report(r: dict) -> None:
    p = r["placements"]
    print(f"\n{'':<12} | {'TTFT local':>11} | {'TTFT remote':>11} | {'overhead':>9} | {'transfer':>9} | "
          f"{'KV bytes':>9} | GB/s")
    for k, v in p.items():
        print(f"{k:<12} | {v['ttft_local_ms']:8.1f} ms | {v['ttft_remote_ms']:8.1f} ms | {v['remote_overhead_ms']:6.1f} ms"
              f" | {v['transfer_ms']:6.1f} ms | {v['transfer_bytes'] / 2**20:6.1f} MiB | {v['transfer_gb_per_s']:.2f}")
    s = r["slow_link"]
    print(f"\nprefill host link at {s['mbit']} Mbit/s: transfer {s['transfer_ms']:.0f} ms, remote TTFT "
          f"{s['ttft_remote_ms']:.0f} ms")
    for label in ("auto_before", "auto_after"):
        a = s[label]
        print(f"  {label.replace('_', ' ')}: route {a['route']}, predicted local {a['predicted_ttft_local_ms']:.0f} ms"
              f" / remote {a['predicted_ttft_remote_ms']:.0f} ms ({a['reason']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6, help="long prompts per route and placement (default 6)")
    ap.add_argument("--prompt-len", type=int, default=1200, help="tokens per prompt (default 1200)")
    ap.add_argument("--slow-mbit", type=float, default=40.0, help="the slowed link, Mbit/s (default 40)")
    ap.add_argument("--work-dir", default=None, help="run files (default runs/hosts-ttft-<time>)")
    ap.add_argument("--json", default=None, help="also write the figures as JSON")
    ap.add_argument("--host-plan", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.host_plan:
        return child(args)
    from pdserve.bench.chaos_hosts import run_on_hosts

    rest = list(argv if argv is not None else sys.argv[1:])
    if args.work_dir is None:
        rest += ["--work-dir", f"runs/hosts-ttft-{time.strftime('%Y%m%d-%H%M%S')}"]
    if args.json:
        rest[rest.index("--json") + 1] = os.path.abspath(args.json)
    return run_on_hosts(rest, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
