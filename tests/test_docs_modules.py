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
    assert 15 <= len(named) < 25, sorted(named)  # one request touches under 25 files
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_who_owns_a_remote_request_has_a_one_line_answer_that_names_the_owner_in_the_code():
    """The walk opens with the answer, and the class it names is in the module it names, holding
    what the answer says it holds."""
    walk = section("docs/architecture.md", "## One remote request, file by file")
    answer = re.search(r"\*\*Who owns a remote request's state\?\*\* Its `(\w+)` \(`([\w/]+)\.py`\)", walk)
    assert answer, "docs/architecture.md: the walk must open with who owns a remote request's state"
    import dataclasses
    import importlib

    cls = getattr(importlib.import_module("pdserve." + answer.group(2).replace("/", ".")), answer.group(1))
    fields = {f.name for f in dataclasses.fields(cls)}
    assert {"attempt", "reservation", "deadline", "breakdown"} <= fields, fields


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


FILE_LINES, FUNCTION_LINES = 400, 80


def oversized(root: Path = ROOT / "pdserve") -> set[str]:
    """Product files over FILE_LINES lines (`folder/file.py`) and functions over FUNCTION_LINES
    (`folder/file.py` `name`), as docs/architecture.md's "Sizes" table names them."""
    import ast

    found = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("api/v1/"):  # generated stubs
            continue
        text = path.read_text()
        if text.count("\n") > FILE_LINES:
            found.add(f"`{rel}`")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > FUNCTION_LINES:
                found.add(f"`{rel}` `{node.name}`")
    return found


def test_every_oversized_file_and_function_is_justified_in_the_map():
    """Files over 400 lines and functions over 80 are split, or docs/architecture.md's "Sizes"
    table says in one line why they stay whole; it names nothing that is no longer over."""
    rows = re.findall(r"^\| (`[\w/]+\.py`(?: `\w+`)?) \| (.+) \|$", section("docs/architecture.md", "## Sizes"),
                      re.M)
    listed = {name for name, why in rows if why.strip()}
    actual = oversized()
    assert actual - listed == set(), f"split these, or say why they stay whole: {sorted(actual - listed)}"
    assert listed - actual == set(), f"no longer oversized: drop their rows {sorted(listed - actual)}"


def test_the_size_check_sees_an_oversized_file_and_function(tmp_path):
    """The scan itself works: a long file and a long function in a tree are found, a short one is not."""
    (tmp_path / "decode").mkdir()
    (tmp_path / "decode" / "long.py").write_text("def f():\n" + "    x = 1\n" * 90 + "y = 2\n" * 320)
    (tmp_path / "decode" / "short.py").write_text("def g():\n    return 1\n")
    assert oversized(tmp_path) == {"`decode/long.py`", "`decode/long.py` `f`"}
