"""docs/architecture.md's layout table, enforced: which folder imports which, exactly.

Every ``.py`` file of each code folder is parsed (never imported); every
``import`` / ``from ... import`` counts, at module level, inside functions and
under ``if TYPE_CHECKING:`` alike (a type-only arrow is still an arrow; only
the cycle check leaves type-only imports out, since they never run).
Relative imports are resolved against the file's own package, so
``from .core import X`` in ``cluster/queue/client.py`` is
``pdserve.cluster.queue.core`` and ``from ..keys import Y`` is
``pdserve.cluster.keys``.

Rules (arrows point down the table; ``common/`` is below everything):

- each folder imports only the pdserve folders its row lists (itself always
  allowed), and every folder its row lists is imported somewhere: the table is
  what the code does, not a looser bound;
- no code folder imports the package root ``pdserve`` itself or one of its
  modules (``pdserve.launch``, ``pdserve.cli``): the root is the composition
  root, nothing imports it (tests may);
- the modules of the whole package (every folder, subpackages included, and the
  root) form no import cycle.

The table is parsed from docs/architecture.md (`layout_table`), so the map a
newcomer reads and the rule the tests enforce are one text. Known exceptions
are listed in ``KNOWN_EXCEPTIONS`` with their reason; the
list can only shrink.

The seam rule (workers touch only the engine's remote-KV seam) is checked by
its own test, not here.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOT_PACKAGE = "pdserve"

DOC = ROOT / "docs" / "architecture.md"


def layout_table(doc: Path = DOC) -> dict[str, frozenset[str]]:
    """docs/architecture.md's layout table: folder -> the pdserve folders it imports.

    Rows look like ``| `engine/` | what it owns | `common` |``; the last cell lists
    folders in backticks, or ``—`` for none. The root package's row is ``pdserve/``.
    """
    text = doc.read_text(encoding="utf-8")
    section = text[text.index("## Layout"):]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for m in re.finditer(r"^\| `(\w+)/` \|.*\| ([^|]*) \|$", section, re.M):
        rows[m.group(1)] = frozenset(re.findall(r"`(\w+)`", m.group(2)))
    return rows


TABLE = layout_table()
ROOT_IMPORTS = TABLE.get(ROOT_PACKAGE, frozenset())
# folder -> the other pdserve folders it may import: the table, less the composition root's row
ALLOWED: dict[str, frozenset[str]] = {k: v for k, v in TABLE.items() if k != ROOT_PACKAGE}
FOLDERS = tuple(ALLOWED)

# (file, folder it imports) -> why the layout table does not hold there yet.
# Each one is reported, not hidden: test_known_exceptions_are_still_needed fails
# once an entry is no longer needed, so the list can only shrink.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    """``cluster/queue/core.py`` -> ``pdserve.cluster.queue.core``; ``__init__`` names its package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([ROOT_PACKAGE, *parts])


def _package_of(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


@lru_cache(maxsize=None)
def _all_modules() -> frozenset[str]:
    """Every module and package name under the code folders and the root package."""
    names = {ROOT_PACKAGE}
    for folder in (*FOLDERS, ROOT_PACKAGE):
        for path in (ROOT / folder).rglob("*.py"):
            if folder == ROOT_PACKAGE:
                stem = path.relative_to(ROOT / ROOT_PACKAGE).with_suffix("")
                if stem.parts[-1] != "__init__":
                    names.add(".".join([ROOT_PACKAGE, *stem.parts]))
            else:
                names.add(_module_name(path))
    return frozenset(names)


def _resolve(path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute module a relative ``from`` import names (None if it escapes ``pdserve``)."""
    package = _package_of(path).split(".")
    if node.level - 1 >= len(package):
        return None
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import node with whether it sits under ``if TYPE_CHECKING:`` (never run)."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def walk(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, type_only))
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                walk(child, True)
            for child in node.orelse:
                walk(child, type_only)
            return
        for child in ast.iter_child_nodes(node):
            walk(child, type_only)

    walk(tree, False)
    return out


@lru_cache(maxsize=None)
def imports_of(path: Path, *, runtime_only: bool = False) -> tuple[tuple[int, str], ...]:
    """(line, absolute module) of every import in one file, in source order.

    ``from pkg import name`` yields ``pkg.name`` when that is a module of the
    tree (a submodule import), else ``pkg``. ``runtime_only`` leaves out the
    imports under ``if TYPE_CHECKING:``, which never execute.
    """
    out: list[tuple[int, str]] = []
    for node, type_only in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if runtime_only and type_only:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
            continue
        module = (node.module or "") if node.level == 0 else _resolve(path, node)
        if module is None:
            out.append((node.lineno, f"<relative import beyond the top: level {node.level}>"))
            continue
        for alias in node.names:
            sub = f"{module}.{alias.name}"
            out.append((node.lineno, sub if sub in _all_modules() else module))
    return tuple(out)


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _layer_of(module: str) -> str | None:
    """The folder (or ``<root>``) a pdserve module belongs to; None for non-pdserve modules."""
    parts = module.split(".")
    if parts[0] != ROOT_PACKAGE:
        return None
    if len(parts) == 1 or parts[1] not in ALLOWED:
        return "<root>"  # `pdserve` itself, `pdserve.launch`, `pdserve.cli`, ...
    return parts[1]


def forbidden_imports(folder: str) -> list[tuple[str, int, str, str]]:
    """(file, line, module, its folder or ``<root>``) of each import the table forbids (a row
    that lists ``pdserve`` may import the composition root: only bench's does)."""
    allowed = ALLOWED[folder] | {folder} | ({"<root>"} if ROOT_PACKAGE in ALLOWED[folder] else set())
    out = []
    for path in _files(folder):
        rel = path.relative_to(ROOT).as_posix()
        for line, module in dict.fromkeys(imports_of(path)):
            layer = "<relative>" if module.startswith("<relative") else _layer_of(module)
            if layer is not None and layer not in allowed:
                out.append((rel, line, module, layer))
    return out


def layering_violations(folder: str, exceptions: dict[tuple[str, str], str] | None = None) -> list[str]:
    """``FILE:LINE: imports MODULE (why not)`` for each forbidden import, in file order."""
    bad = []
    for rel, line, module, layer in forbidden_imports(folder):
        if (rel, layer) in (exceptions or {}):
            continue
        if layer == "<root>":
            why = "the package root is the composition root: nothing imports it"
        elif layer == "<relative>":
            why = "a relative import must stay inside pdserve"
        else:
            why = f"{folder}/ may import only {', '.join(sorted(ALLOWED[folder])) or 'no other pdserve folder'}"
        bad.append(f"{rel}:{line}: imports {module} ({why})")
    return bad


@pytest.mark.parametrize("folder", FOLDERS)
def test_folder_imports_only_what_the_layout_table_allows(folder):
    assert (ROOT / folder).is_dir(), f"{folder}/ is in docs/architecture.md's layout table but missing"
    bad = layering_violations(folder, KNOWN_EXCEPTIONS)
    assert not bad, "forbidden imports (docs/architecture.md, layout table):\n  " + "\n  ".join(bad)


def imported_folders(folder: str) -> set[str]:
    """The other pdserve folders the files of `folder` import (the root package's files for
    ROOT_PACKAGE; a file of the root imports `<root>` modules freely)."""
    paths = sorted((ROOT / ROOT_PACKAGE).glob("*.py")) if folder == ROOT_PACKAGE else _files(folder)
    own = (None, "<root>", folder) if folder == ROOT_PACKAGE else (None, folder)
    return {ROOT_PACKAGE if layer == "<root>" else layer for path in paths for _, module in imports_of(path)
            if (layer := _layer_of(module)) not in own}


@pytest.mark.parametrize("folder", (*FOLDERS, ROOT_PACKAGE))
def test_the_layout_table_is_exactly_what_the_code_imports(folder):
    listed = ROOT_IMPORTS if folder == ROOT_PACKAGE else ALLOWED[folder]
    used = imported_folders(folder) - {layer for (rel, layer) in KNOWN_EXCEPTIONS if rel.startswith(folder + "/")}
    assert used == set(listed), (f"docs/architecture.md says {folder}/ imports {sorted(listed)}; the code imports "
                                 f"{sorted(used)}: fix the row or the code")


def test_the_table_has_no_cycle_and_names_only_folders():
    assert set(FOLDERS) >= {"common", "engine", "handoff", "kvtransfer", "control", "taskqueue", "planner", "prefill",
                            "decode"}
    for folder, listed in TABLE.items():
        known = set(FOLDERS) | ({ROOT_PACKAGE} if folder == "bench" else set())
        assert listed <= known, f"{folder}/'s row names unknown folders {sorted(listed - known)}"
    graph = {f: set(v) - {ROOT_PACKAGE} for f, v in ALLOWED.items()}
    assert find_cycle(graph) is None, find_cycle(graph)


def test_known_exceptions_are_still_needed():
    seen = {(rel, layer) for folder in FOLDERS for rel, _, _, layer in forbidden_imports(folder)}
    stale = sorted(set(KNOWN_EXCEPTIONS) - seen)
    assert not stale, f"no longer needed, delete from KNOWN_EXCEPTIONS: {stale}"


def test_every_code_folder_of_the_package_is_checked():
    """A new subpackage in setup.py's PACKAGE_DIRS must get a row in ALLOWED (and in the layout
    table). setup.py is parsed, not run."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    node = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "PACKAGE_DIRS" for t in n.targets))
    package_dir = ast.literal_eval(node)
    mapped = {folder.split("/")[0] for name, folder in package_dir.items() if name != ROOT_PACKAGE}
    assert mapped - set(FOLDERS) == set(), f"folders with no layering rule: {sorted(mapped - set(FOLDERS))}"


def test_nothing_outside_bench_imports_bench():
    """bench/ may import the product; the product may not import bench/: no code folder (the
    table: no row lists it) and not the composition root either (pdserve/*.py). `pdserve
    bench ...` reaches it by name through the CLI's command registry, like any plugin."""
    bad = []
    for path in sorted((ROOT / ROOT_PACKAGE).rglob("*.py")):
        for line, module in imports_of(path):
            if _layer_of(module) == "bench":
                bad.append(f"{path.relative_to(ROOT).as_posix()}:{line}: imports {module}")
    assert not any("bench" in allowed for allowed in ALLOWED.values())
    assert not bad, "the product imports bench/:\n  " + "\n  ".join(bad)


def import_graph() -> dict[str, set[str]]:
    """Module -> the pdserve modules it imports when it runs (every folder and the root).

    Imports inside functions count (a lazy import still closes a runtime
    circle); imports under ``if TYPE_CHECKING:`` do not (they never run: an
    annotation naming a class of a module that imports this one is no circle).
    """
    graph: dict[str, set[str]] = {}
    paths = [p for folder in FOLDERS for p in _files(folder)]
    paths += sorted((ROOT / ROOT_PACKAGE).glob("*.py")) if (ROOT / ROOT_PACKAGE).is_dir() else []
    for path in paths:
        name = _root_module_name(path) if path.parent == ROOT / ROOT_PACKAGE else _module_name(path)
        graph[name] = {m for _, m in imports_of(path, runtime_only=True)
                       if m != name and (m == ROOT_PACKAGE or m.startswith(ROOT_PACKAGE + "."))}
    return graph


def _root_module_name(path: Path) -> str:
    """``pdserve/launcher.py`` -> ``pdserve.launcher``; ``pdserve/__init__.py`` -> ``pdserve``."""
    return ROOT_PACKAGE if path.stem == "__init__" else f"{ROOT_PACKAGE}.{path.stem}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (first module repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {n: WHITE for n in graph}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if color.get(nxt, BLACK) == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color.get(nxt) == WHITE:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = BLACK
        return None

    for start in sorted(graph):
        if color[start] == WHITE:
            found = visit(start)
            if found:
                return found
    return None


def test_no_import_cycle_anywhere():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle (function-level imports count): " + " -> ".join(cycle)


# --- the checker itself --------------------------------------------------------


def test_relative_imports_resolve_within_the_folder(tmp_path, monkeypatch):
    import sys

    mod = sys.modules[__name__]
    pkg = tmp_path / "control" / "queue"
    pkg.mkdir(parents=True)
    (tmp_path / "control" / "__init__.py").write_text("")
    (tmp_path / "control" / "keys.py").write_text("")
    (pkg / "__init__.py").write_text("from .core import QueueCore\n")
    (pkg / "core.py").write_text("from ..keys import DEFAULT_QUEUE_NAME\nfrom . import wire\n")
    (pkg / "wire.py").write_text("def f():\n    from .core import QueueCore\n")
    (pkg / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .core import QueueCore\n")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    monkeypatch.setattr(mod, "FOLDERS", ("control",))
    _all_modules.cache_clear()
    imports_of.cache_clear()
    try:
        assert [m for _, m in imports_of(pkg / "core.py")] == ["pdserve.cluster.keys", "pdserve.cluster.queue.wire"]
        assert [m for _, m in imports_of(pkg / "__init__.py")] == ["pdserve.cluster.queue.core"]
        # A TYPE_CHECKING import is a layering arrow but never runs, so it closes no cycle.
        assert [m for _, m in imports_of(pkg / "typed.py")] == ["typing", "pdserve.cluster.queue.core"]
        assert import_graph()["pdserve.cluster.queue.typed"] == set()
        assert find_cycle(import_graph()) == [
            "pdserve.cluster.queue.core", "pdserve.cluster.queue.wire", "pdserve.cluster.queue.core"]
    finally:
        _all_modules.cache_clear()
        imports_of.cache_clear()


def test_a_violation_names_the_file_and_the_import(tmp_path, monkeypatch):
    import sys

    mod = sys.modules[__name__]
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "bad.py").write_text(
        "def f():\n    from pdserve.engine import LLM\n    import pdserve.launch\n    from pdserve import cli\n")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    monkeypatch.setattr(mod, "FOLDERS", ("router",))
    _all_modules.cache_clear()
    imports_of.cache_clear()
    try:
        bad = layering_violations("router")
    finally:
        _all_modules.cache_clear()
        imports_of.cache_clear()
    assert len(bad) == 3
    assert bad[0].startswith("router/bad.py:2: imports pdserve.engine (router/ may import only common")
    assert bad[1].startswith("router/bad.py:3: imports pdserve.launch (the package root")
    assert bad[2].startswith("router/bad.py:4: imports pdserve (the package root")
