"""The module tables of the docs list exactly the modules of the tree: a module added, moved or
removed without its row fails here (docs/cluster.md, docs/kvtransfer.md, docs/architecture.md's
handoff table); and the walk of one request in docs/architecture.md names only files that exist.
A table lists its folder's own modules and, as `sub/` rows, its subpackages (each of which has
a table of its own)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# doc -> (the folder its module table lists, the section holding the table; None: the whole doc)
TABLES = {"docs/cluster.md#cluster": ("cluster", "## cluster/ modules"),
          "docs/cluster.md#queue": ("cluster/queue", "## cluster/queue/ modules"),
          "docs/cluster.md#planner": ("cluster/planner", "## cluster/planner/ modules"),
          "docs/cluster.md#kvindex": ("cluster/kvindex", "## cluster/kvindex/ modules"),
          "docs/kvtransfer.md": ("kvtransfer/nixl", "## Pieces (`kvtransfer/nixl/`)"),
          "docs/architecture.md": ("kvtransfer", "## The handoff protocol")}


def section(doc: str, heading: str | None) -> str:
    text = (ROOT / doc.split("#")[0]).read_text()
    if heading is None:
        return text
    body = text[text.index(heading) + len(heading):]
    return body[: body.index("\n## ")] if "\n## " in body else body


def listed(doc: str) -> set[str]:
    """Rows of a module table: | `name.py` | or | `sub/name.py` | (folder rows `sub/` too)."""
    return set(re.findall(r"^\| `([\w/]+\.py|\w+/)` \|", section(doc, TABLES[doc][1]), re.M))


@pytest.mark.parametrize("doc", sorted(TABLES))
def test_module_table_matches_the_tree(doc):
    folder = ROOT / TABLES[doc][0]
    tree = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    rows = listed(doc)
    files = {r for r in rows if r.endswith(".py")}
    assert tree - files == set(), f"{doc} has no row for {sorted(tree - files)}"
    assert files - tree == set(), f"{doc} lists modules that do not exist: {sorted(files - tree)}"
    folders = {r for r in rows if r.endswith("/")}
    subpackages = {p.parent.name + "/" for p in folder.glob("*/__init__.py")}
    assert folders == subpackages, f"{doc}: subpackage rows {sorted(folders)}, the tree's {sorted(subpackages)}"


def test_the_request_walk_names_files_that_exist():
    """docs/architecture.md follows one remote request file by file: each file it names is there."""
    walk = section("docs/architecture.md", "## One remote request, file by file")
    named = set(re.findall(r"`(\w+(?:/\w+)+\.py)`", walk))
    assert len(named) >= 20, sorted(named)
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_the_etcd_keyspace_in_the_map_lists_every_key_family():
    """docs/architecture.md's etcd keyspace names every kind of key `Keyspace` builds, and
    nothing it does not build."""
    import inspect

    from pdserve.cluster.keys import Keyspace

    ks = Keyspace("c")
    built = set()
    for name, fn in inspect.getmembers(ks, inspect.ismethod):
        if name.startswith("_") or name in ("parse_worker",):
            continue
        params = list(inspect.signature(fn).parameters)
        args = {"role": "prefill", "worker_id": "w0", "kind": "router", "seq": 0}
        key = fn(**{p: args[p] for p in params}).decode()
        family = key.removeprefix("/pdserve/c/").split("/")[0:2]
        built.add("/".join(family) if family[0] in ("planner", "config") else family[0])
    built |= {"config/autoscale"}  # the second policy kind
    text = section("docs/architecture.md", "### etcd keyspace")
    listed = set()
    for line in re.findall(r"^    /pdserve/<cluster>/(\S+)", text, re.M):
        parts = line.split("/")
        listed.add("/".join(parts[:2]) if parts[0] in ("planner", "config") else parts[0])
    built.discard("")  # prefix() is the root itself
    assert listed == built, f"the map lists {sorted(listed)}; Keyspace builds {sorted(built)}"
