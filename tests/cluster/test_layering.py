"""The control plane stays below the workers (ARCHITECTURE.md, layout table)."""

from __future__ import annotations

import ast
from pathlib import Path

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"
FORBIDDEN = ("pdserve.engine", "pdserve.router", "pdserve.prefill", "pdserve.decode", "pdserve.kvtransfer")


def test_cluster_never_imports_engine_router_or_workers():
    offenders = []
    for path in CLUSTER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(FORBIDDEN)]
    assert offenders == []
