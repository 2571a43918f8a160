"""The etcd gate `pdserve up` starts runs under a supervisor (`python -m pdserve.cluster.etcd_gate
--supervise`): killed with SIGKILL it is back on the same port within a bound, the workers'
leases survive (they reconnect to the same endpoint and the restarted gate knows their leases
by their keys), and `down` leaves neither the supervisor nor a gate behind. Real etcd with TLS
and RBAC, the launcher's own etcd step, real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from aetcd import rpc

from pdserve.cluster.registry import Registry
from pdserve.processes import port_open
from tests.cluster.test_etcd_security import FAST, launcher_topology, worker

pytestmark = pytest.mark.timeout(180)

RESTART_BOUND_S = 30.0  # backoff (0.5 s) + a fresh Python importing grpc/aetcd on a loaded 2-core host
LEASE_TTL_S = 15.0  # > RESTART_BOUND_S / 2: a keep-alive every 5 s, so the lease outlives a restart
GONE_BOUND_S = 15.0


def await_condition(what: str, check, timeout_s: float, every_s: float = 0.05):
    """check() until it returns something truthy (returned); AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)


def gate_child(supervisor: int, port: int) -> int | None:
    """The pid of the supervisor's gate child listening on `port`, if there is one now."""
    try:
        for child in psutil.Process(supervisor).children():
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                       for c in child.net_connections(kind="tcp")):
                    return child.pid
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
    except psutil.NoSuchProcess:
        return None
    return None


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reap(pid: int) -> None:
    """Collect `pid` if it is our (exited) child, so it is not left as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def test_a_killed_gate_is_restarted_on_its_port_workers_keep_their_leases_and_down_stops_it_all(
        secure_etcd, tmp_path):
    from pdserve.launcher import Launcher

    topo, state = launcher_topology(secure_etcd, tmp_path, "supervised", ["prefill-0", "decode-0"], "gate: {}")
    launcher = Launcher(topo, str(tmp_path / "t.yaml"), "m", progress=lambda line: None)
    seen: set[int] = set()
    try:
        launcher._start_etcd(state, tmp_path / "runs")
        supervisor, port = state.gate_pid, int(state.gate_endpoints[0].rpartition(":")[2])
        first = await_condition("the gate listening", lambda: gate_child(supervisor, port), RESTART_BOUND_S)
        seen.add(first)

        async def scenario() -> None:
            tls = topo.worker_etcd_tls("prefill-0")
            async with Registry(state.worker_etcd_endpoints, "supervised", ttl_s=LEASE_TTL_S, tls=tls, **FAST) as p0, \
                    Registry(state.etcd_endpoints, "supervised", tls=topo.etcd_tls("operator"), **FAST) as op:
                await p0.register(worker("prefill-0"))
                lease = p0.lease_id
                channel = grpc.aio.secure_channel(state.etcd_endpoints[0], topo.etcd_tls("operator").credentials())
                leases = rpc.LeaseStub(channel)

                async def remaining() -> int:
                    return (await leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease))).TTL

                try:
                    os.kill(first, signal.SIGKILL)
                    killed_at = time.monotonic()
                    second = await asyncio.to_thread(
                        await_condition, "the gate back on its port",
                        lambda: (pid := gate_child(supervisor, port)) not in (None, first) and pid, RESTART_BOUND_S)
                    seen.add(second)
                    assert time.monotonic() - killed_at < RESTART_BOUND_S
                    # The lease is renewed after the kill: its remaining TTL climbs above the lowest
                    # seen since, which only a keep-alive through the restarted gate can do (the
                    # first one is dead). Bounded by a keep-alive interval and the client's backoff.
                    low = await remaining()
                    deadline = time.monotonic() + LEASE_TTL_S
                    while (now := await remaining()) <= low:
                        assert now > 0, "the worker's lease expired across the gate's restart"
                        assert time.monotonic() < deadline, "no keep-alive went through the restarted gate"
                        low = min(low, now)
                        await asyncio.sleep(0.2)
                finally:
                    await channel.close()
                assert p0.lease_id == lease and p0.reregistrations == 0  # the same lease: it survived
                assert (await op.member("prefill", "prefill-0")) is not None

        asyncio.run(scenario())
        log = (tmp_path / "runs" / "supervised-etcd-gate.log").read_text()
        assert f"etcd gate (pid {first}) died (killed by signal 9)" in log and "restart 1" in log, log[-2000:]
    finally:
        launcher.down(state)
    # `down` stopped the supervisor's process group: no supervisor, no gate of any generation.
    reap(state.gate_pid)
    for pid in [state.gate_pid, *seen]:
        await_condition(f"process {pid} gone", lambda: gone(pid), GONE_BOUND_S)
    assert not port_open(int(state.gate_endpoints[0].rpartition(":")[2]))


def test_a_gate_does_not_outlive_its_supervisor(secure_etcd, tmp_path):
    """The supervisor killed with SIGKILL (nothing left to restart the gate, nor to be stopped
    by `down` as a group leader): its gate child exits too instead of holding the port."""
    from pdserve.cluster.etcd_server import free_loopback_port

    topo, _ = launcher_topology(secure_etcd, tmp_path, "orphan", ["prefill-0"])
    port = free_loopback_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cluster.etcd_gate", "--supervise",
                             "--topology", str(tmp_path / "t.yaml"), "--upstream", secure_etcd.endpoint,
                             "--port", str(port), "--workers", "prefill:prefill-0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    child = None
    try:
        child = await_condition("the gate listening", lambda: gate_child(proc.pid, port), RESTART_BOUND_S)
        proc.kill()
        proc.wait(timeout=GONE_BOUND_S)
        await_condition("the orphaned gate gone", lambda: gone(child), GONE_BOUND_S)
        await_condition("the port free", lambda: not port_open(port), GONE_BOUND_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group (nothing, if it passed)
        except ProcessLookupError:
            pass
        proc.wait(timeout=GONE_BOUND_S)


def test_supervise_needs_a_fixed_port(secure_etcd, tmp_path, capsys):
    from pdserve.cluster.etcd_gate import main

    launcher_topology(secure_etcd, tmp_path, "noport", ["prefill-0"])
    with pytest.raises(SystemExit):
        main(["--supervise", "--topology", str(tmp_path / "t.yaml"), "--upstream", secure_etcd.endpoint])
    assert "--supervise needs --port" in capsys.readouterr().err
