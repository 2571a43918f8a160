"""The gateway and its decode workers as separate processes on a real etcd: kill -9 the
worker holding a third of 48 streams, drain another (SIGTERM with a short deadline), and
kill one gateway replica: every stream completes with the tokens of an undisturbed run, and
the surviving workers hold no KV blocks afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from pdserve.api import AsyncClient, Client
from pdserve.cluster.etcd_server import EmbeddedEtcd
from tests.harness import PERMISSIVE_POLICY

CLUSTER = "gw-procs"
STREAMS = 48
# Each disturbance (kill, drain) fires once every stream has its first token. First tokens are
# spread over seconds on 2 cores (the step plan admits prompts between decode steps), so a stream
# that started early may finish on the victim before the kill: the test allows that for streams
# that ended before the kill, and requires every other one the victim held to migrate.
TOKENS = 96


def spawn(args: list[str], log_path) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "pdserve", *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_line(log_path, pattern: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(pattern, open(log_path).read())
        if m:
            return m
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} within {timeout_s} s:\n{open(log_path).read()[-3000:]}")


def metric(http: str, name: str) -> float:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def explain(http: str) -> dict:
    req = urllib.request.Request(f"{http}/gateway/explain", data=json.dumps({"prompt": "x"}).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())


@pytest.fixture(scope="module")
def procs(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwp")
    policy = tmp / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    running: list[subprocess.Popen] = []
    with EmbeddedEtcd(tmp / "etcd") as etcd:
        try:
            workers = {}
            for i in range(3):
                log = tmp / f"decode-{i}.log"
                p = spawn(["serve-decode", "--model", llama_dir, "--etcd", etcd.endpoint, "--cluster", CLUSTER,
                           "--worker-id", f"decode-{i}", "--lease-ttl", "3", "--no-calibrate",
                           "--grpc-port", "0", "--http-port", "0",
                           "--router-policy", str(policy), "--drain-timeout", "0.3"], log)
                running.append(p)
                workers[f"decode-{i}"] = (p, log)
            for wid, (p, log) in workers.items():
                m = wait_line(log, r"gRPC (\S+)  HTTP (https?://\S+)", p)
                workers[wid] = (p, log, m.group(1), m.group(2))
            starting = []
            for g in range(2):  # both replicas start at once, as the decode workers do
                log = tmp / f"gateway-{g}.log"
                p = spawn(["gateway", "--etcd", etcd.endpoint, "--cluster", CLUSTER, "--model", llama_dir], log)
                running.append(p)
                starting.append((p, log))
            gateways = []
            for p, log in starting:
                m = wait_line(log, r"gRPC (\S+), HTTP (\S+), 3 decode worker", p)
                gateways.append((p, m.group(1), m.group(2)))
            yield workers, gateways
        finally:
            for p in running:
                if p.poll() is None:
                    p.kill()
            for p in running:
                p.wait(30)


def cases():
    out = []
    for i in range(STREAMS):
        rng = random.Random(i)
        ids = [rng.randrange(3, 32000) for _ in range(rng.randrange(20, 120))]
        sampling = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_p=0.9, seed=1000 + i)
        out.append((ids, sampling))
    return out


async def run_all(target: str, during=None):
    """Every case streamed through `target`; ``during(started)`` runs once each has a token."""
    started = asyncio.Event()
    firsts = 0

    async with AsyncClient(target, timeout_s=300) as c:
        async def one(ids, sampling):
            nonlocal firsts
            toks, finish, b = [], None, None
            async for msg in c.stream(ids, max_tokens=TOKENS, ignore_eos=True, **sampling):
                if msg.token_ids and not toks:
                    firsts += 1
                    if firsts == STREAMS:
                        started.set()
                toks += msg.token_ids
                finish = msg.finish_reason or finish
                if msg.HasField("breakdown"):
                    b = msg.breakdown
            return toks, finish, b, time.monotonic()

        tasks = [asyncio.ensure_future(one(ids, s)) for ids, s in cases()]
        extra = None
        if during is not None:
            await asyncio.wait_for(started.wait(), 120)
            extra = await asyncio.get_running_loop().run_in_executor(None, during)
        return await asyncio.wait_for(asyncio.gather(*tasks), 300), extra


def victim_of(gateway_http: str) -> tuple[str, int]:
    scores = explain(gateway_http)["scores"]
    top = max(scores, key=lambda s: s["streams"])
    return top["worker_id"], top["streams"]


def assert_the_victims_streams_migrated(want, got, dead: str, held: int, counted: float, killed: float) -> list:
    """Every stream token-exact and complete; every one the killed worker still held at the
    kill migrated. ``held``: its streams as the gateway counted them at ``counted``; the kill at
    ``killed``. Returns the migrated streams' breakdowns."""
    assert held >= STREAMS // 4, f"{dead} held only {held} of {STREAMS} streams"
    ended_on_victim = 0
    for (w, _, _, _), (g, finish, b, ended) in zip(want, got):
        assert finish == "length" and g == w and b.completion_tokens == TOKENS  # greedy and seeded alike
        if b.worker_id == dead:  # only a stream that was over before the kill may end there
            assert ended < killed and b.migrations == 0, (ended - killed, b)
            # counted by the gateway's explain (it may lag the client by a moment) though over
            ended_on_victim += ended > counted - 1.0
    migrated = [b for _, _, b, _ in got if b.migrations]
    moved = sum(b.migrations for b in migrated)
    assert held - ended_on_victim <= moved <= held, (moved, held, ended_on_victim)
    assert moved >= STREAMS // 8, f"only {moved} streams migrated"
    return migrated


def assert_no_blocks_held(workers, alive: list[str]):
    for wid in alive:
        http = workers[wid][3]
        deadline = time.monotonic() + 20
        while metric(http, "pdserve_kv_cache_usage_ratio") > 0 or metric(http, "pdserve_num_requests_running") > 0:
            assert time.monotonic() < deadline, f"{wid} still holds KV blocks or running requests"
            time.sleep(0.1)


def test_kill_drain_and_a_lost_gateway_lose_no_stream(procs):
    workers, gateways = procs
    (_, gw_grpc, gw_http), (_, gw2_grpc, gw2_http) = gateways
    want, _ = asyncio.run(run_all(gw_grpc))
    assert all(f == "length" and len(t) == TOKENS for t, f, _, _ in want)

    # 1. kill -9 the worker holding the most streams
    def kill():
        counted = time.monotonic()
        wid, n = victim_of(gw_http)
        os.kill(workers[wid][0].pid, signal.SIGKILL)
        return wid, n, counted, time.monotonic()

    got, (dead, held, counted, killed) = asyncio.run(run_all(gw_grpc, kill))
    assert_the_victims_streams_migrated(want, got, dead, held, counted, killed)
    alive = [w for w in workers if w != dead]
    assert_no_blocks_held(workers, alive)

    # 2. drain (SIGTERM, 0.3 s deadline) the survivor holding the most streams
    def drain():
        wid, n = victim_of(gw_http)
        workers[wid][0].send_signal(signal.SIGTERM)
        return wid, n

    got, (drained, held) = asyncio.run(run_all(gw_grpc, drain))
    for (w, _, _, _), (g, finish, _, _) in zip(want, got):
        assert finish == "length" and g == w
    moved = sum(b.migrations for _, _, b, _ in got)
    assert 1 <= moved <= held, (moved, held)
    workers[drained][0].wait(60)
    last = [w for w in alive if w != drained]
    assert_no_blocks_held(workers, last)

    # 3. a gateway replica dies: the other one serves (stateless)
    gateways[0][0].kill()
    with Client(gw2_grpc) as c:
        ids, sampling = cases()[1]
        out = c.generate(ids, max_tokens=TOKENS, ignore_eos=True, **sampling)
    assert out.token_ids == want[1][0] and out.breakdown["worker_id"] == last[0]
    assert metric(f"http://{gw2_http.removeprefix('http://')}", "pdserve_gateway_routed_total") >= 1
