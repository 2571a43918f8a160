"""The type checker sees the package graph (the package pdserve/: docs/architecture.md,
"Layout") and the product type-checks at the strictness pyproject.toml states. The modules not
yet clean are listed there with ``ignore_errors``; this keeps the list exact: a module that
became clean must leave it, and a module outside it may not gain an error.
``.ci/run`` runs ``mypy -p pdserve`` itself as well."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mypy_settings() -> tuple[dict, list[dict], set[str]]:
    """[tool.mypy], its overrides but the not-yet-clean list, and that list."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    overrides = cfg.pop("overrides", [])
    pending = next(o for o in overrides if o.get("ignore_errors"))
    return cfg, [o for o in overrides if o is not pending], set(pending["module"])


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v) if not isinstance(v, str) else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_mypy(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "-p", "pdserve", "--config-file", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_the_product_type_checks_and_the_not_yet_clean_list_is_exact(tmp_path):
    cfg, overrides, pending = mypy_settings()
    assert cfg["exclude"] and not cfg.get("ignore_errors"), "the product as a whole must be checked"
    # the same settings without the not-yet-clean list: every module's errors
    lines = ["[tool.mypy]"] + [f"{k} = {toml_value(v)}" for k, v in cfg.items()]
    for o in overrides:
        lines += ["[[tool.mypy.overrides]]"] + [f"{k} = {toml_value(v)}" for k, v in o.items()]
    config = tmp_path / "mypy.toml"
    config.write_text("\n".join(lines) + "\n")
    run = run_mypy(config)
    assert "error: " in run.stdout or run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    failing = {m.group(1).replace("/", ".").removesuffix(".__init__")
               for m in re.finditer(r"^(pdserve/[\w/]+)\.py:\d+: error", run.stdout, re.M)}
    new = sorted(failing - pending)
    assert not new, ("type errors in modules that were clean (fix them; the list only shrinks):\n"
                     + "\n".join(line for line in run.stdout.splitlines()
                                 if any(line.startswith(m.replace(".", "/")) for m in new))[:4000])
    clean = sorted(pending - failing)
    assert not clean, f"now clean: remove from pyproject.toml's not-yet-clean list: {clean}"


def test_the_checker_fails_on_a_planted_error(tmp_path):
    """A type error planted in a clean module of a copy of the settings is reported (so the
    check can fail): mypy resolves the package's modules from the tree."""
    cfg, overrides, pending = mypy_settings()
    clean = ROOT / "router" / "values.py"
    assert "pdserve.router.values" not in pending
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
