"""The shipped configuration files, installed with the package as `pdserve.configs`.

``topologies/``, ``router/`` and ``autoscale/`` hold YAML only; `path` finds one of them the
same way from a checkout and from an installed wheel.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def path(*parts: str) -> Path:
    """A shipped file, e.g. ``path("topologies", "1p1d-local.yaml")``."""
    return ROOT.joinpath(*parts)
