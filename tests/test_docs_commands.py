"""What the docs tell a reader to run exists on a fresh clone: every `pdserve SUBCOMMAND`,
`python bench/NAME.py` and `python -m pdserve.MODULE` named in README.md or docs/ answers
`--help`, and every JSON under docs/peer/ that a doc cites is there. A command renamed or
removed, or a cited run never committed, fails here instead of in a reader's terminal."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
TEXT = {p: p.read_text() for p in DOCS}

BENCH = re.compile(r"\bpython3? (bench/[A-Za-z0-9_]+\.py)")
MODULE = re.compile(r"\bpython3? -m (pdserve(?:\.[A-Za-z0-9_]+)+)")
PDSERVE = re.compile(r"`pdserve ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?")
PEER_JSON = re.compile(r"docs/peer/[A-Za-z0-9_./-]+\.json")


def _named(pattern) -> dict[str, str]:
    """match -> the first doc naming it (for the failure message)."""
    out: dict[str, str] = {}
    for path, text in TEXT.items():
        for m in pattern.finditer(text):
            out.setdefault(m.group(1) if pattern.groups == 1 else m.group(0), str(path.relative_to(REPO)))
    return out


def test_every_cited_peer_json_exists():
    cited = {}
    for path, text in TEXT.items():
        for m in PEER_JSON.finditer(text):
            cited.setdefault(m.group(0), str(path.relative_to(REPO)))
    assert cited, "no doc cites a docs/peer JSON: the pattern is stale"
    missing = {j: doc for j, doc in cited.items() if not (REPO / j).is_file()}
    assert not missing, f"cited but not committed: {missing}"
    for j in cited:  # and each parses: a truncated run is no evidence
        json.loads((REPO / j).read_text())


def _pdserve_commands() -> dict[tuple[str, ...], str]:
    out: dict[tuple[str, ...], str] = {}
    for path, text in TEXT.items():
        for m in PDSERVE.finditer(text):
            out.setdefault(tuple(w for w in m.groups() if w), str(path.relative_to(REPO)))
    return out


def _exit_code(argv: list[str]) -> int:
    from pdserve.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    return 0 if rc is None else rc


def test_every_pdserve_command_in_the_docs_answers_help(capsys):
    commands = _pdserve_commands()
    assert ("up",) in commands and ("topology", "check") in commands, "the pattern is stale"
    bad = {}
    for words, doc in sorted(commands.items()):
        # `pdserve gateway explain`: a subcommand, the pair must answer; `pdserve drain WORKER`
        # (a command without subcommands): the second word is its argument.
        argv = list(words) if len(words) == 1 or _subcommands(words[0]) else [words[0]]
        if _exit_code([*argv, "--help"]) != 0:
            bad[" ".join(words)] = doc
    capsys.readouterr()
    assert not bad, f"named in the docs, no such command (pdserve ... --help fails): {bad}"


def _subcommands(command: str) -> set[str]:
    """The subcommands of `pdserve COMMAND` (empty: it has none)."""
    import argparse

    from pdserve.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub = action.choices[command]
            return {name for a in sub._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}
    return set()


def test_every_bench_script_and_module_in_the_docs_answers_help():
    scripts, modules = _named(BENCH), _named(MODULE)
    assert "bench/chaos.py" in scripts, "the pattern is stale"
    missing = {s: doc for s, doc in scripts.items() if not (REPO / s).is_file()}
    assert not missing, f"named in the docs, no such file: {missing}"
    # One interpreter runs every --help (torch and friends imported once, not once per script).
    runner = (
        "import runpy, sys, io, contextlib\n"
        "bad = {}\n"
        "for kind, target in [tuple(a.split(':', 1)) for a in sys.argv[1:]]:\n"
        "    sys.argv = [target, '--help']\n"
        "    out = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            (runpy.run_path if kind == 'path' else runpy.run_module)(target, run_name='__main__')\n"
        "        bad[target] = 'did not exit'\n"
        "    except SystemExit as e:\n"
        "        if e.code not in (0, None): bad[target] = f'exit {e.code}'\n"
        "        elif 'usage' not in out.getvalue().lower(): bad[target] = 'no usage text'\n"
        "    except BaseException as e:\n"
        "        bad[target] = repr(e)[:300]\n"
        "print(repr(bad))\n")
    args = [f"path:{s}" for s in sorted(scripts)] + [f"module:{m}" for m in sorted(modules)]
    proc = subprocess.run([sys.executable, "-c", runner, *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    where = {**scripts, **modules}
    assert not bad, {t: (why, where[t]) for t, why in bad.items()}
