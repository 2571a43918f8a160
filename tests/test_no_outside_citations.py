"""No tracked file cites a document a user of the repository does not have: the team's private
design notes (the upper-case policy, environment, style and architecture notes, and anything
under the shared design folder next to the checkout). The repository's own map,
docs/architecture.md (lower case), is fine to cite. docs/peer/ holds recorded results and is
left as recorded.

The patterns are assembled from pieces so that this file does not match them itself."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_PREFIXES = ("docs/peer/",)
_MD = r"\.md"
# Matched in any case: a lower-case spelling cites the same note.
ANY_CASE = re.compile("|".join(["POLICY" + _MD, "ENVIRONMENT" + _MD, "STYLE" + _MD,
                                "shared" + "/design", r"\.\./" + "shared"]), re.IGNORECASE)
# Matched as written: the lower-case docs/architecture.md is the repository's own.
EXACT_CASE = re.compile("ARCHITECTURE" + _MD)


def tracked_files(root: Path) -> list[str]:
    """The files git tracks under root, less the skipped folders."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                         check=True).stdout
    return [p for p in out.decode().split("\0") if p and not p.startswith(SKIPPED_PREFIXES)]


def outside_citations(root: Path, paths: list[str]) -> list[str]:
    """`path:line: text` for every line of the given files that cites a private note. Symlinks,
    folders, missing files and binary files (a NUL byte) are skipped."""
    found = []
    for rel in paths:
        path = root / rel
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if ANY_CASE.search(line) or EXACT_CASE.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs git and a git checkout")
def test_no_tracked_file_cites_a_private_note():
    found = outside_citations(ROOT, tracked_files(ROOT))
    assert not found, ("cite the repository's own docs instead (docs/router.md, docs/planner.md, "
                       "docs/architecture.md) or state the fact inline:\n" + "\n".join(found))


def test_a_citation_is_reported_with_its_file_and_line(tmp_path):
    note = "POLICY" + ".md"
    (tmp_path / "notes.md").write_text(
        "The layout is in docs/architecture.md.\n"
        f"Defaults follow {note.lower()} section 4.\n"
        "See " + "ARCHITECTURE" + ".md for the pool.\n"
        "Semantics: ../" + "shared/x.md\n")
    (tmp_path / "blob.bin").write_bytes(b"\0" + note.encode())
    found = outside_citations(tmp_path, ["notes.md", "blob.bin", "missing.md"])
    assert [f.split(": ", 1)[0] for f in found] == ["notes.md:2", "notes.md:3", "notes.md:4"]
