"""The chaos soak across hosts: the 1P1D cluster on three network-namespace hosts.

`run_on_hosts(argv)` (the `--hosts` flag of bench/chaos.py, root only) makes the hosts
(bench/netns.py): "head" (Ray head, etcd, the queue, the load generator), "prefill" and
"decode"; starts a Ray node in each (`ray start`, each with its own temp dir: the
multi-host tests run the same through `ray up deploy/ray/local.yaml`), then runs
bench/chaos.py itself inside the head host with the plan, so that every address the
soak uses is a host's, never loopback. The child places the roles on their hosts
(`place`), and gains the fault `link_prefill`: the prefill host's link is pulled for
`--link-down` seconds (longer than the lease TTL, so the worker leaves etcd), then
restored. Everything made is removed afterwards, also on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HOSTS = ("head", "prefill", "decode")
RAY_PORT = 6379


def place(topo: dict, plan: dict) -> dict:
    """The topology with each role on its host, every server on the host's address and UCX on TCP."""
    topo = json.loads(json.dumps(topo))
    for role in ("prefill", "decode"):
        spec = topo.setdefault("roles", {}).setdefault(role, {})
        res = spec.setdefault("resources", {})
        res["custom"] = {**res.get("custom", {}), f"node:{plan[role]['addr']}": 0.01}
    topo["ray"] = {**(topo.get("ray") or {}), "address": plan["ray"]}
    # The hosts share one kernel: TCP keeps UCX off shared memory, so pages cross the link.
    topo["network"] = {"bind": "node", "ucx": {"UCX_TLS": "tcp"}}
    topo["queue"] = {**(topo.get("queue") or {}), "wire": "node"}
    return topo


def pull_link(plan: dict, host: str, down_s: float) -> str:
    """Take ``host``'s link down for ``down_s`` seconds, then up again."""
    ns = plan[host]["netns"]
    subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True, timeout=30)
    try:
        time.sleep(down_s)
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True, timeout=30)
    return f"{host} host link ({plan[host]['addr']}) down for {down_s:.0f} s, then up"


def _ray_start(host, *args: str) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    res = subprocess.run(host.cmd(sys.executable, "-m", "ray.scripts.scripts", "start", *args,
                                  f"--node-ip-address={host.addr}", f"--temp-dir=/tmp/ray-{host.addr}",
                                  "--num-cpus=2", "--disable-usage-stats"),
                         capture_output=True, text=True, timeout=180, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"ray start in {host.name} failed: {res.stderr[-2000:]}")


def run_on_hosts(argv: list[str], log=lambda line: print(line, file=sys.stderr, flush=True),
                 script: str | None = None) -> int:
    """Make the hosts and their Ray nodes, then run ``script`` (default bench/chaos.py) with
    ``argv`` + ``--host-plan`` inside the head host; its exit code."""
    from pdserve.bench.netns import Network, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"bench/chaos.py --hosts {why}")
    if "--work-dir" not in argv:
        argv = [*argv, "--work-dir", f"runs/chaos-hosts-{time.strftime('%Y%m%d-%H%M%S')}"]
    work = Path(argv[argv.index("--work-dir") + 1]).resolve()
    with Network(list(HOSTS)) as net:
        try:
            head = net["head"]
            _ray_start(head, "--head", f"--port={RAY_PORT}", "--include-dashboard=false")
            for name in ("prefill", "decode"):
                _ray_start(net[name], f"--address={head.addr}:{RAY_PORT}")
            plan = {"ray": f"{head.addr}:{RAY_PORT}",
                    **{n: {"netns": net[n].netns, "addr": net[n].addr} for n in HOSTS}}
            log(f"chaos: hosts {', '.join(f'{n} {net[n].addr}' for n in HOSTS)}; Ray head at {plan['ray']}")
            script = script or str(Path(__file__).with_name("chaos.py"))
            child = [sys.executable, script, *argv, "--host-plan", json.dumps(plan)]
            return subprocess.run(head.cmd(*child)).returncode
        finally:
            for h in net.hosts.values():
                h.kill_all()
                logs = Path(f"/tmp/ray-{h.addr}/session_latest/logs")
                if logs.is_dir():  # each host's Ray logs stay with the report
                    shutil.copytree(logs, work / "ray-logs" / h.name, dirs_exist_ok=True)
                shutil.rmtree(f"/tmp/ray-{h.addr}", ignore_errors=True)
