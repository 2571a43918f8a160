"""docs/architecture.md's layout table, enforced with maintained tools: which folder imports
which, exactly.

The import graph is grimp's (the library import-linter is built on), read from the source
tree: `pdserve/` is a regular package whose subpackages are the design card's folders (each
also linked at the top of the checkout), so the tool resolves every ``pdserve.*`` import as a
type checker or an IDE does. Every ``import`` / ``from ... import``
counts, at module level, inside functions and under ``if TYPE_CHECKING:`` alike (a type-only
arrow is still an arrow; only the cycle check leaves type-only imports out, since they never
run).

Rules:

- each folder imports exactly the pdserve folders its row lists: no more (a forbidden
  arrow), no fewer (the table is what the code does, not a looser bound);
- no code folder imports the package root ``pdserve`` itself or one of its modules
  (``pdserve.launch``, ``pdserve.cli``): the root is the composition root, nothing imports
  it (bench may);
- the modules of the whole package form no import cycle;
- the import-linter contracts in pyproject.toml (``lint-imports``, run by ``.ci/run``) agree
  with the table, and fail on a planted violation.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import lru_cache
from pathlib import Path

import grimp
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
FOLDERS = tuple(k for k in TABLE if k != ROOT_PACKAGE)


@lru_cache(maxsize=2)
def graph(runtime_only: bool = False) -> grimp.ImportGraph:
    return fresh_graph(runtime_only)


def fresh_graph(runtime_only: bool = False) -> grimp.ImportGraph:
    """The package's import graph, read from this checkout (not from wherever pdserve is
    installed): the checkout's root first on sys.path."""
    sys.path.insert(0, str(ROOT))
    try:
        return grimp.build_graph(ROOT_PACKAGE, cache_dir=None, exclude_type_checking_imports=runtime_only)
    finally:
        sys.path.remove(str(ROOT))


def folder_of(module: str) -> str:
    """The table's folder of a pdserve module; ``pdserve`` for the root and its modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else ROOT_PACKAGE


def imports_by_folder(g: grimp.ImportGraph) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """folder -> imported folder -> the (importer, imported) module pairs behind that arrow."""
    out: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for importer in g.modules:
        for imported in g.find_modules_directly_imported_by(importer):
            a, b = folder_of(importer), folder_of(imported)
            if a != b:
                out.setdefault(a, {}).setdefault(b, []).append((importer, imported))
    return out


def test_the_tools_see_every_folder_through_the_package():
    """A tool reading the tree resolves pdserve.cluster.queue.core and the arrows between
    folders, not unconnected folders."""
    g = graph()
    for folder in FOLDERS:
        assert f"{ROOT_PACKAGE}.{folder}" in g.modules, f"grimp does not see {folder}/ as {ROOT_PACKAGE}.{folder}"
    assert "pdserve.cluster.queue.core" in g.modules
    importers = g.find_modules_that_directly_import("pdserve.cluster.registry")
    assert len({folder_of(m) for m in importers} - {"cluster"}) >= 2, importers  # arrows from other folders


@pytest.mark.parametrize("folder", (*FOLDERS, ROOT_PACKAGE))
def test_the_layout_table_is_exactly_what_the_code_imports(folder):
    assert folder == ROOT_PACKAGE or (ROOT / folder).is_dir(), f"{folder}/ is in the layout table but missing"
    arrows = imports_by_folder(graph()).get(folder, {})
    used = set(arrows)
    listed = set(TABLE[folder])
    extra = {f: arrows[f][:3] for f in sorted(used - listed)}
    assert not extra, (f"{folder}/ imports folders its row in docs/architecture.md does not list (first "
                       f"imports of each): {extra}")
    assert not listed - used, (f"docs/architecture.md says {folder}/ imports {sorted(listed - used)}, which "
                               f"no module of it does: fix the row")


def test_nothing_imports_the_composition_root():
    """`pdserve` and its own modules (cli, launch, ...) are imported by nothing in a code
    folder (bench excepted: it drives the product as a user does)."""
    bad = sorted((a, b) for f, arrows in imports_by_folder(graph()).items() if f not in ("bench", ROOT_PACKAGE)
                 for a, b in arrows.get(ROOT_PACKAGE, []))
    assert not bad, f"the composition root is imported: {bad}"


def test_nothing_outside_bench_imports_bench():
    bad = sorted((a, b) for f, arrows in imports_by_folder(graph()).items() if f != "bench"
                 for a, b in arrows.get("bench", []))
    assert not any("bench" in row for row in TABLE.values())
    assert not bad, f"the product imports bench/: {bad}"


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` (first node repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(edges, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if color.get(nxt, BLACK) == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color.get(nxt) == WHITE and (found := visit(nxt)):
                return found
        stack.pop()
        color[node] = BLACK
        return None

    for start in sorted(edges):
        if color[start] == WHITE and (found := visit(start)):
            return found
    return None


def test_no_import_cycle_anywhere():
    """Between modules, as they run (function-level imports count; TYPE_CHECKING ones do not)."""
    g = graph(runtime_only=True)
    edges = {m: {i for i in g.find_modules_directly_imported_by(m) if i != m} for m in g.modules}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_table_has_no_cycle_and_names_only_folders():
    for folder, listed in TABLE.items():
        known = set(FOLDERS) | ({ROOT_PACKAGE} if folder == "bench" else set())
        assert listed <= known, f"{folder}/'s row names unknown folders {sorted(listed - known)}"
    assert find_cycle({f: set(v) - {ROOT_PACKAGE} for f, v in TABLE.items() if f != ROOT_PACKAGE}) is None


def test_every_folder_of_the_package_is_in_the_table_and_linked_at_the_top():
    """Each subpackage of pdserve/ has a row in the layout table, and the design card's name
    for it at the top of the checkout is a link to it (cluster -> pdserve/cluster)."""
    subpackages = {p.parent.name for p in (ROOT / ROOT_PACKAGE).glob("*/__init__.py")}
    assert subpackages == set(FOLDERS), f"pdserve/'s subpackages {sorted(subpackages)}, the table's {sorted(FOLDERS)}"
    for name in subpackages:
        link = ROOT / name
        assert link.is_symlink() and link.resolve() == (ROOT / ROOT_PACKAGE / name).resolve(), \
            f"{name} at the top must link pdserve/{name}"
    assert not [p for p in (ROOT / ROOT_PACKAGE).iterdir() if p.is_symlink()], "pdserve/ holds the code, no links"


# --- import-linter: the contracts `lint-imports` checks in .ci/run ----------------------------

def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def check(contract: dict, g: grimp.ImportGraph):
    from importlinter import configuration
    from importlinter.contracts.forbidden import ForbiddenContract
    from importlinter.contracts.independence import IndependenceContract
    from importlinter.contracts.layers import LayersContract

    configuration.configure()  # import-linter's own settings (its timer, its graph builder), as lint-imports does
    cls = {"layers": LayersContract, "independence": IndependenceContract, "forbidden": ForbiddenContract}
    options = {k: (v if isinstance(v, list) else [v] if k in ("containers", "modules", "source_modules",
               "forbidden_modules", "layers") else v) for k, v in contract.items() if k not in ("name", "type", "id")}
    return cls[contract["type"]](name=contract["name"], session_options={"root_packages": [ROOT_PACKAGE]},
                                 contract_options=options).check(g, verbose=False)


def test_the_import_linter_contracts_hold_and_follow_the_table():
    """Every contract holds on the real graph; the layers contract orders the folders as the
    table does (each folder's row names only folders below it)."""
    g = graph()
    for c in contracts():
        assert check(c, g).kept, f"import-linter contract {c['id']} broken (run lint-imports)"
    layers = next(c for c in contracts() if c["type"] == "layers")
    rank = {name.strip(): i for i, layer in enumerate(layers["layers"]) for name in re.split(r"[|:]", layer)}
    assert set(rank) == set(FOLDERS), f"the layers contract lists {sorted(rank)}, the table {sorted(FOLDERS)}"
    for folder in FOLDERS:
        for dep in TABLE[folder] - {ROOT_PACKAGE}:
            assert rank[dep] > rank[folder], f"{folder}/ imports {dep}/ but the layers contract has it above"


@pytest.mark.parametrize("importer,imported", [("pdserve.engine.scheduler", "pdserve.decode.worker"),
                                               ("pdserve.prefill.worker", "pdserve.decode.frontend"),
                                               ("pdserve.router.decide", "pdserve.cluster.registry")])
def test_a_planted_violation_breaks_a_contract(importer, imported):
    """The contracts can fail: one import added to the real graph (a layer reaching up, the
    two workers meeting, the pure router doing I/O) breaks at least one."""
    g = fresh_graph()
    g.add_import(importer=importer, imported=imported)
    broken = [c["id"] for c in contracts() if not check(c, g).kept]
    assert broken, f"no contract catches {importer} -> {imported}"


def unresolved_imports(root: Path, modules: set[str]) -> list[str]:
    """``FILE:LINE: MODULE`` for each import of a pdserve module (absolute, or relative inside
    the package; at any depth, in functions too) that names no module of the package. grimp
    drops such an import silently, and mypy does not see it in a module on its not-yet-clean
    list: a lazy import left behind by a move (``from .taskqueue import ...`` in launcher.py)
    would fail only when that code runs."""
    bad = []
    for path in sorted((root / ROOT_PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        package = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == ROOT_PACKAGE]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    names = [".".join(base + ([node.module] if node.module else []))]
                elif (node.module or "").split(".")[0] == ROOT_PACKAGE:
                    names = [node.module]
                else:
                    names = []
            else:
                continue
            bad += [f"{rel.as_posix()}:{node.lineno}: {n}" for n in names if n not in modules]
    return bad


def test_every_pdserve_import_names_a_module_that_exists():
    bad = unresolved_imports(ROOT, set(graph().modules))
    assert not bad, "imports of modules that do not exist:\n  " + "\n  ".join(bad)


def test_an_import_left_behind_by_a_move_is_found(tmp_path):
    (tmp_path / "pdserve" / "router").mkdir(parents=True)
    (tmp_path / "pdserve" / "launcher.py").write_text("def up():\n    from .taskqueue import get_or_create_queue\n")
    (tmp_path / "pdserve" / "router" / "a.py").write_text("import pdserve.router.b\nfrom pdserve.router import b\n"
                                                          "from . import b\n")
    assert unresolved_imports(tmp_path, {"pdserve", "pdserve.router", "pdserve.router.b"}) == [
        "pdserve/launcher.py:2: pdserve.taskqueue"]
