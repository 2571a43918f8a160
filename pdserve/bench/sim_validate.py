"""The simulator against real runs: the same traces on real clusters here and in `pdserve sim`.

    python bench/sim_validate.py                      # colocated and 1P1D, four traces, 2 cores
    python bench/sim_validate.py --systems 1p1d --mixes long-prompt:2.0 --requests 40 --reps 1

For each system (``colocated``: one `pdserve serve-decode` on both cores; ``1p1d``: the shipped
1P1D topology through `pdserve up`, one core per role), in one run:

1. its cost profile is measured here with the real engine, on the cores and with the engine
   arguments its workers get (`pdserve sim profile`, under taskset);
2. the server is started as a user starts it (bench/peer_serve.py `Server`);
3. each trace (a mix at a rate, fixed seed, saved as JSON lines) is replayed against it by the
   official OpenAI SDK: completions with the trace's prompt token ids, ``max_tokens`` its
   output length, ``ignore_eos``, streamed; TTFT, ITL and TPOT are taken from the chunks'
   arrival times as `vllm bench serve` takes them; a 429 is a refused request. It is replayed
   ``--reps`` times (the same arrivals and lengths, other prompts each time, so that no
   repetition hits what the last one cached) and each figure measured is the median of the
   repetitions (their range printed beside it): one run of a 60-request trace on a 2-core box
   moves its TTFT p50 by more than the bound the simulator is held to;
4. the same trace runs in the simulator with that profile, the topology and the router policy.

Before the traces, each server replays a calibration trace of its own (prompt- and decode-heavy
requests at rates no trace uses), ``--reps`` times; the profile is calibrated on it (each
request's median TTFT over the repetitions, their inter-token gaps together; sim/calibrate.py)
and then predicts the traces it never saw.
Both the calibrated and the uncalibrated predictions are printed, for the same rows: each in its
own table, and side by side (`comparison`: every figure's error both ways, and how many rows
each meets the bounds on). "Uncalibrated" is the profile as `pdserve sim profile` measured it
on the idle engine, before the fit: step costs alone, no serving costs (on a GPU host, a
roofline profile is the other uncalibrated starting point; this box has none: the roofline
knows GPUs only). `--report RESULT.json ...` prints the tables of recorded runs again, without
running or simulating anything.

Printed: predicted vs measured goodput (TTFT <= --slo-ttft and TPOT <= --slo-tpot), TTFT p50 and
p99 and ITL p99, with the relative error of each, the share of remote prefills and of prompt
tokens the prefix cache served; and a diagnostic table of what the routers predicted for both
routes and the engines' mean steps as their cost models timed them
(`pdserve_engine_step_seconds`, read before and after every replay). Written to
runs/sim-validate/result.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]  # the checkout (bench/ is pdserve/bench, linked from the top)
sys.path.insert(0, str(REPO))

from bench.host import add_autogroup_option, autogroups_off  # noqa: E402
from bench.peer_serve import ENGINE, SERVED_NAME, PeerConfig, Server  # noqa: E402
from pdserve.router import DEFAULT_POLICY, load_policy_file  # noqa: E402
from pdserve.sim.calibrate import fit, host_stalls  # noqa: E402
from pdserve.sim.cluster import SimTopology, Simulation  # noqa: E402
from pdserve.sim.profile import load_profile  # noqa: E402
from pdserve.sim.report import Slo, mean_step_ms, percentile, summarize  # noqa: E402
from pdserve.sim.workload import SimRequest, generate, mix, save_trace  # noqa: E402

MIXES = ("long-prompt:1.0", "long-prompt:2.0", "long-prompt:3.0", "decode-heavy:2.0", "decode-heavy:4.0", "prefix:1.5")
# What each system's workers run (bench/peer_serve.py starts them; configs/topologies/1p1d-local.yaml).
SYSTEM_ENGINE = {
    "colocated": {**ENGINE, "kv_cache_memory_bytes": 1 << 30},
    "1p1d": {"dtype": "float32", "attention_backend": "auto", "max_num_batched_tokens": 2048, "max_num_seqs": 64,
             "kv_cache_memory_bytes": 268435456},
}
SYSTEM_ENGINE["2d"] = {**ENGINE, "kv_cache_memory_bytes": 1 << 29}
TOPOLOGY = {"colocated": SimTopology(0, 1), "1p1d": SimTopology(1, 1), "2d": SimTopology(0, 2, ingress="gateway")}


class GatewayPair:
    """``2d``: two `pdserve serve-decode` workers, one core each, behind `pdserve gateway`
    (embedded etcd for their membership); clients call the gateway, which picks a worker per
    request by predicted TTFT. What the simulator runs as 0P2D with ``--ingress gateway``."""

    def __init__(self, model: str, cpus: list[int], work: Path, log):
        self.model, self.cpus, self.work, self.log = model, cpus, work / "2d", log
        self.work.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.etcd = None
        self.url = ""
        self.worker_urls: list[str] = []

    def metrics_urls(self) -> list[str]:
        return self.worker_urls  # the router's decisions are the workers' (the gateway only picks)

    def start(self) -> None:
        from bench.gateway import spawn, wait_line, warm_up
        from pdserve.cluster.etcd_server import EmbeddedEtcd

        self.etcd = EmbeddedEtcd(self.work / "etcd")
        self.etcd.__enter__()
        workers = []
        for i in range(2):
            path = self.work / f"decode-{i}.log"
            core = self.cpus[i % len(self.cpus)]
            proc = spawn(["serve-decode", "--model", self.model, "--etcd", self.etcd.endpoint, "--cluster", "simval",
                          "--worker-id", f"decode-{i}", "--grpc-port", "0", "--http-port", "0",
                          "--served-model-name", SERVED_NAME, "--engine-args", json.dumps(SYSTEM_ENGINE["2d"])],
                         path, cpus=str(core), env={"OMP_NUM_THREADS": "1"})
            self.procs.append(proc)
            workers.append((proc, path))
        self.worker_urls = []
        for proc, path in workers:
            m = wait_line(path, r"gRPC (\S+)  HTTP (\S+)", proc)
            warm_up(m.group(1))
            self.worker_urls.append(m.group(2))
        path = self.work / "gateway.log"
        gw = spawn(["gateway", "--etcd", self.etcd.endpoint, "--cluster", "simval", "--model", self.model], path)
        self.procs.append(gw)
        self.url = wait_line(path, r"gRPC (\S+), HTTP (\S+), 2 decode worker", gw).group(2)
        self.log(f"   gateway at {self.url} in front of decode-0 (core {self.cpus[0]}) and decode-1 "
                 f"(core {self.cpus[1 % len(self.cpus)]})")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        if self.etcd is not None:
            self.etcd.__exit__(None, None, None)
KEYS = ("goodput_req_s", "ttft_p50", "ttft_p99", "itl_p99")
REP_RID = 10_000_000  # repetition k of a trace: its rids moved by k x this


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def profile(system: str, model: str, cores: list[int], work: Path) -> Path:
    """Measure the system's worker profile on the cores one of its workers gets."""
    out = work / f"profile-{system}.yaml"
    share = cores if system == "colocated" else cores[:1]  # 1p1d and 2d: a core per worker
    cmd = ["taskset", "-c", ",".join(map(str, share)), sys.executable, "-m", "pdserve", "sim", "profile",
           "--model", model, "--out", str(out), "--name", f"{system} worker, cores {share}"]
    for k, v in SYSTEM_ENGINE[system].items():
        cmd += ["--engine-arg", f"{k}={v}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


async def replay(url: str, trace: list[SimRequest], timeout_s: float) -> list[dict]:
    """Send each request at its time; per request: refused, first token, token times."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout_s)
    t0 = time.perf_counter() + 0.5

    async def one(r: SimRequest) -> dict:
        await asyncio.sleep(max(0.0, t0 + r.t - time.perf_counter()))
        sent = time.perf_counter()
        times, cached, why = [], None, None
        try:
            stream = await client.completions.create(
                model=SERVED_NAME, prompt=r.token_ids(), max_tokens=r.output_len, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices:
                    times.append(time.perf_counter())
                    extra = (chunk.choices[0].model_extra or {}).get("pdserve")  # on the final chunk
                    if isinstance(extra, dict) and extra.get("cached_tokens") is not None:
                        cached = extra["cached_tokens"]
                        why = {k: extra.get(k) for k in ("route", "reason", "predicted_ttft_local_ms",
                                                         "predicted_ttft_remote_ms", "worker_id")}
        except openai.RateLimitError:
            return {"rid": r.rid, "refused": True}
        except openai.APIError as exc:
            return {"rid": r.rid, "error": str(exc)[:200]}
        return {"rid": r.rid, "refused": False, "sent": sent, "times": times, "output_len": r.output_len,
                "prompt_len": r.prompt_len, "cached": cached, "decision": why}

    try:
        return await asyncio.gather(*(one(r) for r in trace))
    finally:
        await client.close()


CALIBRATION_GROUPS = 500  # the calibration's shared prefixes: groups no trace uses


def calibration_trace(seed: int) -> list[SimRequest]:
    """What a profile is calibrated on, at rates no validation trace uses and with prompts of its
    own: prompt-heavy requests (1.5 req/s) beside decode-heavy ones (1 req/s), then a decode-heavy
    stretch at 3 req/s (a busy worker's streaming cost shows only under many streams), then
    prompts behind shared prefixes at 1 req/s: long prompts whose prefill is short, what tells the
    cost of a prompt's tokens outside the engine from the cost of computing them."""
    a = generate(mix("long-prompt", 1.5, 30), seed + 1, first_rid=700_000)
    b = generate(mix("decode-heavy", 1.0, 20), seed + 2, first_rid=800_000)
    start = max(r.t for r in a + b) + 5.0
    c = [dataclasses.replace(r, t=round(r.t + start, 6))
         for r in generate(mix("decode-heavy", 3.0, 30), seed + 3, first_rid=850_000)]
    start = max(r.t for r in c) + 5.0
    d = [dataclasses.replace(r, t=round(r.t + start, 6), prefix_group=r.prefix_group + CALIBRATION_GROUPS)
         for r in generate(mix("prefix", 1.0, 24), seed + 4, first_rid=880_000)]
    return sorted(a + b + c + d, key=lambda r: (r.t, r.rid))


def scrape(urls: list[str]) -> dict[str, float]:
    """The decode workers' counters so far, summed over their /metrics: the routers' decisions by
    route (``route:NAME``) and the engine steps' seconds and count by kind (``step:KIND:sum``,
    ``step:KIND:count``; decode or mixed, as the cost model times them)."""
    out: dict[str, float] = {}
    for url in urls:
        base = url.split("/v1/")[0]
        try:
            with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            m = re.match(r'pdserve_router_decisions_total\{(.*)\} (\S+)$', line)
            route = m and re.search(r'route="([^"]+)"', m.group(1))
            if route:
                key = f"route:{route.group(1)}"
                out[key] = out.get(key, 0.0) + float(m.group(2))
            m = re.match(r'pdserve_engine_step_seconds_(sum|count)\{(.*)\} (\S+)$', line)
            kind = m and 'role="decode"' in m.group(2) and re.search(r'kind="(\w+)"', m.group(2))
            if kind:
                key = f"step:{kind.group(1)}:{m.group(1)}"
                out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def step_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean engine step (ms) of each kind between two scrapes (None: no such step, or not exposed)."""
    out = {}
    for kind in ("decode", "mixed"):
        n = after.get(f"step:{kind}:count", 0.0) - before.get(f"step:{kind}:count", 0.0)
        total = after.get(f"step:{kind}:sum", 0.0) - before.get(f"step:{kind}:sum", 0.0)
        out[f"step_{kind}_ms"] = total / n * 1e3 if n > 0 else None
    return out


def real_routes(work: Path, system: str, label: str, reps: int) -> dict[str, float] | None:
    """Routes the real routers took per repetition of a trace (the mean; None if not recorded)."""
    paths = [work / f"routes-{system}-{label}-r{k}.json" for k in range(reps)]
    if not all(p.is_file() for p in paths):
        return None
    out: dict[str, float] = {}
    for p in paths:
        for route, n in json.loads(p.read_text()).items():
            out[route] = out.get(route, 0.0) + n / reps
    return out


def share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def real_steps(work: Path, system: str, label: str, reps: int) -> dict[str, float | None]:
    """The real engines' mean step of each kind over the repetitions (median; None: not recorded)."""
    runs = [json.loads(p.read_text()) for p in (work / f"steps-{system}-{label}-r{k}.json" for k in range(reps))
            if p.is_file()]
    return {k: statistics.median(r[k] for r in runs) if runs and all(r.get(k) for r in runs) else None
            for k in ("step_decode_ms", "step_mixed_ms")}


def remote_share(routes: dict | None) -> str:
    if not routes:
        return "n/a"
    total = sum(routes.values())
    return f"{routes.get('remote', 0) / total:.0%}" if total else "n/a"


def variant(trace: list[SimRequest], k: int) -> list[SimRequest]:
    """Repetition ``k`` of ``trace``: the same arrivals and lengths, prompts of its own (ids and
    shared-prefix groups moved), so that the server's prefix cache holds nothing of it."""
    if k == 0:
        return trace
    return [dataclasses.replace(r, rid=r.rid + k * REP_RID,
                                prefix_group=None if r.prefix_group is None else r.prefix_group + k * 1000)
            for r in trace]


def merged(runs: list[dict[int, dict]]) -> dict[int, dict]:
    """Per base rid: the median TTFT over the repetitions and every inter-token gap of them."""
    out: dict[int, dict] = {}
    for k, run in enumerate(runs):
        for rid, m in run.items():
            slot = out.setdefault(rid - k * REP_RID, {"ttfts": [], "itl_ms": [], "cached": [], "routes": []})
            slot["ttfts"].append(m["ttft_ms"])
            slot["itl_ms"].extend(m["itl_ms"])
            if m.get("cached") is not None:
                slot["cached"].append(m["cached"])
            if m.get("route"):
                slot["routes"].append(m["route"])
    return {rid: {"ttft_ms": statistics.median(m.pop("ttfts")), "itl_ms": m["itl_ms"],
                  "cached": statistics.median(m["cached"]) if m["cached"] else None,
                  # the route the real router took most often (calibration pairs only like with like)
                  "route": max(set(m["routes"]), key=m["routes"].count) if m["routes"] else None}
            for rid, m in out.items()}


def over_reps(summaries: list[dict]) -> dict:
    """The median of each figure over the repetitions, with the range of the ones compared."""
    out = {k: statistics.median(s[k] for s in summaries) if all(s[k] is not None for s in summaries) else None
           for k in summaries[0]}
    out["range"] = {k: [min(s[k] for s in summaries), max(s[k] for s in summaries)] for k in KEYS
                    if all(s[k] is not None for s in summaries)}
    out["reps"] = len(summaries)
    return out


def per_request(results: list[dict]) -> dict[int, dict]:
    """rid -> the TTFT and inter-token gaps the client measured (what calibration pairs with)."""
    return {r["rid"]: {"ttft_ms": (r["times"][0] - r["sent"]) * 1e3,
                       "itl_ms": [(b - a) * 1e3 for a, b in zip(r["times"], r["times"][1:])],
                       "cached": r.get("cached"), "route": (r.get("decision") or {}).get("route")}
            for r in results if not r.get("refused") and not r.get("error") and r.get("times")}


def measured_summary(results: list[dict], slo: Slo) -> dict:
    done = [r for r in results if not r.get("refused") and not r.get("error") and r.get("times")]
    ttft = [(r["times"][0] - r["sent"]) * 1e3 for r in done]
    tpot = [((r["times"][-1] - r["times"][0]) * 1e3 / (len(r["times"]) - 1)) if len(r["times"]) > 1 else 0.0
            for r in done]
    itl = [(b - a) * 1e3 for r in done for a, b in zip(r["times"], r["times"][1:])]
    start = min((r["sent"] for r in done), default=0.0)
    end = max((r["times"][-1] for r in done), default=start)
    good = sum(1 for a, b in zip(ttft, tpot) if a <= slo.ttft_ms and b <= slo.tpot_ms)
    duration = max(end - start, 1e-9)
    said = [r["decision"] for r in done if r.get("decision")]
    known = [r for r in done if r.get("cached") is not None and r.get("prompt_len")]
    cached = sum(r["cached"] for r in known) / sum(r["prompt_len"] for r in known) if known else None
    return {**predictions([d.get("predicted_ttft_local_ms") for d in said],
                          [d.get("predicted_ttft_remote_ms") for d in said]),
            "cached_share": cached, "completed": len(done), "refused": sum(1 for r in results if r.get("refused")),
            "errors": sum(1 for r in results if r.get("error")), "goodput_req_s": good / duration,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "itl_p99": percentile(itl, 99),
            "duration_s": duration}


def predictions(local: list, remote: list) -> dict:
    """The routers' TTFT predictions of both routes, p50 over the requests (None: not recorded)."""
    local, remote = [x for x in local if x], [x for x in remote if x]
    return {"predicted_local_p50": percentile(local, 50) if local else None,
            "predicted_remote_p50": percentile(remote, 50) if remote else None}


def simulated_summary(trace, prof, system: str, policy, slo: Slo, seed: int, reps: int = 1) -> dict:
    """The simulated figures of ``trace``: with ``reps`` > 1, each the median over that many runs
    with seeds ``seed``, ``seed + 1``, ... (the step noise and host stalls drawn anew), as each
    measured figure is the median of the real repetitions; a p99 of 60 requests is about their
    slowest one, so one simulated run against the median of three real ones compares a single
    draw of the tail with a middle one."""
    runs = [_simulated_once(trace, prof, system, policy, slo, seed + k) for k in range(max(1, reps))]
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and all(isinstance(r[k], (int, float)) for r in runs):
            out[k] = statistics.median(r[k] for r in runs)
    out["sim_reps"] = len(runs)
    return out


def _simulated_once(trace, prof, system: str, policy, slo: Slo, seed: int) -> dict:
    sim = Simulation(trace, prof, policy, TOPOLOGY[system], seed=seed).run()
    s = summarize(sim, slo)
    # the same span the client measures: first send to last token (the trace's first arrival is t > 0)
    first = min(r.arrival for r in sim.records)
    duration = s["duration_s"] - first
    done = [r for r in sim.records if r.first_token is not None]
    cached = sum(r.cached_len for r in done) / max(1, sum(r.prompt_len for r in done))
    steps = {f"step_{kind}_ms": mean_step_ms(sim, kind) for kind in ("decode", "mixed")}
    return {**steps, **predictions([r.predicted_local_ms for r in done], [r.predicted_remote_ms for r in done]),
            "cached_share": cached, "completed": s["completed"], "refused": sum(s["refused"].values()),
            "goodput_req_s": s["good"] / duration, "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "itl_p99": s["itl_ms"]["p99"], "duration_s": duration, "routes": s["routes"]}


def err(pred, meas):
    return None if pred is None or not meas else (pred - meas) / meas


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="colocated,1p1d")
    ap.add_argument("--mixes", default=",".join(MIXES), help="MIX:RATE,... (mixes of sim/workload.py)")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--reps", type=int, default=3, help="replays of each trace (other prompts each time); the "
                    "figures measured are their medians")
    ap.add_argument("--contention", default="0", help="contention values the calibration tries (ms of host CPU per "
                    "token streamed, comma-separated; default 0: none; sim/calibrate.py)")
    ap.add_argument("--step-times", action="store_true", help="fit the steps to the engines' own step times "
                    "(pdserve_engine_step_seconds, recorded either way) and the rest of the tokens' period to "
                    "what the workers do between steps; default: the steps to the clients' inter-token gaps "
                    "(validated better end to end in session 19: docs/PERFORMANCE.md)")
    ap.add_argument("--host-stalls", action="store_true",
                    help="model the host's stalls measured in the calibration runs (sim/calibrate.py host_stalls: "
                         "silences of every stream while one decodes) in the calibrated profile")
    ap.add_argument("--sim-reps", type=int, default=None,
                    help="simulated runs of each trace (seeds --seed, --seed + 1, ...), each figure their median as "
                         "the measured ones are the real repetitions' (default: --reps)")
    ap.add_argument("--cpus", default="0,1", help="the cores every server runs on")
    ap.add_argument("--model", default=str(REPO / ".cache/models/pdserve-tiny-llama"))
    ap.add_argument("--slo-ttft", type=float, default=1500.0)
    ap.add_argument("--slo-tpot", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=str(REPO / "runs/sim-validate"))
    ap.add_argument("--offline", action="store_true", help="no servers: the runs recorded in --work (raw-*.json), "
                    "calibrated and simulated again")
    ap.add_argument("--report", nargs="+", metavar="RESULT_JSON", help="print the tables of recorded results "
                    "(runs/sim-validate/result.json, docs/peer/*sim-validate*.json) and exit: nothing is run")
    add_autogroup_option(ap)
    args = ap.parse_args(argv)
    if args.report:
        rows = [row for path in args.report for row in json.loads(Path(path).read_text())["rows"]]
        print(comparison(rows, sources=", ".join(args.report)))
        return 0
    if args.sim_reps is None:
        args.sim_reps = args.reps
    if args.sim_reps < 1:
        ap.error(f"--sim-reps {args.sim_reps}: at least 1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    cores = [int(c) for c in args.cpus.split(",")]
    mixes = [(m.split(":")[0], float(m.split(":")[1])) for m in args.mixes.split(",")]
    rows, calibrations, profiles = [], {}, {}
    with autogroups_off("keep" if args.offline else args.autogroups, log) as host:
        for system in args.systems.split(","):
            policy = load_policy_file(REPO / "configs/router/default.yaml") if system == "1p1d" else DEFAULT_POLICY
            prof_path = work / f"profile-{system}.yaml"
            server = None
            if not args.offline:
                log(f"== {system}: profiling its worker on {cores if system == 'colocated' else cores[:1]} ...")
                profile(system, args.model, cores, work)
                server = (GatewayPair(args.model, cores, work, log) if system == "2d" else
                          Server(PeerConfig(model=args.model, cpus=args.cpus, work_dir=str(work)), system, log))
                log(f"== {system}: starting the server")
                server.start()
            urls = server.metrics_urls() if isinstance(server, GatewayPair) else [server.url] if server else []

            def measured(label: str, trace, warm_rid: int | None = None) -> list[list[dict]]:
                """The ``--reps`` runs of ``trace`` against the server, each after a warm-up of other
                prompts when ``warm_rid`` is given (or, offline, as recorded then)."""
                runs = []
                for k in range(args.reps):
                    raw = work / f"raw-{system}-{label}-r{k}.json"
                    if args.offline:
                        runs.append(json.loads(raw.read_text()))
                        continue
                    if warm_rid is not None:
                        warm = generate(mix("long-prompt", 4.0, 3), args.seed, first_rid=warm_rid + k * REP_RID)
                        asyncio.run(replay(server.url, warm, 120.0))
                    before = scrape(urls)
                    results = asyncio.run(replay(server.url, variant(trace, k), 300.0))
                    after = scrape(urls)
                    routes = {r[6:]: after[r] - before.get(r, 0.0) for r in after
                              if r.startswith("route:") and after[r] > before.get(r, 0.0)}
                    (work / f"routes-{system}-{label}-r{k}.json").write_text(json.dumps(routes))
                    (work / f"steps-{system}-{label}-r{k}.json").write_text(json.dumps(step_means(before, after)))
                    raw.write_text(json.dumps(results))
                    runs.append(results)
                    log(f"     repetition {k + 1}/{args.reps}: " + fmt_measured(measured_summary(results, slo))
                        + f" | routes {routes}")
                return runs

            try:
                calib = calibration_trace(args.seed)
                if server is not None:  # first-call costs, not timed
                    asyncio.run(replay(server.url, generate(mix("long-prompt", 4.0, 3), args.seed, first_rid=990_000),
                                       120.0))
                log(f"   calibration: {len(calib)} requests (long-prompt 1.5 + decode-heavy 1 req/s, then decode-heavy "
                    "3 req/s, then shared prefixes at 1 req/s)")
                calib_runs = measured("calibration", calib)
                real = merged([per_request(run) for run in calib_runs])
                save_trace(calib, work / f"calibration-{system}.jsonl")
                with open(work / f"measured-{system}.jsonl", "w") as f:  # what `pdserve sim calibrate` reads
                    for rid, m in sorted(real.items()):
                        f.write(json.dumps({"rid": rid, **m}) + "\n")
                # every process here (servers, workers, this client) shares the box's cores
                raw = dataclasses.replace(load_profile(prof_path), contention_scope="cluster")
                stalls = host_stalls(calib_runs)
                log(f"   host stalls in the calibration runs: {stalls}")
                fit_from = raw if not args.host_stalls else dataclasses.replace(
                    raw, **{k: stalls[k] for k in ("stall_rate_per_s", "stall_median_ms", "stall_sigma")})
                steps = real_steps(work, system, "calibration", args.reps)  # the engines' own step times
                log(f"   the real engines' mean steps over the calibration: {steps}")
                prof, fitted = fit(calib, fit_from, policy, TOPOLOGY[system], real, args.seed,
                                   note=f"bench/sim_validate.py calibration trace, {system}",
                                   contention=tuple(float(x) for x in args.contention.split(",")),
                                   decode_step_ms=steps["step_decode_ms"] if args.step_times else None)
                prof.save(work / f"profile-{system}-calibrated.yaml")
                profiles[system] = {"uncalibrated": raw.source, "calibrated": prof.assumptions[-1]}
                fitted["host_stalls"] = stalls if args.host_stalls else None
                log(f"   calibrated: {fitted}")
                calibrations[system] = fitted
                for i, (name, rate) in enumerate(mixes):
                    # each trace its own prompts (the server's prefix cache outlives a trace; the
                    # simulator starts empty), and a warm-up of other prompts
                    trace = generate(mix(name, rate, args.requests), args.seed, first_rid=(i + 1) * 100_000)
                    save_trace(trace, work / f"trace-{name}-{rate:g}.jsonl")
                    log(f"   {name} at {rate:g} req/s: {len(trace)} requests x {args.reps}")
                    meas = over_reps([measured_summary(run, slo)
                                      for run in measured(f"{name}-{rate:g}", trace, (i + 1) * 100_000 + 90_000)])
                    meas["routes"] = real_routes(work, system, f"{name}-{rate:g}", args.reps)
                    meas.update(real_steps(work, system, f"{name}-{rate:g}", args.reps))
                    pred = simulated_summary(trace, prof, system, policy, slo, args.seed, args.sim_reps)
                    uncal = simulated_summary(trace, raw, system, policy, slo, args.seed, args.sim_reps)
                    keys = KEYS
                    row = {"system": system, "mix": name, "rate": rate, "measured": meas, "simulated": pred,
                           "error": {k: err(pred[k], meas[k]) for k in keys},
                           "uncalibrated": uncal, "uncalibrated_error": {k: err(uncal[k], meas[k]) for k in keys}}
                    rows.append(row)
                    log("   " + fmt(row))
            finally:
                if server is not None:
                    server.stop()
    done = set(args.systems.split(","))  # the systems of earlier runs stay in the result
    old = json.loads((work / "result.json").read_text()) if (work / "result.json").is_file() else {}
    rows = [r for r in old.get("rows", []) if r["system"] not in done] + rows
    calibrations = {**{k: v for k, v in old.get("calibrations", {}).items() if k not in done}, **calibrations}
    profiles = {**{k: v for k, v in old.get("profiles", {}).items() if k not in done}, **profiles}
    (work / "result.json").write_text(json.dumps({"rows": rows, "calibrations": calibrations, "profiles": profiles,
                                                  "host": old.get("host") if args.offline else host}, indent=1))
    print(table(rows))
    print()
    print(table(rows, "uncalibrated"))
    print()
    print(router_table(rows))
    print()
    print(comparison(rows, profiles))
    return 0


def fmt_measured(m: dict) -> str:
    return " | ".join(f"{k} {m[k]:.3g}" for k in KEYS if m[k] is not None)


def fmt(row) -> str:
    m, p, e = row["measured"], row["simulated"], row["error"]
    return " | ".join(f"{k} sim {p[k]:.3g} / real {m[k]:.3g} ({e[k]:+.0%})" if e[k] is not None else f"{k} n/a"
                      for k in ("goodput_req_s", "ttft_p50", "ttft_p99", "itl_p99"))


BOUNDS = {"goodput_req_s": 0.15, "ttft_p50": 0.15, "ttft_p99": 0.25}  # the bounds


def within(errors: dict) -> bool:
    return all(errors[k] is not None and abs(errors[k]) <= b for k, b in BOUNDS.items())


def table(rows, which: str = "simulated") -> str:
    head = ("| system | mix | rate | goodput sim / real | err | TTFT p50 sim / real ms | err | "
            "TTFT p99 sim / real ms | err | ITL p99 sim / real ms | err | real TTFT p50 over reps | "
            "remote prefills sim / real | prompt tokens cached sim / real | completed sim / real | "
            "within 15 / 15 / 25 % |")
    out = [head, "|" + "---|" * 16]
    for r in rows:
        m, p = r["measured"], r[which]
        e = r["error"] if which == "simulated" else r["uncalibrated_error"]
        cells = [r["system"], r["mix"], f"{r['rate']:g}"]
        for k in KEYS:
            cells += [f"{p[k]:.3g} / {m[k]:.3g}", "n/a" if e[k] is None else f"{e[k]:+.0%}"]
        lo, hi = m.get("range", {}).get("ttft_p50", (m["ttft_p50"], m["ttft_p50"]))
        cells.append(f"{lo:.3g}-{hi:.3g} ({m.get('reps', 1)})")
        cells.append(f"{remote_share(p.get('routes'))} / {remote_share(m.get('routes'))}")
        cells.append(f"{share(p.get('cached_share'))} / {share(m.get('cached_share'))}")
        cells.append(f"{p['completed']} / {m['completed']:g}")
        cells.append("**yes**" if within(e) else "no")
        out.append("| " + " | ".join(cells) + " |")
    n = sum(within(r["error"] if which == "simulated" else r["uncalibrated_error"]) for r in rows)
    out.append(f"\n{n} of {len(rows)} rows within the bounds ({which})")
    return "\n".join(out)

def comparison(rows, profiles: dict | None = None, sources: str = "") -> str:
    """The same rows predicted from the calibrated profile and from the uncalibrated one (the
    idle engine's, as measured), side by side: each bounded figure's error both ways, and on how
    many rows each meets the bounds. ``profiles``: per system, what each profile rests on."""
    head = ("| system | mix | rate | goodput err cal / uncal | TTFT p50 err cal / uncal | TTFT p99 err cal / uncal | "
            "ITL p99 err cal / uncal | within 15 / 15 / 25 % cal / uncal |")
    out = [head, "|" + "---|" * 8]

    def pct(e):
        return "n/a" if e is None else f"{e:+.0%}"

    for r in rows:
        cal, unc = r["error"], r["uncalibrated_error"]
        cells = [r["system"], r["mix"], f"{r['rate']:g}"]
        cells += [f"{pct(cal[k])} / {pct(unc[k])}" for k in KEYS]
        cells.append(f"{'**yes**' if within(cal) else 'no'} / {'**yes**' if within(unc) else 'no'}")
        out.append("| " + " | ".join(cells) + " |")
    n_cal = sum(within(r["error"]) for r in rows)
    n_unc = sum(within(r["uncalibrated_error"]) for r in rows)
    out.append(f"\nWithin the bounds: calibrated {n_cal} of {len(rows)} rows, uncalibrated {n_unc} of {len(rows)}"
               + (f" ({sources})" if sources else ""))
    for system, p in sorted((profiles or {}).items()):
        out.append(f"{system}: uncalibrated = {p['uncalibrated']}; calibrated = {p['calibrated']}")
    return "\n".join(out)


def router_table(rows) -> str:
    """What the routers predicted for both routes (p50 over the requests) and the engines' mean
    steps as their cost models timed them, simulated and real: where routes or chunking differ,
    which input differs."""
    out = ["| system | mix | rate | predicted local TTFT p50 sim / real ms | predicted remote TTFT p50 sim / real ms "
           "| mean decode step sim / real ms | mean mixed step sim / real ms | remote prefills sim / real |",
           "|" + "---|" * 8]
    for r in rows:
        m, p = r["measured"], r["simulated"]
        cells = [r["system"], r["mix"], f"{r['rate']:g}"]
        for k in ("predicted_local_p50", "predicted_remote_p50", "step_decode_ms", "step_mixed_ms"):
            cells.append(" / ".join("n/a" if x.get(k) is None else f"{x[k]:.3g}" for x in (p, m)))
        cells.append(f"{remote_share(p.get('routes'))} / {remote_share(m.get('routes'))}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.exit(main())
