"""Core ownership: a worker role's `cpus` (a list or "auto") pins its process, sizes torch's
threads, sets Ray's CPU accounting, and shows in its load record (pdserve status)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdserve.cluster.runtime import cpu_list, worker_cpus
from pdserve.cluster.topology import TopologyError, load_topology
from pdserve.cluster.worker_config import WorkerConfig, launch_config

REPO = Path(__file__).resolve().parents[2]
BASE = """\
cluster: test
model: {path: auto}
roles:
  prefill: {replicas: 1ROLE_P}
  decode: {replicas: 2ROLE_D}
"""


def _topo(tmp_path, prefill: str = "", decode: str = ""):
    path = tmp_path / "topo.yaml"
    path.write_text(BASE.replace("ROLE_P", f", {prefill}" if prefill else "").replace("ROLE_D", f", {decode}" if decode else ""))
    return load_topology(path)


def test_auto_splits_the_hosts_cores_evenly_and_wraps_past_them():
    avail = sorted(os.sched_getaffinity(0))
    n = len(avail)
    assert worker_cpus("auto", 0, 1) == avail  # one worker owns every core
    two = [worker_cpus("auto", slot, 2) for slot in range(2)]
    assert all(len(c) == max(1, n // 2) for c in two)
    if n >= 2:
        assert not set(two[0]) & set(two[1]), f"two workers share cores: {two}"
    many = [worker_cpus("auto", slot, n + 1) for slot in range(n + 1)]
    assert all(len(c) == 1 for c in many) and many[n] == many[0]  # more workers than cores: wrap
    assert worker_cpus([3, 1], 5, 9) == [3, 1] and worker_cpus(None, 0, 1) is None
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_topology_cpus_set_rays_accounting_and_launch_slots(tmp_path):
    topo = _topo(tmp_path, prefill="cpus: [0, 1]", decode="cpus: auto")
    assert topo.roles.prefill.resources.num_cpus == 2.0  # follows the list
    host = len(os.sched_getaffinity(0))
    assert topo.roles.decode.resources.num_cpus == max(1, host // 3)
    cfgs = [launch_config(topo, role, i, model="m", etcd_endpoints=["x:1"]) for role, i in
            (("prefill", 0), ("decode", 0), ("decode", 1))]
    assert [(c["cpus"], c["cpu_slot"], c["cpu_slots"]) for c in cfgs] == [([0, 1], 0, 3), ("auto", 1, 3), ("auto", 2, 3)]


@pytest.mark.parametrize("role, error", [
    ("cpus: [1, 1]", "distinct CPU ids"),
    ("cpus: []", "non-empty list"),
    ("cpus: some", "roles.prefill.cpus"),
    ("cpus: [0], resources: {num_cpus: 2}", "differs from the 1 cores of roles.prefill.cpus"),
])
def test_bad_cpus_are_named(tmp_path, role, error):
    with pytest.raises(TopologyError, match=error):
        _topo(tmp_path, prefill=role)


def test_a_worker_process_is_pinned_with_all_its_threads_and_torch_threads_match():
    """In a child process (pinning the test process would slow the rest of the suite)."""
    code = textwrap.dedent("""
        import os, threading, time, json, torch
        from pdserve.cluster.worker_config import WorkerConfig
        early = threading.Event()
        t = threading.Thread(target=early.wait, daemon=True); t.start()   # a thread from before the pin
        cores = WorkerConfig(model="m", cpus=[0]).pin_cpus("test worker")
        masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
        later = []
        t2 = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0)))); t2.start(); t2.join()
        print(json.dumps({"cores": cores, "masks": list(masks.values()), "later": later[0],
                          "threads": torch.get_num_threads()}))
        early.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    import json

    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["cores"] == [0] and res["threads"] == 1 and res["later"] == [0]
    assert all(m == [0] for m in res["masks"]), f"a thread kept its old mask: {res['masks']}"
    bad = subprocess.run([sys.executable, "-c", "from pdserve.cluster.worker_config import WorkerConfig; "
                          "WorkerConfig(model='m', cpus=[4096]).pin_cpus('w')"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert bad.returncode != 0 and "CPU ids [4096] do not exist on this host" in bad.stderr


def test_the_local_topology_gives_each_worker_its_own_core():
    topo = load_topology(REPO / "configs" / "topologies" / "1p1d-local.yaml")
    assert topo.roles.prefill.cpus == topo.roles.decode.cpus == "auto"
    slots = [WorkerConfig.of({k: v for k, v in launch_config(topo, r, 0, model="m", etcd_endpoints=["x:1"]).items()
                              if k in WorkerConfig.__dataclass_fields__}) for r in ("prefill", "decode")]
    cores = [worker_cpus(c.cpus, c.cpu_slot, c.cpu_slots) for c in slots]
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(cores[0]) & set(cores[1])
