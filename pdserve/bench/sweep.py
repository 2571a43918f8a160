"""Goodput sweep: one workload, the same number of workers, three serving modes.

For each mode the launcher starts a fresh cluster derived from one base
topology (same model, same engine settings, same worker count N):

- ``colocated``: N decode workers, no prefill pool; every prompt is prefilled
  by the decode worker that received it (router ``always_local``).
- ``always-remote``: P prefill + (N - P) decode workers, router ``always_remote``.
- ``conditional``: the same P + (N - P), the conditional router (default:
  ``configs/router/default.yaml``, the cost model).

Each mode gets a warm-up (a short and a long prompt on each route per decode
worker: first-call allocations, NIXL connections, the cost model's first
measurements), then the request rates in order. Rate i uses dataset seed
``seed + 1000 * i`` in every mode: the modes see identical requests, and no
rate reuses prompts an earlier rate left in the prefix cache.

Admission (``--admission``): ``slo`` (default) sets the policies' QoS TTFT/TPOT
SLOs and max queue wait to the ``--goodput`` SLOs, so that the workers refuse
exactly what the benchmark would count as missed; ``off`` sets the same SLOs
(the router's TPOT pressure reads them) and admits everything; ``policy``
keeps the files' QoS.

Writes ``sweep.json`` (config, table, every run's metrics and raw per-request
samples), ``goodput_vs_rate.png``, ``latency_vs_rate.png``, ``ttft_cdf.png``
and ``tpot_cdf.png``, and prints the table as Markdown.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from pdserve.configs import path as shipped_config

from .datasets import DatasetConfig, load_dataset
from .metrics import compute_metrics, json_safe, records_json
from .report import fmt, pct, sweep_summary, sweep_table
from .serve import LoadConfig, model_info, run_load

DEFAULT_TOPOLOGY = shipped_config("topologies", "1p1d-local.yaml")
MODES = ("colocated", "always-remote", "conditional")
_MODE_POLICY = {"colocated": {"router": {"mode": "always_local"}},
                "always-remote": {"router": {"mode": "always_remote"}}}
WARMUP_LENGTHS = (64, 512)  # prompt tokens of the warm-up requests, per route and decode worker


@dataclass
class SweepConfig:
    """A whole sweep (the CLI fills it)."""

    output_dir: str
    request_rates: list[float]
    topology: str = str(DEFAULT_TOPOLOGY)
    modes: list[str] = field(default_factory=lambda: list(MODES))
    num_workers: int = 2
    prefill_workers: int | None = None  # default: num_workers // 2
    conditional_policy: str | None = None  # default: configs/router/default.yaml (else schema defaults)
    # More conditional modes, each with its own policy file: mode name "conditional-<file stem>" -> file.
    extra_policies: dict = field(default_factory=dict)
    admission: str = "slo"  # slo | policy | off
    slos: dict = field(default_factory=lambda: {"ttft": 500.0, "tpot": 50.0})
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    cdf_rate: float | None = None  # default: the middle rate
    warmup: bool = True
    interleave: bool = False  # all modes' clusters up at once, modes taking turns per rate
    repeats: int = 1  # runs per (mode, rate), each with its own prompts; the table shows the median run
    wait_load_below: float | None = None  # hold each run until the 1-min load average is under this
    wait_load_timeout_s: float = 600.0
    ray_worker_niceness: int | None = 0  # None: Ray's default (15, below every other process on the host)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    load: LoadConfig = field(default_factory=LoadConfig)

    def check(self) -> None:
        unknown = [m for m in self.modes if m not in MODES and m not in self.extra_policies]
        if unknown or not self.modes:
            raise ValueError(f"--modes {','.join(self.modes)}: use some of {', '.join(MODES)}")
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise ValueError("--request-rates: give one or more rates > 0 (inf allowed)")
        if len(set(self.request_rates)) != len(self.request_rates):
            raise ValueError("--request-rates: each rate once")
        if self.num_workers < 2:
            raise ValueError(f"--num-workers {self.num_workers}: a disaggregated mode needs at least 2 workers")
        p = self.prefill_count
        if not 1 <= p < self.num_workers:
            raise ValueError(f"--prefill-workers {p}: must be between 1 and --num-workers - 1")
        if self.admission not in ("slo", "policy", "off"):
            raise ValueError(f"--admission {self.admission!r}: use slo, policy or off")
        if self.repeats < 1:
            raise ValueError(f"--repeats {self.repeats}: must be >= 1")
        if self.cdf_rate is not None and self.cdf_rate not in self.request_rates:
            raise ValueError(f"--cdf-rate {self.cdf_rate:g} is not one of --request-rates")

    @property
    def prefill_count(self) -> int:
        return self.prefill_workers if self.prefill_workers is not None else self.num_workers // 2

    def roles(self, mode: str) -> tuple[int, int]:
        """(prefill replicas, decode replicas) of a mode."""
        if mode == "colocated":
            return 0, self.num_workers
        return self.prefill_count, self.num_workers - self.prefill_count


# -- cluster per mode -----------------------------------------------------------------------
def mode_policy(cfg: SweepConfig, mode: str) -> dict:
    """The router policy of one mode, with the sweep's admission applied."""
    if mode in _MODE_POLICY:
        policy = json.loads(json.dumps(_MODE_POLICY[mode]))
    else:
        given = cfg.extra_policies.get(mode) or cfg.conditional_policy
        src = Path(given) if given else shipped_config("router", "default.yaml")
        if given and not src.is_file():
            raise FileNotFoundError(f"policy file {src} (mode {mode}): no such file")
        policy = (yaml.safe_load(src.read_text()) if src.is_file() else None) or {"router": {"mode": "conditional"}}
    qos = policy.setdefault("qos", {})
    if cfg.admission == "policy":
        return policy
    # The routers see the benchmark's SLOs (the cost model's TPOT pressure reads them) ...
    if "ttft" in cfg.slos:
        qos["ttft_slo_ms"] = cfg.slos["ttft"]
    if "tpot" in cfg.slos:
        qos["tpot_slo_ms"] = cfg.slos["tpot"]
    # ... and admission refuses what the benchmark would count as missed, or nothing.
    if cfg.admission == "off":
        qos["enable_early_rejection"] = False
    elif "ttft" in cfg.slos:
        qos["max_queue_wait_ms"] = cfg.slos["ttft"]
    return policy


def derive_topology(cfg: SweepConfig, mode: str, model_dir: str, work: Path) -> Path:
    """Write the topology of one mode under `work` (absolute paths, free ports); returns its path."""
    base = yaml.safe_load(Path(cfg.topology).read_text())
    n_prefill, n_decode = cfg.roles(mode)
    policy_file = work / f"{mode}-policy.yaml"
    policy_file.write_text(yaml.safe_dump(mode_policy(cfg, mode), sort_keys=False))
    topo = dict(base)
    topo["cluster"] = f"{base.get('cluster', 'pdserve')}-bench-{mode}"
    topo["model"] = {**base.get("model", {}), "path": str(Path(model_dir).resolve())}
    topo["model"].pop("make", None)
    topo["model"].pop("cache_dir", None)
    roles = json.loads(json.dumps(base.get("roles", {})))
    for role, count in (("prefill", n_prefill), ("decode", n_decode)):
        spec = roles.setdefault(role, {})
        spec["replicas"] = count
        spec["ports"] = {name: 0 for name in spec.get("ports", {})}  # 0 = free ports: no clash with `pdserve up`
    topo["roles"] = roles
    topo["router_policy"] = str(policy_file)
    topo["autoscale_policy"] = None  # fixed worker counts: the comparison is at equal N
    topo["run_dir"] = str((work.parent / "runs").resolve())
    etcd = dict(base.get("etcd") or {})
    etcd.pop("data_dir", None)
    topo["etcd"] = etcd
    topo["queue"] = {**(base.get("queue") or {}), "name": f"{topo['cluster']}-queue"}
    path = work / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(topo, sort_keys=False))
    return path


def base_model_dir(topology: str) -> str:
    """The base topology's model directory (an `auto` model is made on first use)."""
    from pdserve.cluster.topology import load_topology
    from pdserve.engine.model_maker import resolve_model

    if not Path(topology).is_file():
        raise FileNotFoundError(f"--topology {topology}: no such file")
    return resolve_model(load_topology(topology))


async def _warmup(targets: list[str], vocab_size: int, timeout_s: float) -> None:
    from pdserve.api import AsyncClient

    rng = random.Random(10**6)
    for target in targets:
        async with AsyncClient(target, timeout_s=timeout_s) as c:
            for route in ("local", "remote"):
                for n in WARMUP_LENGTHS:
                    prompt = [rng.randrange(3, vocab_size) for _ in range(n)]
                    await c.generate(prompt, max_tokens=4, temperature=0.0, ignore_eos=True, route=route)


@dataclass
class ModeCluster:
    """One mode's running cluster, as the sweep drives it."""

    mode: str
    launcher: object
    state: object
    topology: object
    targets: list[str]
    vocab_size: int


def start_mode(cfg: SweepConfig, mode: str, model_dir: str, work: Path, log) -> ModeCluster:
    """Derive the mode's topology, start it with the launcher, warm it up."""
    import ray

    from pdserve.cluster.topology import load_topology
    from pdserve.launcher import Launcher, state_path

    path = derive_topology(cfg, mode, model_dir, work)
    topo = load_topology(path)
    if state_path(topo).exists():
        raise RuntimeError(f"{state_path(topo)} exists: a cluster of an earlier sweep may still run; "
                           f"stop it with `pdserve down --topology {path}`")
    launcher = Launcher(topo, str(path), model_dir, progress=lambda line: log(f"  [{mode}] {line}"))
    t0 = time.monotonic()
    state = launcher.up()
    # The driver needs Ray only to start and stop the workers (`down` reconnects); letting go
    # here lets several modes' clusters (each with its own Ray head) be up at once.
    ray.shutdown()
    cluster = ModeCluster(mode, launcher, state, topo, [e["grpc"] for e in state.decode_endpoints], 32000)
    try:
        cluster.vocab_size = int(model_info(cluster.targets[0]).get("vocab_size") or 32000)
        if cfg.warmup:
            asyncio.run(_warmup(cluster.targets, cluster.vocab_size, cfg.load.request_timeout_s))
    except BaseException:
        stop_mode(cluster)
        raise
    log(f"  [{mode}] up in {time.monotonic() - t0:.1f} s: {len(cluster.targets)} decode, "
        f"{topo.roles.prefill.replicas} prefill")
    return cluster


def stop_mode(cluster: ModeCluster) -> None:
    from pdserve.launcher import state_path

    cluster.launcher.down(cluster.state)
    state_path(cluster.topology).unlink(missing_ok=True)


def wait_for_quiet(cfg: SweepConfig, log) -> None:
    """Hold the next run until the 1-minute load average is under `wait_load_below` (or the timeout)."""
    if cfg.wait_load_below is None:
        return
    deadline = time.monotonic() + cfg.wait_load_timeout_s
    if os.getloadavg()[0] >= cfg.wait_load_below:
        log(f"  waiting for the 1-minute load average ({os.getloadavg()[0]:.1f}) to fall under "
            f"{cfg.wait_load_below:g} (at most {cfg.wait_load_timeout_s:g} s)")
    while os.getloadavg()[0] >= cfg.wait_load_below:
        if time.monotonic() > deadline:
            log(f"  load average still {os.getloadavg()[0]:.1f}: running anyway (recorded with the run)")
            return
        time.sleep(5)


async def _load_with_load_samples(targets, reqs, load, label, period_s: float = 2.0):
    """run_load, sampling the host's 1-minute load average while it runs."""
    samples: list[float] = []

    async def sample():
        while True:
            samples.append(os.getloadavg()[0])
            await asyncio.sleep(period_s)

    task = asyncio.create_task(sample())
    try:
        records, duration = await run_load(targets, reqs, load, label=label)
    finally:
        task.cancel()
    return records, duration, samples


def run_rate(cfg: SweepConfig, cluster: ModeCluster, i: int, model_dir: str, log, rep: int = 0) -> dict:
    """Run rate number i (repetition ``rep``) on one mode's cluster; returns the run's metrics
    with its raw samples. Every mode gets the same prompts for (i, rep); no two (i, rep) share any."""
    rate = cfg.request_rates[i]
    reqs = load_dataset(replace(cfg.dataset, seed=cfg.dataset.seed + 1000 * i + 100 * rep), cluster.vocab_size,
                        model_dir)
    load = replace(cfg.load, request_rate=rate, seed=cfg.load.seed + i)
    wait_for_quiet(cfg, log)
    load_before = os.getloadavg()
    started = time.time()
    records, duration, load_samples = asyncio.run(
        _load_with_load_samples(cluster.targets, reqs, load, f"{cluster.mode} @ {rate:g}/s "))
    m = compute_metrics(records, duration, slos=cfg.slos, percentiles=cfg.percentiles, num_workers=cfg.num_workers)
    m.update(mode=cluster.mode, request_rate=rate, burstiness=load.burstiness, max_concurrency=load.max_concurrency,
             num_workers=cfg.num_workers, prefill_workers=cluster.topology.roles.prefill.replicas,
             decode_workers=len(cluster.targets), started_at=started, load_avg_before=list(load_before),
             load_avg_after=list(os.getloadavg()), load_avg_1m_max=max(load_samples, default=None),
             requests=records_json(records))
    m["repeat"] = rep
    log(f"  [{cluster.mode}] rate {rate:g}/s{f' (run {rep + 1})' if cfg.repeats > 1 else ''}: "
        f"{m['completed']}/{m['num_prompts']} completed, "
        f"goodput {fmt(m['request_goodput'])} req/s, mean TTFT {fmt(m['mean_ttft_ms'], 0)} ms, "
        f"mean TPOT {fmt(m['mean_tpot_ms'], 1)} ms, remote {pct(m['route_mix']['remote_fraction'])}, "
        f"load {load_before[0]:.1f} -> max {fmt(m['load_avg_1m_max'], 1)}")
    return m


# -- the sweep --------------------------------------------------------------------------
def run_sweep(cfg: SweepConfig, log=lambda line: print(line, file=sys.stderr, flush=True)) -> dict:
    """Run every mode over every rate; writes and returns the sweep document.

    Sequential (default): one mode's cluster at a time, all its rates, then the
    next mode. Interleaved: every mode's cluster up at once, and for each rate
    the modes take turns (the order rotating per rate), so that a burst of
    foreign load on a shared host falls on all modes rather than on one.
    """
    from .plots import write_plots

    cfg.check()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("UCX_MODULES", "^ib")
    if cfg.ray_worker_niceness is not None:
        # Read by the raylet of the Ray head the launcher starts. Ray's default of 15 lets any
        # other process on the host preempt the workers, which turns a shared box's load into noise.
        os.environ["RAY_worker_niceness"] = str(cfg.ray_worker_niceness)
    out_dir = Path(cfg.output_dir).resolve()  # the derived topologies name files by absolute path
    work = out_dir / "topologies"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = base_model_dir(cfg.topology)
    doc = {
        "config": _config_json(cfg, model_dir),
        "environment": {"host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                        "load_avg_start": list(os.getloadavg()), "started_at": time.time()},
        "results": {mode: {} for mode in cfg.modes},
    }
    t0 = time.monotonic()
    rates = range(len(cfg.request_rates))
    if cfg.interleave:
        clusters: dict[str, ModeCluster] = {}
        try:
            for mode in cfg.modes:
                log(f"mode {mode}: {cfg.roles(mode)[0]} prefill + {cfg.roles(mode)[1]} decode workers")
                clusters[mode] = start_mode(cfg, mode, model_dir, work, log)
            for i in rates:
                runs: dict[str, list[dict]] = {mode: [] for mode in cfg.modes}
                for rep in range(cfg.repeats):  # repetitions interleaved too, the order rotating
                    k = (i * cfg.repeats + rep) % len(cfg.modes)
                    for mode in cfg.modes[k:] + cfg.modes[:k]:
                        runs[mode].append(run_rate(cfg, clusters[mode], i, model_dir, log, rep))
                for mode in cfg.modes:
                    doc["results"][mode][_rate_key(cfg.request_rates[i])] = median_run(runs[mode])
                _save(out_dir, doc)  # keep what finished if a later run fails
        finally:
            for cluster in clusters.values():
                stop_mode(cluster)
    else:
        for mode in cfg.modes:
            log(f"mode {mode}: {cfg.roles(mode)[0]} prefill + {cfg.roles(mode)[1]} decode workers")
            cluster = start_mode(cfg, mode, model_dir, work, log)
            try:
                for i in rates:
                    doc["results"][mode][_rate_key(cfg.request_rates[i])] = median_run(
                        [run_rate(cfg, cluster, i, model_dir, log, rep) for rep in range(cfg.repeats)])
            finally:
                stop_mode(cluster)
            _save(out_dir, doc)
    doc["environment"].update(load_avg_end=list(os.getloadavg()), wall_s=time.monotonic() - t0)
    doc["results"] = {mode: dict(sorted(runs.items(), key=lambda kv: float(kv[0])))
                      for mode, runs in doc["results"].items()}
    doc["table"] = sweep_table(doc["results"])
    doc["summary"] = sweep_summary(doc["results"])
    cdf_rate = cfg.cdf_rate if cfg.cdf_rate is not None else cfg.request_rates[len(cfg.request_rates) // 2]
    doc["plots"] = write_plots(doc, out_dir, cdf_rate)
    _save(out_dir, doc)
    return doc


# Figures whose spread over the repetitions the table reports (min, max beside the median run's).
SPREAD_KEYS = ("request_goodput", "slo_attainment", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
               "mean_tpot_ms")


def median_run(runs: list[dict]) -> dict:
    """The run with the median goodput (the lower middle for an even count), with the other
    runs' key figures as ``spread`` {key: [min, max]} and ``repeats`` (one dict per run)."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda m: (m["request_goodput"], m["slo_attainment"]))
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["repeats"] = [{k: m.get(k) for k in ("repeat", *SPREAD_KEYS)} for m in runs]
    mid["spread"] = {k: [min(v), max(v)] for k in SPREAD_KEYS
                     if (v := [m[k] for m in runs if m.get(k) is not None])}
    return mid


def _rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _config_json(cfg: SweepConfig, model_dir: str) -> dict:
    d = asdict(cfg)
    d["model_dir"] = model_dir
    d["roles"] = {m: dict(zip(("prefill", "decode"), cfg.roles(m))) for m in cfg.modes}
    d["load"]["request_rate"] = None  # per run, see request_rates
    return json_safe(d)


def _save(out_dir: Path, doc: dict) -> None:
    tmp = out_dir / "sweep.json.tmp"
    tmp.write_text(json.dumps(json_safe(doc), indent=1))
    tmp.replace(out_dir / "sweep.json")
