"""Print the failed and errored tests of a pytest JUnit XML report, one line each.

Where the report is missing (the process was killed before writing it), the last lines of the
run's log are printed instead.

`make test` runs the suite in two pytest processes; the first half's failures would scroll out of
a log's tail behind the second half, so the Makefile prints them again from this report.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def failures(path: str) -> list[str]:
    """`KIND nodeid: first line of the message` for each failed or errored test case."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return [f"(no report at {path}: {exc})"]
    lines = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            for node in case.findall(kind):
                name = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
                message = (node.get("message") or "").strip().splitlines()
                lines.append(f"{kind.upper()} {name}: {message[0][:300] if message else ''}")
                if len(lines) < 100:  # the first few with the end of their traceback, then a line each
                    lines.extend("    " + text for text in (node.text or "").splitlines()[-30:])
    return lines


def log_tail(path: str, lines: int = 80) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-lines:]
    except OSError as exc:
        return [f"(no log at {path}: {exc})"]


STRAY_MARK = "left running by the test suite"  # tests/conftest.py's message


def stray_processes(lines: list[str]) -> list[str]:
    """The conftest's report of processes the suite left behind (a passing run it fails): it is
    printed before pytest's summary and the slowest durations, out of a short tail's sight."""
    for i, line in enumerate(lines):
        if STRAY_MARK in line:
            block = [line]
            block.extend(s for s in lines[i + 1:i + 40] if s.startswith("  pid "))
            return block
    return []


def main(argv: list[str]) -> int:
    found = failures(argv[1])
    for line in found:
        print(line)
    if len(argv) > 2:
        for line in stray_processes(log_tail(argv[2], lines=10**6)):
            print(line)
    if len(argv) > 2 and (not found or found[0].startswith("(no report")):
        print(f"-- the last lines of {argv[2]}:")
        for line in log_tail(argv[2]):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
