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
  max_step: 1
  gpu_budget: 3          # CPUs on this CPU cluster: 2 prefill + 1 decode
"""

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
        async def go():
            async with self.Registry(self.endpoints, self.cluster) as reg:
                return await fn(reg)

        return asyncio.run(go())

    def members(self) -> dict:
        return self._run(lambda reg: reg.members())

    def planner(self) -> dict:
        from pdserve.cluster.planner.core import read_planner

        return self._run(read_planner)

    def decisions(self) -> list[dict]:
        from pdserve.cluster.planner.core import read_decisions

        return self._run(lambda reg: read_decisions(reg, 1000))


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
    topo = tmp_path / "topology.yaml"
    topo.write_text(small_topology_yaml("planner-e2e", tmp_path) + f"autoscale_policy: {tmp_path / 'autoscale.yaml'}\n")
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
