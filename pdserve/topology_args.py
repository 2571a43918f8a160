"""The `--topology FILE` option the cluster commands share (`up`, `status`, `down`, `drain`,
`demo`, `planner ...`), and how they load the file it names."""

from __future__ import annotations

from pathlib import Path

from pdserve import configs

DEFAULT_TOPOLOGY = configs.path("topologies", "1p1d-local.yaml")  # shipped with the package


def add_topology_arg(p) -> None:
    p.add_argument("--topology", default=str(DEFAULT_TOPOLOGY),
                   help="topology YAML (default: the shipped topologies/1p1d-local.yaml, "
                        f"{DEFAULT_TOPOLOGY})")


def load_topology_arg(path: str):
    """The topology `--topology` names (FileNotFoundError naming the option when absent)."""
    from pdserve.cluster.topology import load_topology

    if not Path(path).is_file():
        raise FileNotFoundError(f"--topology {path}: no such file")
    return load_topology(path)
