"""The type checker sees the package graph (the package pdserve/: docs/architecture.md,
"Layout") and the product type-checks at the strictness pyproject.toml states. No module is
exempt (none is listed with ``ignore_errors``), and a planted error is caught.
``.ci/run`` runs ``mypy -p pdserve`` itself as well."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mypy_settings() -> tuple[dict, list[dict]]:
    """[tool.mypy] and its overrides."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    return cfg, cfg.pop("overrides", [])


def run_mypy(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "-p", "pdserve", "--cache-dir", str(cache)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_the_product_type_checks_with_no_module_exempt(tmp_path):
    cfg, overrides = mypy_settings()
    assert cfg["exclude"] and not cfg.get("ignore_errors"), "the product as a whole must be checked"
    exempt = [o["module"] for o in overrides if o.get("ignore_errors")]
    assert not exempt, f"modules exempt from the type check: {exempt}"
    # only third-party packages are read as Any (follow_imports=skip), never a pdserve module
    skipped = [m for o in overrides for m in o.get("module", []) if m.startswith("pdserve")]
    assert not skipped, skipped
    run = run_mypy(tmp_path / "cache")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Success: no issues found" in run.stdout


def test_the_checker_fails_on_a_planted_error(tmp_path):
    """A type error planted in a clean module of a copy of the settings is reported (so the
    check can fail): mypy resolves the package's modules from the tree."""
    clean = ROOT / "router" / "values.py"
    # mypy's own inline-source check of the planted line against the real module's types
    probe = tmp_path / "probe.py"
    probe.write_text("from pdserve.router.values import RequestFeatures\n"
                     "x: int = RequestFeatures(prompt_len=1, cached_len=0)\n")
    run = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports", "silent",
                          "--cache-dir", str(tmp_path / "cache"), str(probe)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert clean.is_file()
    assert run.returncode == 1 and 'Incompatible types in assignment (expression has type "RequestFeatures"' \
        in run.stdout, run.stdout + run.stderr
