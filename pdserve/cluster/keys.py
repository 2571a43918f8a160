"""Names and addresses of the control plane: the etcd keyspace of one cluster
(docs/architecture.md, "etcd keyspace"), etcd endpoints, the queue actor's name and
namespace, and the software version every worker advertises in its record.
Dependency-free, so reading a topology costs no Ray or gRPC import.

    /pdserve/<cluster>/workers/<role>/<worker_id>   JSON WorkerInfo (leased)
    /pdserve/<cluster>/nixl/<worker_id>             raw NIXL agent metadata (leased)
    /pdserve/<cluster>/config/router                router + QoS policy YAML
    /pdserve/<cluster>/config/autoscale             autoscale policy YAML
    /pdserve/<cluster>/planner/leader               planner election (leased: the running planner)
    /pdserve/<cluster>/planner/state                planner state: drains and starts in progress, memory
    /pdserve/<cluster>/planner/snapshots            the last two snapshots it decided on (explain)
    /pdserve/<cluster>/planner/decisions/<seq>      decision history (bounded)
    /pdserve/<cluster>/drain/<worker_id>            an operator's drain request (not leased)

With etcd RBAC (cluster/etcd_auth.py) a worker with an identity of its own
(`etcd.tls.workers`) writes only its own two keys, workers/<role>/<worker_id> and
nixl/<worker_id>; the shared worker identity writes all of workers/ and nixl/; the
operator identity writes everything.

Every key is built here and nowhere else.
"""

from __future__ import annotations

import re

ROLES = ("prefill", "decode")
VERSION = "0.1.0"  # the workers' software version, advertised in WorkerInfo.version
DEFAULT_QUEUE_NAME = "pdserve-prefill-queue"
DEFAULT_NAMESPACE = "pdserve"
DEFAULT_QUEUE_CAPACITY = 1024
POLICY_KINDS = ("router", "autoscale")

# Names become path segments: no '/', no whitespace, nothing etcd tools choke on.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def check_name(what: str, value: str) -> str:
    """Return `value` if it is a valid key segment, else raise ValueError naming `what`."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{what}={value!r} is not a valid name: use 1-128 characters from "
            "[A-Za-z0-9._:-], starting with a letter or digit"
        )
    return value


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role={role!r} must be one of {', '.join(ROLES)}")
    return role


def check_policy_kind(kind: str) -> str:
    if kind not in POLICY_KINDS:
        raise ValueError(f"policy kind={kind!r} must be one of {', '.join(POLICY_KINDS)}")
    return kind


class Keyspace:
    """Builds and parses the keys of one cluster (bytes, as etcd wants them)."""

    def __init__(self, cluster: str):
        self.cluster = check_name("cluster", cluster)
        self.root = f"/pdserve/{cluster}"

    def prefix(self) -> bytes:
        """Every key of this cluster (etcd RBAC grants ranges of it: cluster/etcd_auth.py)."""
        return f"{self.root}/".encode()

    def workers_prefix(self, role: str | None = None) -> bytes:
        if role is None:
            return f"{self.root}/workers/".encode()
        return f"{self.root}/workers/{check_role(role)}/".encode()

    def worker(self, role: str, worker_id: str) -> bytes:
        return self.workers_prefix(role) + check_name("worker_id", worker_id).encode()

    def nixl_prefix(self) -> bytes:
        return f"{self.root}/nixl/".encode()

    def nixl(self, worker_id: str) -> bytes:
        return self.nixl_prefix() + check_name("worker_id", worker_id).encode()

    def policy(self, kind: str) -> bytes:
        return f"{self.root}/config/{check_policy_kind(kind)}".encode()

    def drain(self, worker_id: str) -> bytes:
        """Operator's request that a worker drain (`pdserve drain`); not leased."""
        return f"{self.root}/drain/{check_name('worker_id', worker_id)}".encode()

    def planner_leader(self) -> bytes:
        return f"{self.root}/planner/leader".encode()

    def planner_state(self) -> bytes:
        return f"{self.root}/planner/state".encode()

    def planner_snapshots(self) -> bytes:
        return f"{self.root}/planner/snapshots".encode()

    def planner_decisions_prefix(self) -> bytes:
        return f"{self.root}/planner/decisions/".encode()

    def planner_decision(self, seq: int) -> bytes:
        """Zero-padded so that keys sort in decision order."""
        return self.planner_decisions_prefix() + f"{seq:012d}".encode()

    def parse_worker(self, key: bytes) -> tuple[str, str] | None:
        """(role, worker_id) of a worker key, or None for anything else."""
        prefix = self.workers_prefix()
        if not key.startswith(prefix):
            return None
        parts = key[len(prefix):].decode(errors="replace").split("/")
        if len(parts) != 2 or parts[0] not in ROLES or not parts[1]:
            return None
        return parts[0], parts[1]


def parse_endpoints(endpoints: str | list[str] | tuple[str, ...]) -> list[tuple[str, int]]:
    """'h1:2379,h2:2379' or ['h1:2379', 'http://h2:2379'] -> [(host, port), ...]."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for item in items:
        item = item.strip()
        for scheme in ("http://", "https://"):
            item = item.removeprefix(scheme)
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {item!r} must look like host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out
