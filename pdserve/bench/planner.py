"""The planner against a fixed deployment, side by side: a step trace of long prompts.

    python -m pdserve.bench.planner [--topology configs/topologies/1p1d-local.yaml]
        [--phases 20:0.3,60:2.0,40:0.3] [--input-len 1200] [--output-len 16]
        [--slo ttft:3000 --slo tpot:200] [--out runs/planner-bench]

Runs the same trace twice, one after the other, on the base topology's model: `fixed`
(1P1D, no planner) and `planner` (1P1D plus the planner with a threshold policy that may
add a second prefill worker, `--max-prefill`). The trace is open-loop (Poisson arrivals)
at the rate of each phase, `seconds:requests-per-second`; every request is prefilled
remotely. While it runs, the workers registered per role are sampled from etcd every
0.5 s. Printed and saved (`<out>/planner-bench.json`, `<out>/planner-bench.png`):

- goodput (requests/s that met every SLO) and SLO attainment, per mode and per phase;
- TTFT and TPOT p50/p99;
- replica-seconds (workers registered, integrated over the trace) and the goodput per
  replica-second: what the capacity cost;
- reaction time: from the start of the high phase to the planner's first scale-up
  decision, and to the new worker registered.

The rows and the reading are in docs/PERFORMANCE.md. On a 2-core machine the workers
share the cores, so an added worker adds no compute; see the serving-performance issue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from .datasets import DatasetConfig, random_dataset
from .metrics import meets_slos, parse_goodput
from .serve import LoadConfig, arrival_offsets, model_info, run_load
from .sweep import base_model_dir

REPO = Path(__file__).resolve().parents[2]  # the checkout
SAMPLE_S = 0.5


def planner_policy(max_prefill: int, interval_s: float, cooldown_s: float) -> dict:
    return {"autoscale": {
        "prefill": {"min_replicas": 1, "max_replicas": max_prefill,
                    "scale_up": {"queue_length": 2, "gpu_utilization": 70},
                    "scale_down": {"queue_length": 0, "gpu_utilization": 20}},
        "decode": {"min_replicas": 1, "max_replicas": 1,
                   "scale_up": {"queue_length": 1000}, "scale_down": {"queue_length": 0}},
        "interval_s": interval_s, "cooldown_s": cooldown_s, "down_stable_s": 2 * cooldown_s,
        "max_step": 1, "gpu_budget": max_prefill + 1, "allow_role_flip": False}}


def derive(base_topology: str, mode: str, model_dir: str, work: Path, args) -> Path:
    base = yaml.safe_load(Path(base_topology).read_text())
    topo = dict(base)
    topo["cluster"] = f"plbench-{mode}"
    topo["model"] = {k: v for k, v in {**base.get("model", {}), "path": str(Path(model_dir).resolve())}.items()
                     if k not in ("make", "cache_dir")}
    roles = json.loads(json.dumps(base.get("roles", {})))
    for role in ("prefill", "decode"):
        roles.setdefault(role, {})["replicas"] = 1
        roles[role]["ports"] = {name: 0 for name in roles[role].get("ports", {})}
    topo["roles"] = roles
    router = work / "router.yaml"  # admit everything: a refusal is not what this measures
    router.write_text("qos:\n  enable_early_rejection: false\n")
    topo["router_policy"] = str(router)
    topo["autoscale_policy"] = None
    if mode == "planner":
        policy = work / "autoscale.yaml"
        policy.write_text(yaml.safe_dump(planner_policy(args.max_prefill, args.interval, args.cooldown),
                                         sort_keys=False))
        topo["autoscale_policy"] = str(policy)
    topo["run_dir"] = str((work / "runs").resolve())
    topo["etcd"] = {k: v for k, v in (base.get("etcd") or {}).items() if k != "data_dir"}
    topo["queue"] = {**(base.get("queue") or {}), "name": f"{topo['cluster']}-queue"}
    path = work / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(topo, sort_keys=False))
    return path


def parse_phases(text: str) -> list[tuple[float, float]]:
    out = []
    for item in text.split(","):
        secs, _, rate = item.partition(":")
        try:
            out.append((float(secs), float(rate)))
        except ValueError:
            raise ValueError(f"--phases item {item!r} must look like SECONDS:RATE (e.g. 60:2.0)") from None
    if not out or any(s <= 0 or r <= 0 for s, r in out):
        raise ValueError("--phases needs at least one SECONDS:RATE pair, both > 0")
    return out


def trace_offsets(phases: list[tuple[float, float]], seed: int) -> np.ndarray:
    """Arrival times over the phases: Poisson at each phase's rate."""
    out, start = [], 0.0
    for i, (secs, rate) in enumerate(phases):
        n = max(1, int(secs * rate * 3) + 10)
        offs = arrival_offsets(n, rate, 1.0, seed + i) + start
        out.append(offs[offs < start + secs])
        start += secs
    return np.concatenate(out)


class Sampler(threading.Thread):
    """Registered workers per role over time, from etcd (its own event loop)."""

    def __init__(self, endpoints, cluster):
        super().__init__(daemon=True)
        self.endpoints, self.cluster = endpoints, cluster
        self.samples: list[tuple[float, int, int]] = []  # (t from t0, prefill, decode)
        self.t0 = time.perf_counter()
        self._halt = threading.Event()

    def run(self) -> None:
        from pdserve.cluster.registry import Registry

        async def go():
            async with Registry(self.endpoints, self.cluster) as reg:
                while not self._halt.is_set():
                    try:
                        m = await asyncio.wait_for(reg.members(), 5)
                        roles = [x.role for x in m.values()]
                        self.samples.append((time.perf_counter() - self.t0, roles.count("prefill"),
                                             roles.count("decode")))
                    except Exception:  # noqa: BLE001  (a missed sample)
                        pass
                    await asyncio.sleep(SAMPLE_S)

        asyncio.run(go())

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def decisions(endpoints, cluster) -> list[dict]:
    from pdserve.cluster.registry import Registry
    from pdserve.cluster.planner.state import read_decisions

    async def go():
        async with Registry(endpoints, cluster) as reg:
            return await read_decisions(reg, 1000)

    return asyncio.run(go())


def run_mode(mode: str, args, model_dir: str, work: Path, log) -> dict:
    import ray

    from pdserve.cluster.topology import load_topology
    from pdserve.launcher import Launcher, state_path
    from pdserve.cluster.planner.actor import PlannerConfig, start_planner_actor

    path = derive(args.topology, mode, model_dir, work, args)
    topo = load_topology(path)
    state_path(topo).unlink(missing_ok=True)
    launcher = Launcher(topo, str(path), model_dir, progress=lambda line: log(f"  [{mode}] {line}"),
                        max_replicas={"prefill": args.max_prefill, "decode": 1} if mode == "planner" else None)
    state = launcher.up()
    try:
        if mode == "planner":
            cfg = PlannerConfig(topology=str(path), model=model_dir, etcd_endpoints=state.etcd_endpoints,
                                known_workers=[a["worker_id"] for a in state.actors])
            _, ref = start_planner_actor(cfg, topo.ray.namespace, topo.cluster, ray.util.get_node_ip_address())
            log(f"  [{mode}] planner {ray.get(ref, timeout=60)['planner']} started")
        targets = [e["grpc"] for e in state.decode_endpoints]
        vocab = int(model_info(targets[0]).get("vocab_size") or 32000)
        offsets = trace_offsets(parse_phases(args.phases), args.seed)
        reqs = random_dataset(DatasetConfig(num_prompts=len(offsets), input_len=args.input_len,
                                            output_len=args.output_len, range_ratio=0.1, seed=args.seed), vocab)
        load = LoadConfig(route="remote", drain_timeout_s=180.0, progress=args.progress)
        sampler = Sampler(state.etcd_endpoints, topo.cluster)
        sampler.start()
        t0 = time.perf_counter()
        records, duration = asyncio.run(run_load(targets, reqs, load, label=mode, offsets=offsets))
        time.sleep(args.tail)  # the planner's scale-down after the trace
        sampler.stop()
        shift = t0 - sampler.t0
        timeline = [(t - shift, p, d) for t, p, d in sampler.samples]
        made = decisions(state.etcd_endpoints, topo.cluster) if mode == "planner" else []
        wall0 = time.time() - (time.perf_counter() - t0)
        for d in made:
            d["t"] = d["at"] - wall0
        return {"mode": mode, "records": records, "duration": duration, "timeline": timeline, "decisions": made}
    finally:
        if not ray.is_initialized():
            ray.init(address=state.ray_address, namespace=state.namespace, log_to_driver=False)
        launcher.down(state)
        state_path(topo).unlink(missing_ok=True)
        ray.shutdown()


def summarize(run: dict, phases, slos: dict) -> dict:
    recs, timeline = run["records"], run["timeline"]
    ok = [r for r in recs if r.success]
    good = [r for r in ok if meets_slos(r, slos)]
    total = sum(s for s, _ in phases)

    def pct(values, q):
        return float(np.percentile(values, q)) if values else None

    bounds, start = [], 0.0
    for secs, rate in phases:
        bounds.append((start, start + secs, rate))
        start += secs
    per_phase = []
    for lo, hi, rate in bounds:
        inside = [r for r in recs if lo <= r.scheduled_s < hi]
        g = [r for r in inside if r.success and meets_slos(r, slos)]
        per_phase.append({"from_s": lo, "to_s": hi, "rate": rate, "requests": len(inside),
                          "slo_attainment": len(g) / len(inside) if inside else None,
                          "ttft_p50_ms": pct([r.ttft_ms for r in inside if r.ttft_ms is not None], 50)})
    # Replica-seconds over the trace: the sampled worker counts, held until the next sample.
    rs = 0.0
    inside = [(t, p + d) for t, p, d in timeline if 0 <= t <= total]
    for (t, n), (t2, _) in zip(inside, inside[1:]):
        rs += n * (t2 - t)
    high_start = bounds[int(np.argmax([b[2] for b in bounds]))][0]
    ups = [d for d in run["decisions"] if d["action"] == "up" and d["t"] >= high_start - 1]
    registered = next((t for t, p, _ in timeline if t >= high_start and p >= 2), None)
    return {
        "mode": run["mode"], "requests": len(recs), "failed": len(recs) - len(ok),
        "goodput_rps": len(good) / total, "slo_attainment": len(good) / len(recs) if recs else None,
        "ttft_p50_ms": pct([r.ttft_ms for r in ok], 50), "ttft_p99_ms": pct([r.ttft_ms for r in ok], 99),
        "tpot_p50_ms": pct([r.tpot_ms for r in ok if r.tpot_ms is not None], 50),
        "tpot_p99_ms": pct([r.tpot_ms for r in ok if r.tpot_ms is not None], 99),
        "replica_seconds": rs, "goodput_per_replica_s": (len(good) / rs) if rs else None,
        "reaction_decision_s": (ups[0]["t"] - high_start) if ups else None,
        "reaction_registered_s": (registered - high_start) if registered is not None else None,
        "max_prefill": max((p for _, p, _ in timeline), default=0),
        "decisions": [{k: d[k] for k in ("t", "role", "action", "reason", "current", "desired")}
                      for d in run["decisions"]],
        "per_phase": per_phase,
    }


def plot(runs: list[dict], phases, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run, color in zip(runs, ("tab:gray", "tab:blue")):
        tl = run["timeline"]
        ax1.step([t for t, _, _ in tl], [p for _, p, _ in tl], where="post", color=color, label=run["mode"])
        pts = [(r.scheduled_s, r.ttft_ms) for r in run["records"] if r.ttft_ms is not None]
        ax2.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, color=color, label=run["mode"])
    start = 0.0
    for secs, rate in phases:
        ax1.axvspan(start, start + secs, alpha=0.08 * rate / max(r for _, r in phases), color="tab:red")
        start += secs
    ax1.set_ylabel("prefill workers")
    ax1.legend()
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_yscale("log")
    ax2.set_xlabel("seconds (shaded: arrival rate)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.planner", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default=str(REPO / "configs" / "topologies" / "1p1d-local.yaml"))
    p.add_argument("--phases", default="20:0.3,60:2.0,40:0.3", help="SECONDS:RATE,... (default %(default)s)")
    p.add_argument("--input-len", type=int, default=1200)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--slo", action="append", default=None, metavar="METRIC:MS",
                   help="SLO for goodput, e.g. ttft:3000 (repeatable; default ttft:3000 tpot:200)")
    p.add_argument("--max-prefill", type=int, default=2)
    p.add_argument("--interval", type=float, default=2.0, help="planner interval_s")
    p.add_argument("--cooldown", type=float, default=10.0, help="planner cooldown_s (down_stable_s is twice it)")
    p.add_argument("--tail", type=float, default=30.0, help="seconds sampled after the trace (scale-down)")
    p.add_argument("--modes", default="fixed,planner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "runs" / "planner-bench"))
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    phases = parse_phases(args.phases)
    slos = parse_goodput(args.slo or ["ttft:3000", "tpot:200"])
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    def log(line):
        print(line, file=sys.stderr, flush=True)

    model_dir = base_model_dir(args.topology)
    runs = []
    for mode in args.modes.split(","):
        log(f"== {mode}: {args.phases} (s:req/s), prompts ~{args.input_len} tokens, {args.output_len} out")
        work = out / mode
        work.mkdir(parents=True, exist_ok=True)
        runs.append(run_mode(mode, args, model_dir, work, log))
    summary = [summarize(r, phases, slos) for r in runs]
    print(f"\nstep trace {args.phases} (seconds:requests/s), SLOs {slos}")
    print(f"{'mode':<8} {'goodput':>8} {'SLO att.':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'repl-s':>7} {'good/repl-s':>11} {'react dec':>9} {'react reg':>9} {'failed':>6}")
    for s in summary:
        def f(v, fmt):
            return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)
        print(f"{s['mode']:<8} {f(s['goodput_rps'], '.3f'):>8} {f(s['slo_attainment'], '.1%'):>8} "
              f"{f(s['ttft_p50_ms'], '.0f'):>9} {f(s['ttft_p99_ms'], '.0f'):>9} {f(s['tpot_p50_ms'], '.1f'):>9} "
              f"{f(s['replica_seconds'], '.0f'):>7} {f(s['goodput_per_replica_s'], '.4f'):>11} "
              f"{f(s['reaction_decision_s'], '.1f'):>9} {f(s['reaction_registered_s'], '.1f'):>9} {s['failed']:>6}")
    for s in summary:
        print(f"  {s['mode']}: per phase SLO attainment "
              + ", ".join(f"{ph['rate']:g} req/s {('-' if ph['slo_attainment'] is None else format(ph['slo_attainment'], '.0%'))}"
                          f" (TTFT p50 {('-' if ph['ttft_p50_ms'] is None else format(ph['ttft_p50_ms'], '.0f'))} ms)"
                          for ph in s["per_phase"]))
        for d in s["decisions"]:
            if d["action"] != "hold":
                print(f"    t={d['t']:6.1f} s {d['role']} {d['action']} {d['current']}->{d['desired']} ({d['reason']})")
    (out / "planner-bench.json").write_text(json.dumps({"args": vars(args), "summary": summary}, indent=2))
    plot(runs, phases, out / "planner-bench.png")
    print(f"\nsaved {out / 'planner-bench.json'} and {out / 'planner-bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
