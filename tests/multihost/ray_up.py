"""`ray up deploy/ray/local.yaml` against namespace hosts: the real cluster-launcher path.

Each host runs its own sshd (throw-away keys); the config is the shipped
local.yaml with the test's addresses and key, and the commands run with this
checkout's virtualenv on PATH. Ray's local provider SSHes to the head and
starts it; the head's autoscaler SSHes to every worker host and starts Ray
there. Teardown kills what runs in the hosts (Network.close) and removes what
`ray up` wrote outside them (bootstrap files in $HOME, per-host Ray temp dirs,
the provider's state file).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from pdserve.bench.netns import Network, SshKeys

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY_UP_TIMEOUT_S = 300
JOIN_TIMEOUT_S = 120


@dataclass
class RayCluster:
    net: Network
    head: str  # host names
    workers: list[str]
    config_path: str
    address: str  # "ip:port" of the head's GCS
    workdir: str

    def python(self, host: str, code: str, timeout: float = 120) -> str:
        """Run ``code`` with this checkout's Python inside ``host``; its stdout."""
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        res = subprocess.run(self.net[host].cmd(sys.executable, "-c", code), capture_output=True, text=True,
                             timeout=timeout, env=env)
        if res.returncode != 0:
            raise RuntimeError(f"python in {host} failed ({res.returncode}): {res.stderr[-3000:]}")
        return res.stdout

    def nodes(self) -> list[dict]:
        out = self.python(self.head, f"import json, ray; ray.init(address='{self.address}', logging_level='ERROR'); "
                          "print('NODES=' + json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']} "
                          "for n in ray.nodes() if n['Alive']]))")
        line = next((x for x in out.splitlines() if x.startswith("NODES=")), None)
        if line is None:
            raise RuntimeError(f"no node list from the head: {out[-2000:]}")
        return json.loads(line.removeprefix("NODES="))


def local_config(net: Network, head: str, workers: list[str], key: str, name: str) -> dict:
    """deploy/ray/local.yaml for these hosts, run with this checkout's virtualenv."""
    config = yaml.safe_load((ROOT / "deploy" / "ray" / "local.yaml").read_text())
    config["cluster_name"] = name
    config["provider"].update(head_ip=net[head].addr, worker_ips=[net[w].addr for w in workers])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": key}
    config["setup_commands"] = []  # pdserve is installed: it is this checkout
    prefix = f"export PATH={VENV_BIN}:$PATH RAY_AUTH_MODE=disabled && "
    for key_ in ("head_start_ray_commands", "worker_start_ray_commands"):
        config[key_] = [prefix + c for c in config[key_]]
    return config


def ray_up(net: Network, head: str, workers: list[str]) -> RayCluster:
    workdir = tempfile.mkdtemp(prefix="pdserve-rayup-")
    keys = SshKeys(workdir)
    for host in [head, *workers]:
        sshd = net[host].start_sshd(keys)
        time.sleep(0.2)
        if sshd.poll() is not None:
            raise RuntimeError(f"sshd in {host} exited: {sshd.stderr.read().decode()[-2000:]}")
    name = f"pdt{os.getpid()}"
    config = local_config(net, head, workers, keys.private, name)
    path = os.path.join(workdir, "local.yaml")
    Path(path).write_text(yaml.safe_dump(config))
    # `ray up` runs from the head host, as an operator on one of the machines would.
    res = subprocess.run(net[head].cmd(str(VENV_BIN / "ray"), "up", "-y", "--no-config-cache", path),
                         capture_output=True, text=True, timeout=RAY_UP_TIMEOUT_S,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    Path(workdir, "ray-up.log").write_text(res.stdout + "\n" + res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"ray up failed ({res.returncode}); log in {workdir}/ray-up.log:\n{res.stdout[-3000:]}")
    cluster = RayCluster(net, head, workers, path, f"{net[head].addr}:6379", workdir)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        ips = {n["ip"] for n in cluster.nodes()}
        if ips == {net[h].addr for h in [head, *workers]}:
            return cluster
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker hosts did not join within {JOIN_TIMEOUT_S} s: alive {sorted(ips)}")
        time.sleep(2)


def clean_up(cluster: RayCluster | None, net: Network, name: str | None = None) -> None:
    """What `ray up` left outside the hosts (the processes die with Network.close)."""
    for host in net.hosts.values():
        shutil.rmtree(f"/tmp/ray-{host.addr}", ignore_errors=True)
    home = Path.home()
    for f in ("ray_bootstrap_config.yaml", "ray_bootstrap_key.pem"):
        (home / f).unlink(missing_ok=True)
    Path(f"/tmp/cluster-pdt{os.getpid()}.state").unlink(missing_ok=True)
    if cluster is not None:
        shutil.rmtree(cluster.workdir, ignore_errors=True)
