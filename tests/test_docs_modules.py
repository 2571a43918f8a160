"""The module tables of the docs list exactly the modules of the tree: a module added, moved or
removed without its row fails here (docs/cluster.md, docs/kvtransfer.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLES = {"docs/cluster.md": "cluster", "docs/kvtransfer.md": "kvtransfer"}


def listed(doc: str) -> set[str]:
    """Rows of a module table: | `name.py` | or | `sub/name.py` | (folder rows `sub/` too)."""
    return set(re.findall(r"^\| `([\w/]+\.py|\w+/)` \|", (ROOT / doc).read_text(), re.M))


@pytest.mark.parametrize("doc", sorted(TABLES))
def test_module_table_matches_the_tree(doc):
    folder = ROOT / TABLES[doc]
    tree = {p.relative_to(folder).as_posix() for p in folder.rglob("*.py") if p.name != "__init__.py"}
    rows = listed(doc)
    files = {r for r in rows if r.endswith(".py")}
    assert tree - files == set(), f"{doc} has no row for {sorted(tree - files)}"
    assert files - tree == set(), f"{doc} lists modules that do not exist: {sorted(files - tree)}"
    folders = {r for r in rows if r.endswith("/")}
    assert folders == {p.parent.relative_to(folder).as_posix() + "/" for p in folder.rglob("*/__init__.py")}
