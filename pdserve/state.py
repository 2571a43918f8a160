"""What `pdserve up` started, as a state file that `status`, `drain` and `down` read later."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.cluster.topology import Topology


@dataclass
class ClusterState:
    """What `up` started: written as JSON to `<run_dir>/<cluster>.state.json`."""

    cluster: str
    topology: str
    namespace: str
    ray_address: str
    ray_head_pid: int | None  # set when `up` started the Ray head (down stops it)
    etcd_endpoints: list[str]
    etcd_pid: int | None  # set when `up` started etcd (down stops it)
    queue_name: str
    model: str
    actors: list[dict] = field(default_factory=list)  # {name, role, worker_id, grpc, http}
    started_at: float = field(default_factory=time.time)
    # The etcd gate (etcd.gate): where workers and readers reach etcd, and the pid of the
    # supervisor `up` started it under (it restarts the gate; `down` stops its process group).
    # No pid for a gate run elsewhere (etcd.gate.endpoints).
    gate_endpoints: list[str] = field(default_factory=list)
    gate_pid: int | None = None

    @property
    def worker_etcd_endpoints(self) -> list[str]:
        """Where workers reach etcd: through the gate when there is one."""
        return self.gate_endpoints or self.etcd_endpoints

    def follower_etcd_endpoints(self, identity: str | None) -> list[str]:
        """Where a gateway or the KV index connecting as etcd user `identity` reaches etcd:
        through the gate when there is one and it serves that identity (the reader, the shared
        worker: a gated cluster grants them nothing directly); the operator, which the gate
        does not serve, and a plaintext etcd (no identity) keep etcd's own endpoints."""
        if self.gate_endpoints and identity not in (None, "operator"):
            return list(self.gate_endpoints)
        return list(self.etcd_endpoints)

    @property
    def decode_endpoints(self) -> list[dict]:
        return [a for a in self.actors if a["role"] == "decode"]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> "ClusterState":
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no running cluster recorded there (run `pdserve up` first)")
        return cls(**json.loads(path.read_text()))


def state_path(topology: "Topology") -> Path:
    return topology.run_path / f"{topology.cluster}.state.json"
