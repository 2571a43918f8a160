"""The planner on a real 1P1D cluster (`pdserve up` with an autoscale policy): a burst of long
prompts adds a prefill worker that then serves; once the load stops it is drained and stopped
with no request lost, the decode worker's free blocks back to baseline, and a planner killed
with SIGKILL in the middle of that drain is restarted by Ray and finishes it without starting
another. Real etcd, real Ray, real workers, CPU."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import small_topology_yaml

REPO = Path(__file__).resolve().parents[2]

POLICY = """\
autoscale:
  prefill:
    min_replicas: 1
    max_replicas: 2
    scale_up: {queue_length: 3, gpu_utilization: 50}
    scale_down: {queue_length: 0, gpu_utilization: 15}
  decode:
    min_replicas: 1
    max_replicas: 1
    scale_up: {queue_length: 1000}
    scale_down: {queue_length: 0}
  interval_s: 1
  cooldown_s: 6
  down_stable_s: 2
  max_step: 1
  gpu_budget: 3          # CPUs on this CPU cluster: 2 prefill + 1 decode
"""

# Admit everything: these tests overload the cluster on purpose, and a refusal (429 /
# RESOURCE_EXHAUSTED, the router's QoS doing its job) would read as a lost request.
ADMIT_ALL = "qos:\n  enable_early_rejection: false\n"

PROMPTS = [f"Report {i}: " + "the planner watches the queue and the workers, and scales the pool. " * 60
           for i in range(4)]
MAX_TOKENS = 4


def pdserve(*args, timeout=300):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib"}
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def wait_for(what: str, cond, timeout_s: float, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


class Etcd:
    """Blocking reads of the cluster's etcd keys for the test's checks."""

    def __init__(self, endpoints, cluster):
        from pdserve.cluster.registry import Registry

        self.endpoints, self.cluster, self.Registry = endpoints, cluster, Registry

    def _run(self, fn):
        """One read. The box runs eight streams, a planner and workers starting on 2 cores, so a
        connect can miss its 15 s; a read that found etcd unreachable is retried for up to 60 s."""
        from aetcd.exceptions import ConnectionFailedError, ConnectionTimeoutError

        async def go():
            async with self.Registry(self.endpoints, self.cluster, request_timeout_s=15.0) as reg:
                return await fn(reg)

        deadline = time.monotonic() + 60
        while True:
            try:
                return asyncio.run(go())
            except (ConnectionFailedError, ConnectionTimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def members(self) -> dict:
        return self._run(lambda reg: reg.members())

    def planner(self) -> dict:
        from pdserve.cluster.planner.state import read_planner

        return self._run(read_planner)

    def decisions(self) -> list[dict]:
        from pdserve.cluster.planner.state import read_decisions

        return self._run(lambda reg: read_decisions(reg, 1000))


def assert_bounds(decisions: list[dict], policy_text: str) -> None:
    """The policy's bounds, from the decisions the planner recorded: never above max_replicas
    or the budget (units: CPUs here), at most max_step per decision, no two actions of a role
    within cooldown_s (a repair below min_replicas excepted)."""
    import yaml

    pol = yaml.safe_load(policy_text)["autoscale"]
    last: dict[str, float] = {}
    for d in decisions:
        assert d["desired"] <= pol[d["role"]]["max_replicas"], d
        assert abs(d["desired"] - d["current"]) <= pol["max_step"], d
        if d["action"] != "hold" and d["reason"] != "below_min":
            if d["role"] in last:
                assert d["at"] - last[d["role"]] >= pol["cooldown_s"], (d, last)
            last[d["role"]] = d["at"]
    by_time: dict[float, dict[str, int]] = {}
    for d in decisions:
        by_time.setdefault(d["at"], {})[d["role"]] = d["desired"]
    for at, roles in by_time.items():
        assert sum(roles.values()) <= pol["gpu_budget"] or len(roles) < 2, (at, roles)


async def load(target: str, stop: asyncio.Event, results: list, failures: list, concurrency: int = 6) -> None:
    from pdserve.api import AsyncClient

    async with AsyncClient(target, timeout_s=120) as client:
        async def one(i: int) -> None:
            n = 0
            while not stop.is_set():
                prompt = PROMPTS[(i + n) % len(PROMPTS)]
                n += 1
                try:
                    out = await client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                route="remote")
                    results.append((prompt, list(out.token_ids), out.finish_reason))
                except Exception as exc:  # noqa: BLE001  (counted: the test asserts there are none)
                    failures.append(repr(exc))

        await asyncio.gather(*(one(i) for i in range(concurrency)))


async def reference(target: str) -> dict:
    from pdserve.api import AsyncClient

    async with AsyncClient(target, timeout_s=120) as client:
        return {p: list((await client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                               route="local")).token_ids) for p in PROMPTS}


@pytest.mark.timeout(420)
def test_planner_scales_prefill_up_under_load_and_drains_it_after(tmp_path):
    import ray

    (tmp_path / "autoscale.yaml").write_text(POLICY)
    (tmp_path / "router.yaml").write_text(ADMIT_ALL)
    topo = tmp_path / "topology.yaml"
    topo.write_text(small_topology_yaml("planner-e2e", tmp_path, tmp_path / "router.yaml")
                    + f"autoscale_policy: {tmp_path / 'autoscale.yaml'}\n")
    up = pdserve("up", "--topology", str(topo))
    state_file = tmp_path / "runs" / "planner-e2e.state.json"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "planner   planner-" in up.stdout, up.stdout
        state = json.loads(state_file.read_text())
        etcd = Etcd(state["etcd_endpoints"], "planner-e2e")
        target = state["actors"][-1]["grpc"]
        ray.init(address=state["ray_address"], namespace=state["namespace"], log_to_driver=False)
        decode = ray.get_actor("planner-e2e-decode-0", namespace=state["namespace"])
        baseline_free = ray.get(decode.stats.remote())["num_free_blocks"]
        expected = asyncio.run(reference(target))

        # A closed loop of long prompts, all prefilled remotely, until the new worker has served.
        results, failures = [], []

        async def burst():
            stop = asyncio.Event()
            task = asyncio.ensure_future(load(target, stop, results, failures))
            try:
                deadline = time.monotonic() + 150
                while time.monotonic() < deadline:
                    rec = (await asyncio.to_thread(etcd.members)).get("prefill-1")
                    if rec is not None and rec.load.get("tasks", 0) >= 3:
                        return rec
                    await asyncio.sleep(1.0)
                raise AssertionError("prefill-1 never started or never served; decisions: "
                                     + json.dumps(etcd.decisions())[-2000:])
            finally:
                stop.set()
                await task

        served = asyncio.run(burst())
        assert served.role == "prefill"
        ups = [d for d in etcd.decisions() if d["role"] == "prefill" and d["action"] == "up"]
        assert len(ups) == 1 and ups[0]["reason"] == "threshold_up", ups

        # Idle now: after the cooldown the planner drains the newest prefill worker. Kill the
        # planner the moment it has recorded that drain.
        st = wait_for("the planner to start draining prefill-1",
                      lambda: etcd.planner()["state"].pending.get("prefill-1", {}).get("state") == "draining", 90)
        assert st
        planner = ray.get_actor("planner-e2e-planner", namespace=state["namespace"])
        first_id = etcd.planner()["leader"]["planner"]
        os.kill(ray.get(planner.pid.remote()), signal.SIGKILL)

        def finished():
            p = etcd.planner()
            if p["leader"] is None or p["leader"]["planner"] == first_id or p["state"].pending:
                return None
            try:
                ray.get_actor("planner-e2e-prefill-1", namespace=state["namespace"])
                return None
            except ValueError:
                return p

        after = wait_for("a restarted planner to finish the drain and stop prefill-1", finished, 90)
        assert "prefill-1" in after["state"].stopped
        events = ray.get(planner.events.remote(), timeout=30)
        assert any("resumed: prefill-1 draining" in e for e in events), events
        assert any("prefill-1 drained" in e for e in events), events
        downs = [d for d in etcd.decisions() if d["role"] == "prefill" and d["action"] == "down"]
        assert len(downs) == 1, downs  # the restarted planner did not start a second drain
        assert_bounds(etcd.decisions(), POLICY)
        assert set(etcd.members()) == {"prefill-0", "decode-0"}

        # Nothing lost: every request finished, token for token what the local path gives.
        assert not failures, failures[:5]
        assert len(results) >= 10
        assert all(tokens == expected[p] and reason == "length" for p, tokens, reason in results)
        wait_for("the decode worker's free blocks back to baseline",
                 lambda: ray.get(decode.stats.remote())["num_free_blocks"] == baseline_free, 30)

        status = pdserve("status", "--topology", str(topo))
        assert status.returncode == 0, status.stdout + status.stderr  # prefill-1 drained on purpose: not MISSING
        assert "planner: planner-" in status.stdout and "prefill  desired 1" in status.stdout, status.stdout
    finally:
        if ray.is_initialized():
            ray.shutdown()
        down = pdserve("down", "--topology", str(topo))
    assert down.returncode == 0, down.stdout + down.stderr


FLIP_POLICY = """\
autoscale:
  prefill:
    min_replicas: 0
    max_replicas: 2
    scale_up: {queue_length: 4, gpu_utilization: 70}
    scale_down: {queue_length: 0, gpu_utilization: 10}
  decode:
    min_replicas: 1
    max_replicas: 2
    scale_up: {gpu_utilization: 60}
    scale_down: {gpu_utilization: 5}
  interval_s: 1
  cooldown_s: 5
  down_stable_s: 6       # prefill must stay idle this long before it is given away
  max_step: 1
  gpu_budget: 2          # two workers' CPUs: the only way to grow decode is to take prefill's
  allow_role_flip: true
"""

FLIP_ROUTER = "router:\n  mode: conditional\n  policy: cost_model\n  cost_model:\n    itl_penalty_weight: 0.1\n"

CHAT = [f"Question {i}: name a colour and say why it matters." for i in range(6)]
CHAT_TOKENS = 48


async def mixed_load(target_of, prompts, max_tokens, route, stop, results, failures, concurrency):
    from pdserve.api import AsyncClient

    async def one(i: int) -> None:
        n = 0
        while not stop.is_set():
            prompt = prompts[(i + n) % len(prompts)]
            n += 1
            try:
                async with AsyncClient(target_of(), timeout_s=120) as client:
                    out = await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                route=route)
                results.append((prompt, list(out.token_ids), out.finish_reason))
            except Exception as exc:  # noqa: BLE001  (counted: the test asserts there are none)
                failures.append(repr(exc))

    await asyncio.gather(*(one(i) for i in range(concurrency)))


@pytest.mark.timeout(420)
def test_a_prefill_worker_becomes_a_decode_worker_when_the_mix_turns_decode_heavy(tmp_path):
    import ray

    from pdserve.api import AsyncClient

    (tmp_path / "autoscale.yaml").write_text(FLIP_POLICY)
    # The chat phase must leave the prefill worker idle: its short prompts stay local. (Under the
    # shipped ITL weight, 1.0, a 15-token prompt goes remote while 8 streams decode, which keeps
    # the prefill worker busy enough that the planner, rightly by its rule, never gives it away.)
    (tmp_path / "router.yaml").write_text(ADMIT_ALL + FLIP_ROUTER)
    topo = tmp_path / "topology.yaml"
    topo.write_text(small_topology_yaml("flip-e2e", tmp_path, tmp_path / "router.yaml")
                    + f"autoscale_policy: {tmp_path / 'autoscale.yaml'}\n")
    up = pdserve("up", "--topology", str(topo))
    state_file = tmp_path / "runs" / "flip-e2e.state.json"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads(state_file.read_text())
        etcd = Etcd(state["etcd_endpoints"], "flip-e2e")
        decode0 = next(a for a in state["actors"] if a["worker_id"] == "decode-0")["grpc"]
        prefill_pid = next(a for a in state["actors"] if a["worker_id"] == "prefill-0")["pid"]

        async def references():
            async with AsyncClient(decode0, timeout_s=120) as c:
                out = {}
                for p in PROMPTS:
                    out[p] = list((await c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                    route="local")).token_ids)
                for p in CHAT:
                    out[p] = list((await c.generate(p, max_tokens=CHAT_TOKENS, temperature=0.0, ignore_eos=True,
                                                    route="local")).token_ids)
                return out

        results, failures = [], []

        def decode_targets():
            return [m.endpoints["grpc"] for w, m in sorted(etcd.members().items()) if m.role == "decode"]

        async def phases():
            # Long-prompt heavy: every prompt prefilled remotely, for a while.
            stop = asyncio.Event()
            task = asyncio.ensure_future(mixed_load(lambda: decode0, PROMPTS, MAX_TOKENS, "remote", stop,
                                                    results, failures, 4))
            await asyncio.sleep(10)
            stop.set()
            await task
            early = await asyncio.to_thread(etcd.decisions)
            assert not [d for d in early if d["reason"] == "role_flip"], "flipped while prefill was busy"
            # Decode heavy: short prompts, long outputs, spread over the decode workers there are.
            targets = {"list": [decode0]}
            stop = asyncio.Event()
            counter = {"n": 0}

            def pick():
                counter["n"] += 1
                return targets["list"][counter["n"] % len(targets["list"])]

            task = asyncio.ensure_future(mixed_load(pick, CHAT, CHAT_TOKENS, "auto", stop, results, failures, 8))
            try:
                deadline = time.monotonic() + 150
                while time.monotonic() < deadline:
                    found = await asyncio.to_thread(decode_targets)
                    targets["list"] = found or [decode0]
                    if len(found) == 2:
                        await asyncio.sleep(3)  # both serve the mix for a moment
                        return found
                    await asyncio.sleep(1.0)
                got = await asyncio.to_thread(etcd.decisions)
                raise AssertionError("no second decode worker; decisions: " + json.dumps(got)[-3000:])
            finally:
                stop.set()
                await task

        targets = asyncio.run(phases())
        # The local path on decode-0 after the fact: greedy outputs do not depend on when.
        expected = asyncio.run(references())
        flips = [d for d in etcd.decisions() if d["reason"] == "role_flip"]
        assert {(d["role"], d["action"]) for d in flips} == {("prefill", "down"), ("decode", "up")}, flips
        assert_bounds(etcd.decisions(), FLIP_POLICY)
        assert set(etcd.members()) == {"decode-0", "decode-1"}
        ray.init(address=state["ray_address"], namespace=state["namespace"], log_to_driver=False)
        moved = ray.get(ray.get_actor("flip-e2e-prefill-0", namespace=state["namespace"]).describe.remote())
        # The same process, its engine kept: no second load of the weights.
        assert moved == {"role": "decode", "worker_id": "decode-1", "flips": 1, "pid": prefill_pid}, moved
        # The new decode worker serves, and every request of both phases completed token-exact.
        new = next(t for t in targets if t != decode0)

        async def ask_new():
            async with AsyncClient(new, timeout_s=120) as c:
                return list((await c.generate(CHAT[0], max_tokens=CHAT_TOKENS, temperature=0.0,
                                              ignore_eos=True)).token_ids)

        assert asyncio.run(ask_new()) == expected[CHAT[0]]
        assert not failures, failures[:5]
        assert sum(1 for p, _, _ in results if p in CHAT) >= 10 and sum(1 for p, _, _ in results if p in PROMPTS) >= 4
        bad = [(p[:30], t, r) for p, t, r in results if t != expected[p] or r != "length"]
        assert not bad, bad[:3]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        down = pdserve("down", "--topology", str(topo))
    assert down.returncode == 0, down.stdout + down.stderr
