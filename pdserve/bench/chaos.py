"""Chaos soak: a live 1P1D cluster under steady mixed load while faults fire.

    python bench/chaos.py [--duration 600] [--rate 2] [--faults kill_prefill,restart_etcd,kill_queue]
                          [--fault-every 30] [--output runs/chaos.json]

What it does, in one run:
- starts etcd (its own, so that it can restart it) and the topology with the
  launcher (Ray head, queue actor, workers as detached actors);
- computes the greedy reference of a pool of prompts with `LLM.generate` on the
  same model directory (short chats and long documents);
- sends those prompts at ``--rate`` requests/s (Poisson) to the decode worker
  over gRPC, half of them forced remote, for ``--duration`` seconds;
- every ``--fault-every`` seconds fires the next fault, round-robin:
  ``kill_prefill`` (SIGKILL of the prefill worker's process: Ray restarts it),
  ``restart_etcd`` (SIGKILL of etcd, restarted on the same port and data 2 s
  later), ``kill_queue`` (the prefill queue actor killed: Ray restarts it);
- waits for the in-flight requests, then for the decode worker's KV pool to
  drain (quarantines included), and reports:

      sent / completed exactly / wrong output / failed with a typed retriable
      error (UNAVAILABLE, RESOURCE_EXHAUSTED) / lost (anything else: a hang
      past the request deadline, INTERNAL, a broken stream) / blocks leaked,
      and TTFT p50/p99 outside and during faults (the ``--fault-window``
      seconds after each fault).

A healthy build loses nothing, leaks nothing and answers every completed
request token-exact.

The faults of clients and hung processes (bench/chaos_faults.py):
``stop_prefill`` (SIGSTOP of the prefill worker for ``--stop`` seconds: hung, its
lease still alive), ``abort_storm`` (50 remote streams dropped by their clients
within 3 s) and ``reuse_ids`` (request ids sent again right after a disconnect:
a reused id answered with another request's tokens counts as crossed, must be 0),
``hang_compute`` (the prefill worker's compute thread blocked for ``--hang`` seconds
while its event loop and heartbeat go on: the queue must fail its tasks back by
their compute progress), ``poison_request`` (requests the engine fails on every
worker, sent through a gateway in front of the decode workers, which the run adds
if the topology has none: each must come back as its own error while every other
request is served) and ``second_cluster`` (a second `pdserve up` cluster started on
this host mid-run, served token-exact, then stopped, while this one runs) and
``loan_race`` (fresh prefixes cached by the decode worker, then sent remote so that
the prefill worker borrows them, while a flood of fresh local prompts presses the
holder's pool; the run turns on ``kv_transport.verify``: every lent block is
checksummed, and the report counts loans granted, confirmed, stale and checksum
mismatches, which must be 0). The hang and the poison are failpoints
(common/failpoints.py) that this run turns on in its cluster's environment only.

``--hosts`` (root) runs the same across three network-namespace hosts (head,
prefill, decode; bench/chaos_hosts.py) and adds the fault ``link_prefill``:
the prefill host's link pulled for ``--link-down`` seconds, then restored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import yaml

FAULTS = ("kill_prefill", "restart_etcd", "kill_queue", "stop_prefill", "abort_storm", "reuse_ids", "hang_compute",
          "poison_request", "second_cluster", "loan_race", "link_prefill")
ONE_HOST_FAULTS = tuple(f for f in FAULTS if f != "link_prefill")  # link_prefill needs hosts (--hosts)
# The failpoints each fault needs turned on in the cluster's workers (common/failpoints.py).
FAILPOINTS = {"hang_compute": "prefill.hang_compute", "poison_request": "request.poison"}
RETRIABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")


@dataclass
class ChaosConfig:
    topology: str = "configs/topologies/1p1d-local.yaml"
    duration_s: float = 600.0
    request_rate: float = 2.0
    faults: tuple[str, ...] = ONE_HOST_FAULTS
    fault_every_s: float = 30.0
    first_fault_s: float = 10.0
    fault_window_s: float = 15.0  # TTFT "during faults" counts requests sent this long after a fault
    num_prompts: int = 24  # distinct prompts, sent round-robin (their reference is computed once)
    short_len: tuple[int, int] = (8, 48)
    long_len: tuple[int, int] = (300, 600)
    max_tokens: int = 8
    remote_share: float = 0.5  # forced-remote share of the requests (the rest: router's choice)
    request_timeout_s: float = 120.0  # a request still running this long is lost
    settle_timeout_s: float = 90.0  # after the load: how long the KV pool may take to drain
    seed: int = 0
    work_dir: str | None = None
    output: str | None = None
    hosts: dict | None = None  # the host plan when run across hosts (bench/chaos_hosts.py)
    link_down_s: float = 0.0  # link_prefill: seconds the link is down (0: lease TTL + 4 s)
    stop_s: float = 8.0  # stop_prefill: seconds the prefill worker stays SIGSTOPped
    storm_size: int = 50  # abort_storm: streams dropped
    reuse_pairs: int = 8  # reuse_ids: ids reused after a disconnect
    hang_s: float = 8.0  # hang_compute: seconds the prefill worker's compute thread stays blocked
    poison_count: int = 4  # poison_request: poison requests per firing
    second_requests: int = 4  # second_cluster: requests sent to the second cluster
    race_prefixes: int = 6  # loan_race: fresh long prefixes per firing, each lent once
    race_flood: int = 24  # loan_race: fresh long local prompts sent beside the loans (eviction pressure)


@dataclass
class Outcome:
    i: int
    sent_s: float
    kind: str
    route: str
    result: str = "lost"  # exact | mismatch | UNAVAILABLE | RESOURCE_EXHAUSTED | lost
    detail: str = ""
    ttft_ms: float | None = None
    in_fault: bool = False


@dataclass
class Fault:
    kind: str
    at_s: float
    detail: str = ""
    recovered_s: float | None = None  # seconds until the cluster had its members back
    waiting_for: str = ""  # what was still missing at the last check (if it never recovered)


@dataclass
class Report:
    config: dict
    sent: int = 0
    exact: int = 0
    mismatch: int = 0
    retriable: dict = field(default_factory=dict)
    lost: int = 0
    leaked_blocks: int | None = None
    ttft_ms: dict = field(default_factory=dict)
    faults: list = field(default_factory=list)
    lost_details: list = field(default_factory=list)
    elapsed_s: float = 0.0
    client_faults: dict = field(default_factory=dict)  # chaos_faults.ClientFaultStats: aborted, reused, crossed


# -- the cluster --------------------------------------------------------------------------
def derive_topology(cfg: ChaosConfig, model_dir: str, etcd_endpoint: str, work: Path) -> Path:
    """The base topology with this run's etcd, free ports, its own cluster and queue names."""
    base = yaml.safe_load(Path(cfg.topology).read_text())
    topo = dict(base)
    topo["cluster"] = f"chaos-{os.getpid()}"
    topo["model"] = {"path": str(Path(model_dir).resolve())}
    roles = json.loads(json.dumps(base.get("roles", {})))
    for spec in roles.values():
        spec["ports"] = {name: 0 for name in spec.get("ports", {})}
    topo["roles"] = roles
    if base.get("router_policy"):
        topo["router_policy"] = str((Path(cfg.topology).parent / base["router_policy"]).resolve())
    topo["autoscale_policy"] = None
    topo["etcd"] = {**(base.get("etcd") or {}), "endpoints": [etcd_endpoint]}
    topo["etcd"].pop("data_dir", None)
    topo["queue"] = {**(base.get("queue") or {}), "name": f"{topo['cluster']}-queue"}
    topo["run_dir"] = str((work / "runs").resolve())
    if "poison_request" in cfg.faults and not (base.get("gateway") or {}).get("replicas"):
        topo["gateway"] = {"replicas": 1}  # the poison must go through a gateway (its pool is what it could empty)
    if "loan_race" in cfg.faults:  # every lent block checksummed: a torn read would be counted
        network = dict(topo.get("network") or {})
        network["kv_transport"] = {**(network.get("kv_transport") or {}), "lending": True, "verify": True}
        topo["network"] = network
    if topo.get("gateway"):
        topo["gateway"] = {**topo["gateway"], "grpc_port": 0, "http_port": 0}
    if topo.get("kv_index"):
        topo["kv_index"] = {**topo["kv_index"], "port": 0}
    if cfg.hosts:
        from pdserve.bench.chaos_hosts import place

        topo = place(topo, cfg.hosts)
    path = work / "topology.yaml"
    path.write_text(yaml.safe_dump(topo, sort_keys=False))
    return path


def make_prompts(cfg: ChaosConfig, vocab: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(cfg.seed)
    out = []
    for i in range(cfg.num_prompts):
        kind = "long" if i % 2 else "short"
        lo, hi = cfg.long_len if kind == "long" else cfg.short_len
        out.append((kind, [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]))
    return out


def fault_schedule(cfg: ChaosConfig) -> list[str]:
    """The faults in the order fault_loop fires them."""
    out, at = [], cfg.first_fault_s
    while at < cfg.duration_s - 2:
        out.append(cfg.faults[len(out) % len(cfg.faults)])
        at += cfg.fault_every_s
    return out


def make_race_sets(cfg: ChaosConfig, llm, greedy) -> list:
    """One set per loan_race firing: (prefix + suffix a, prefix + suffix b, ref a, ref b) for
    2 x `race_prefixes` fresh prefixes (half borrowed beside the flood, half after it, when the
    holder is quiet again), and `race_flood` fresh long prompts (no reference: they only press
    the pool). Fresh each firing: a prefix cached by an earlier one lends nothing."""
    fires = fault_schedule(cfg).count("loan_race")
    if not fires:
        return []
    rng = random.Random(cfg.seed + 7)
    vocab = llm.engine.model_config.vocab_size
    lo, hi = cfg.long_len

    def fresh(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    sets = []
    for _ in range(fires):
        pairs = []
        for _ in range(2 * cfg.race_prefixes):
            prefix = fresh(rng.randint(lo, hi))
            pairs.append((prefix + fresh(16), prefix + fresh(16)))
        outs = llm.generate([p for pair in pairs for p in pair], greedy)
        toks = [o.token_ids for o in outs]
        sets.append(([(a, b, toks[2 * i], toks[2 * i + 1]) for i, (a, b) in enumerate(pairs)],
                     [fresh(rng.randint(lo, hi)) for _ in range(cfg.race_flood)]))
    return sets


class Cluster:
    """The launched topology plus the handles the faults need."""

    def __init__(self, cfg: ChaosConfig, work: Path, log):
        from pdserve.cluster.etcd_server import EmbeddedEtcd

        self.cfg, self.work, self.log = cfg, work, log
        host = cfg.hosts["head"]["addr"] if cfg.hosts else "127.0.0.1"  # where the workers reach it
        self.etcd = EmbeddedEtcd(work / "etcd-data", host=host).start()
        self.state = self.launcher = None
        self.killed_pid: int | None = None
        self.model_dir: str | None = None

    def up(self, model_dir: str) -> None:
        from pdserve.cluster.topology import load_topology
        from pdserve.launcher import Launcher

        self.model_dir = model_dir
        path = derive_topology(self.cfg, model_dir, self.etcd.endpoint, self.work)
        self.topo = load_topology(path)
        self.launcher = Launcher(self.topo, str(path), model_dir, progress=lambda line: self.log(f"  {line}"))
        self.state = self.launcher.up()  # leaves this driver connected to the cluster's Ray

    @property
    def target(self) -> str:
        """Where the load goes: the first gateway when the topology has one, else the first decode worker."""
        gateways = [a for a in self.state.actors if a["role"] == "gateway"]
        return gateways[0]["grpc"] if gateways else self.state.decode_endpoints[0]["grpc"]

    def lend_counters(self) -> dict:
        """The loans' counters summed over the workers: the lenders' (granted, ...) and the
        borrowers' (confirmed, stale, checksum_mismatch, ...), keyed side.counter."""
        import ray

        out: dict = {}
        handles = [(a, "stats") for a in self.decode_actors()] + [(self.actor("prefill"), "get_stats")]
        for stats in ray.get([getattr(a, m).remote() for a, m in handles], timeout=30):
            lending = stats.get("lending") or {}
            for k, v in (stats.get("borrows") or {}).items():  # a prefill worker's borrow outcomes
                out[f"prefill_borrows.{k}"] = out.get(f"prefill_borrows.{k}", 0) + v
            for side in ("lender", "borrower"):
                for k, v in (lending.get(side) or {}).items():
                    out[f"{side}.{k}"] = out.get(f"{side}.{k}", 0) + v
        return out

    def decode_actors(self) -> list:
        import ray

        return [ray.get_actor(a["name"], namespace=self.state.namespace) for a in self.state.decode_endpoints]

    def actor(self, role: str):
        import ray

        name = next(a["name"] for a in self.state.actors if a["role"] == role)
        return ray.get_actor(name, namespace=self.state.namespace)

    async def members(self) -> set[str]:
        from pdserve.cluster.registry import Registry

        async def read():
            async with Registry(self.state.etcd_endpoints, self.state.cluster) as reg:
                return set(await reg.members())
        try:
            return await asyncio.wait_for(read(), 3.0)
        except (Exception, asyncio.TimeoutError):  # noqa: BLE001  (etcd down: nobody is visible)
            return set()

    def prefill_pid(self) -> int | None:
        import ray

        try:
            return ray.get(self.actor("prefill").pid.remote(), timeout=3)
        except Exception:  # noqa: BLE001  (restarting)
            return None

    def queue_answers(self) -> bool:
        import ray

        try:
            handle = ray.get_actor(self.state.queue_name, namespace=self.state.namespace)
            ray.get(handle.stats.remote(), timeout=3)
            return True
        except Exception:  # noqa: BLE001  (restarting)
            return False

    def expected_members(self) -> set[str]:
        return {a["worker_id"] for a in self.state.actors if a["role"] in ("prefill", "decode")}  # in the registry

    def down(self) -> None:
        from pdserve.launcher import state_path

        try:
            if self.state is not None:
                self.launcher.down(self.state)
                state_path(self.topo).unlink(missing_ok=True)
        finally:
            self.etcd.stop()


# -- faults --------------------------------------------------------------------------------
def fire(cluster: Cluster, kind: str) -> str:
    import ray

    if kind == "kill_prefill":
        pid = ray.get(cluster.actor("prefill").pid.remote(), timeout=10)
        cluster.killed_pid = pid
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL prefill worker pid {pid}"
    if kind == "restart_etcd":
        cluster.etcd.kill()
        time.sleep(2.0)
        cluster.etcd.restart()
        return f"etcd killed, restarted on {cluster.etcd.endpoint} after 2 s"
    if kind == "kill_queue":
        handle = ray.get_actor(cluster.state.queue_name, namespace=cluster.state.namespace)
        ray.kill(handle, no_restart=False)
        return f"queue actor {cluster.state.queue_name} killed (restart allowed)"
    if kind == "stop_prefill":
        from pdserve.bench.chaos_faults import stop_prefill

        cluster.killed_pid = None
        return stop_prefill(ray.get(cluster.actor("prefill").pid.remote(), timeout=10), cluster.cfg.stop_s)
    if kind == "hang_compute":
        return ray.get(cluster.actor("prefill").hang_compute.remote(cluster.cfg.hang_s), timeout=10)
    if kind == "link_prefill":
        if not cluster.cfg.hosts:
            raise ValueError("link_prefill needs hosts: run with --hosts")
        from pdserve.bench.chaos_hosts import pull_link

        down = cluster.cfg.link_down_s or cluster.topo.etcd.lease_ttl_s + 4
        return pull_link(cluster.cfg.hosts, "prefill", down)
    raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")


async def fault_loop(cluster: Cluster, cfg: ChaosConfig, t0: float, faults: list[Fault], log, ctx) -> None:
    from pdserve.bench import chaos_faults

    loop = asyncio.get_running_loop()
    at = cfg.first_fault_s
    n = 0
    watchers = []
    while at < cfg.duration_s - 2:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        kind = cfg.faults[n % len(cfg.faults)]
        f = Fault(kind, time.monotonic() - t0)
        try:
            if kind in chaos_faults.ASYNC_FAULTS:
                f.detail = await getattr(chaos_faults, kind)(ctx)
            else:
                f.detail = await loop.run_in_executor(None, fire, cluster, kind)
        except Exception as exc:  # noqa: BLE001  (recorded: a fault that cannot fire is a finding too)
            f.detail = f"could not fire: {exc.__class__.__name__}: {exc}"
        log(f"  t={f.at_s:6.1f}s fault {kind}: {f.detail}")
        faults.append(f)
        watchers.append(asyncio.ensure_future(_watch_recovery(cluster, f, t0, cfg.fault_every_s, log)))
        n += 1
        at += cfg.fault_every_s
    await asyncio.gather(*watchers)  # each bounded by fault_every_s: the last fault's recovery is reported too


async def _watch_recovery(cluster: Cluster, f: Fault, t0: float, limit_s: float, log) -> None:
    """How long until every worker is registered again (a killed prefill worker: by a new
    process) and the queue answers (polled every 0.5 s, up to limit_s)."""
    loop = asyncio.get_running_loop()
    want = cluster.expected_members()
    await asyncio.sleep(1.0)  # a SIGKILLed worker's lease is still alive for a moment
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        seen = await cluster.members()
        queue_ok = await loop.run_in_executor(None, cluster.queue_answers)
        missing = sorted(want - seen) + ([] if queue_ok else ["queue"])
        if f.kind == "kill_prefill" and await loop.run_in_executor(None, cluster.prefill_pid) in (
                None, cluster.killed_pid):
            missing.append("a new prefill process")  # the old lease outlives the kill for its TTL
        f.waiting_for = ", ".join(missing)
        if not f.waiting_for:
            f.recovered_s = time.monotonic() - t0 - f.at_s
            log(f"  t={time.monotonic() - t0:6.1f}s all {len(want)} workers registered and the queue "
                f"answering ({f.recovered_s:.1f} s after {f.kind})")
            return
        await asyncio.sleep(0.5)


# -- load ------------------------------------------------------------------------------------
async def one_request(client, o: Outcome, prompt: list[int], ref: list[int], cfg: ChaosConfig) -> None:
    import grpc

    st = time.monotonic()
    toks: list[int] = []
    try:
        async for msg in client.stream(prompt, timeout_s=cfg.request_timeout_s, max_tokens=cfg.max_tokens,
                                       temperature=0.0, ignore_eos=True, route=o.route,
                                       priority="high" if o.route != "auto" else "normal"):
            if msg.token_ids and o.ttft_ms is None:
                o.ttft_ms = (time.monotonic() - st) * 1e3
            toks += list(msg.token_ids)
            if msg.finish_reason:
                o.result = "exact" if toks == ref else "mismatch"
                if o.result == "mismatch":
                    o.detail = f"got {toks}, expected {ref}"
        if o.result == "lost":
            o.detail = "stream ended without a final message"
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
        o.result = code if code in RETRIABLE else "lost"
        o.detail = f"{code}: {exc.details()}"
    except Exception as exc:  # noqa: BLE001  (recorded as lost)
        o.detail = f"client error {exc.__class__.__name__}: {exc}"


async def drive(cluster: Cluster, cfg: ChaosConfig, prompts, refs, log, stats,
                race_sets=()) -> tuple[list[Outcome], list[Fault]]:
    from pdserve.api import AsyncClient
    from pdserve.bench.chaos_faults import FaultContext

    rng = np.random.default_rng(cfg.seed)
    route_rng = random.Random(cfg.seed + 1)
    outcomes: list[Outcome] = []
    faults: list[Fault] = []
    tasks = []
    async with AsyncClient(cluster.target, timeout_s=cfg.request_timeout_s) as client:
        t0 = time.monotonic()
        ctx = FaultContext(client, prompts, refs, stats, random.Random(cfg.seed + 2), storm_size=cfg.storm_size,
                           reuse_pairs=cfg.reuse_pairs, max_tokens=cfg.max_tokens, poison_count=cfg.poison_count,
                           second_requests=cfg.second_requests, work=cluster.work, model_dir=cluster.model_dir,
                           race_sets=list(race_sets), lend_counters=cluster.lend_counters)
        fault_task = asyncio.ensure_future(fault_loop(cluster, cfg, t0, faults, log, ctx))
        next_at, i, last_note = 0.0, 0, 0.0
        while next_at < cfg.duration_s:
            await asyncio.sleep(max(0.0, t0 + next_at - time.monotonic()))
            kind, prompt = prompts[i % len(prompts)]
            route = "remote" if route_rng.random() < cfg.remote_share else "auto"
            o = Outcome(i, next_at, kind, route,
                        in_fault=any(0 <= next_at - f.at_s <= cfg.fault_window_s for f in faults))
            outcomes.append(o)
            tasks.append(asyncio.ensure_future(one_request(client, o, prompt, refs[i % len(prompts)], cfg)))
            i += 1
            next_at += float(rng.exponential(1.0 / cfg.request_rate))
            if next_at - last_note >= 30:
                last_note = next_at
                done = [x for x in outcomes if x.result != "lost" or x.detail]
                log(f"  t={next_at:6.1f}s sent {len(outcomes)}, finished {len(done)}, "
                    f"exact {sum(x.result == 'exact' for x in outcomes)}")
        await fault_task
        await asyncio.gather(*tasks)
    return outcomes, faults


def wait_for_free_kv(cluster: Cluster, timeout_s: float, log) -> int | None:
    """Blocks the decode workers still hold once idle (0 = nothing leaked); None if unreadable."""
    import ray

    deadline = time.monotonic() + timeout_s
    used = None
    while time.monotonic() < deadline:
        try:
            stats = ray.get([a.stats.remote() for a in cluster.decode_actors()], timeout=10)
            used = sum(st["num_blocks"] - st["num_free_blocks"] for st in stats)
            if used == 0 and all(st["inflight"] == 0 for st in stats):
                return 0
        except Exception as exc:  # noqa: BLE001
            log(f"  decode stats unavailable: {exc.__class__.__name__}")
        time.sleep(1.0)
    return used


# -- the run ---------------------------------------------------------------------------------
def summarize(cfg: ChaosConfig, outcomes: list[Outcome], faults: list[Fault], leaked, elapsed) -> Report:
    r = Report(config=asdict(cfg), sent=len(outcomes), leaked_blocks=leaked, elapsed_s=round(elapsed, 1))
    r.exact = sum(o.result == "exact" for o in outcomes)
    r.mismatch = sum(o.result == "mismatch" for o in outcomes)
    r.lost = sum(o.result == "lost" for o in outcomes)
    r.retriable = {c: sum(o.result == c for o in outcomes) for c in RETRIABLE}
    for label, group in (("outside_faults", [o for o in outcomes if not o.in_fault]),
                         ("during_faults", [o for o in outcomes if o.in_fault])):
        ttft = [o.ttft_ms for o in group if o.ttft_ms is not None]
        r.ttft_ms[label] = {"n": len(ttft), "p50": float(np.percentile(ttft, 50)) if ttft else None,
                            "p99": float(np.percentile(ttft, 99)) if ttft else None}
    r.faults = [asdict(f) for f in faults]
    r.lost_details = [f"#{o.i} t={o.sent_s:.1f}s {o.route} {o.kind}: {o.result} {o.detail}"
                      for o in outcomes if o.result in ("lost", "mismatch")][:20]
    return r


def format_report(r: Report) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.0f} ms"

    lines = [
        "==== pdserve chaos soak ====",
        f"duration {r.config['duration_s']:.0f} s at {r.config['request_rate']:g} req/s; faults every "
        f"{r.config['fault_every_s']:g} s: {', '.join(r.config['faults'])} ({len(r.faults)} fired)",
        f"sent                        {r.sent}",
        f"completed token-exact       {r.exact}",
        f"completed with wrong output {r.mismatch}   (must be 0)",
        "failed, typed and retriable " + (", ".join(f"{k} {v}" for k, v in r.retriable.items())),
        f"lost                        {r.lost}   (must be 0)",
        f"KV blocks leaked            {'-' if r.leaked_blocks is None else r.leaked_blocks}   (must be 0)",
    ]
    c = r.client_faults
    if c.get("aborted") or c.get("reused"):
        lines += [f"streams dropped on purpose  {c['aborted']}",
                  f"ids reused after a drop     {c['reused']}: crossed {c['crossed']}   (must be 0), "
                  f"ended in an error {c['reuse_failed']}"]
        probes = c.get("storm_probe_ttft_ms") or []
        if probes:
            lines.append("short-request TTFT around each abort storm (before -> right after): "
                         + ", ".join(f"{b:.0f} -> {a:.0f} ms" for b, a in probes))
    if c.get("poison_sent"):
        lines.append(f"poison requests (gateway)   {c['poison_sent']}: returned as their own error "
                     f"{c['poison_returned']}, anything else {c['poison_other']}   (must be 0); a short request "
                     f"right after each firing served {c['poison_probe_ok']} of {c['poison_probes']}")
    if c.get("race_sent"):
        lines.append(f"loans under eviction        {c['race_sent']} borrowing requests: token-exact {c['race_exact']}"
                     f" (must be all); loans granted {c['loans_granted']}, confirmed {c['loans_confirmed']}, stale "
                     f"{c['loans_stale']}, checksum mismatches {c['checksum_mismatch']} (must be 0); the prefill worker's "
                     f"borrows by outcome {c.get('borrow_outcomes') or {}} (not_cheaper: its cost model chose to compute)")
    if c.get("second_sent"):
        lines.append(f"second cluster on the host  {c['second_sent']} requests: token-exact {c['second_exact']}   "
                     f"(must be all)")
    if c.get("details"):
        lines += [f"  ! {d}" for d in c["details"][:10]]
    for label, t in r.ttft_ms.items():
        lines.append(f"TTFT {label.replace('_', ' '):<15} n={t['n']:<5} p50 {ms(t['p50']):>8}  p99 {ms(t['p99']):>8}")
    for f in r.faults:
        rec = f"never ({f['waiting_for']})" if f["recovered_s"] is None else f"{f['recovered_s']:.1f} s"
        lines.append(f"  t={f['at_s']:6.1f}s {f['kind']:<13} recovered after {rec:>7}   {f['detail']}")
    lines += [f"  ! {d}" for d in r.lost_details]
    return "\n".join(lines)


def run_chaos(cfg: ChaosConfig, log=lambda line: print(line, file=sys.stderr, flush=True)) -> Report:
    import ray

    from pdserve.engine import LLM, SamplingParams

    for f in cfg.faults:
        if f not in FAULTS:
            raise ValueError(f"--faults: unknown fault {f!r}; known: {', '.join(FAULTS)}")
    work = Path(cfg.work_dir or f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    from pdserve.bench.sweep import base_model_dir

    model_dir = base_model_dir(cfg.topology)
    log(f"chaos: model {model_dir}; computing the greedy reference of {cfg.num_prompts} prompts")
    llm = LLM(model_dir)
    prompts = make_prompts(cfg, llm.engine.model_config.vocab_size)
    greedy = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    refs = [o.token_ids for o in llm.generate([p for _, p in prompts], greedy)]
    race_sets = make_race_sets(cfg, llm, greedy)
    del llm
    cluster = Cluster(cfg, work, log)
    from pdserve.bench.chaos_faults import ClientFaultStats
    from pdserve.common.failpoints import ENV as FAILPOINTS_ENV

    wanted = sorted({FAILPOINTS[f] for f in cfg.faults if f in FAILPOINTS})
    if wanted:  # the Ray head `up` starts, and so every worker of this cluster, inherit it
        os.environ[FAILPOINTS_ENV] = ",".join(wanted)
        log(f"chaos: failpoints {', '.join(wanted)} on in this cluster's workers")

    stats = ClientFaultStats()
    t_start = time.monotonic()
    try:
        log("chaos: starting the cluster")
        cluster.up(model_dir)
        log(f"chaos: load for {cfg.duration_s:.0f} s at {cfg.request_rate:g} req/s, faults {list(cfg.faults)}")
        outcomes, faults = asyncio.run(drive(cluster, cfg, prompts, refs, log, stats, race_sets))
        log("chaos: load done; waiting for the decode worker's KV pool to drain")
        leaked = wait_for_free_kv(cluster, cfg.settle_timeout_s, log)
    finally:
        try:
            cluster.down()
        finally:
            ray.shutdown()
    report = summarize(cfg, outcomes, faults, leaked, time.monotonic() - t_start)
    report.client_faults = asdict(stats)
    if cfg.output:
        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output).write_text(json.dumps(asdict(report), indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/chaos.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ChaosConfig()
    p.add_argument("--topology", default=d.topology, help="base topology (1P1D; ports and etcd are replaced)")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load (default 600)")
    p.add_argument("--rate", type=float, default=d.request_rate, help="requests/s, Poisson (default 2)")
    p.add_argument("--faults", default=None,
                   help=f"comma list, fired round-robin ({', '.join(FAULTS)}; default: all but link_prefill, "
                        "all with --hosts)")
    p.add_argument("--fault-every", type=float, default=d.fault_every_s, help="seconds between faults (default 30)")
    p.add_argument("--fault-window", type=float, default=d.fault_window_s,
                   help="requests sent this long after a fault count as 'during faults' (default 15)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--work-dir", default=None, help="where etcd data and run files go (default runs/chaos-<time>)")
    p.add_argument("--output", default=None, help="write the report as JSON here")
    p.add_argument("--hosts", action="store_true",
                   help="run across three network-namespace hosts (root; adds the link_prefill fault)")
    p.add_argument("--link-down", type=float, default=d.link_down_s,
                   help="link_prefill: seconds the prefill host's link stays down (default: lease TTL + 4)")
    p.add_argument("--stop", type=float, default=d.stop_s,
                   help="stop_prefill: seconds the prefill worker stays SIGSTOPped (default 8)")
    p.add_argument("--hang", type=float, default=d.hang_s,
                   help="hang_compute: seconds the prefill worker's compute thread stays blocked (default 8)")
    p.add_argument("--host-plan", default=None, help=argparse.SUPPRESS)  # set by --hosts for its child
    a = p.parse_args(argv)
    if a.hosts:
        from pdserve.bench.chaos_hosts import run_on_hosts

        rest = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--hosts"]
        if a.faults is None:
            rest += ["--faults", ",".join(FAULTS)]
        return run_on_hosts(rest)
    faults = a.faults.split(",") if a.faults else list(ONE_HOST_FAULTS)
    cfg = ChaosConfig(topology=a.topology, duration_s=a.duration, request_rate=a.rate,
                      faults=tuple(f for f in faults if f), fault_every_s=a.fault_every,
                      fault_window_s=a.fault_window, max_tokens=a.max_tokens, seed=a.seed,
                      work_dir=a.work_dir, output=a.output, link_down_s=a.link_down, stop_s=a.stop, hang_s=a.hang,
                      hosts=json.loads(a.host_plan) if a.host_plan else None)
    report = run_chaos(cfg)
    print(format_report(report))
    c = report.client_faults
    ok = report.lost == 0 and report.mismatch == 0 and report.leaked_blocks == 0 and c.get("crossed", 0) == 0 \
        and c.get("poison_other", 0) == 0 and c.get("second_exact", 0) == c.get("second_sent", 0) \
        and c.get("race_exact", 0) == c.get("race_sent", 0) and c.get("checksum_mismatch", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
