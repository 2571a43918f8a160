"""Sum a py-spy profile (`py-spy record -f raw`: one folded stack and its sample count per
line) by function: where the host's time goes inside one frame of interest.

    python bench/profile_top.py runs/gpu-check/profile-graphs-b1.txt --within decode_step_ms --top 30

Only the samples whose stack passes through a frame whose name contains ``--within`` count
(default: all). Prints, per function (``name (file:line)`` as py-spy writes it, line numbers
dropped so a function's lines add up), its inclusive share (samples with it anywhere on the
stack) and its self share (samples where it is the innermost frame), largest first.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_LINENO = re.compile(r":\d+\)$")


def frame_name(frame: str) -> str:
    """``step (pdserve/engine/llm_engine.py:301)`` -> ``step (pdserve/engine/llm_engine.py)``."""
    return _LINENO.sub(")", frame.strip())


def summarize(lines, within: str | None) -> tuple[int, Counter, Counter]:
    """(samples counted, inclusive samples per function, self samples per function)."""
    total, inclusive, own = 0, Counter(), Counter()
    for raw in lines:
        m = _LINE.match(raw.rstrip("\n"))
        if m is None:
            continue
        frames = [frame_name(f) for f in m["stack"].split(";") if f]
        if within is not None:
            cut = next((i for i, f in enumerate(frames) if within in f), None)
            if cut is None:
                continue
            frames = frames[cut:]
        n = int(m["count"])
        total += n
        for name in set(frames):
            inclusive[name] += n
        if frames:
            own[frames[-1]] += n
    return total, inclusive, own


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/profile_top.py", description=__doc__.split("\n\n")[0])
    p.add_argument("profile", help="py-spy record -f raw output")
    p.add_argument("--within", default=None, help="count only stacks through a frame containing this")
    p.add_argument("--top", type=int, default=30, help="functions to list (default 30)")
    args = p.parse_args(argv)
    with open(args.profile) as f:
        total, inclusive, own = summarize(f, args.within)
    if total == 0:
        print(f"no samples{' within ' + repr(args.within) if args.within else ''} in {args.profile}", file=sys.stderr)
        return 1
    print(f"{total} samples{' within ' + repr(args.within) if args.within else ''}")
    print(f"{'incl %':>7} {'self %':>7}  function")
    for name, n in inclusive.most_common(args.top):
        print(f"{100 * n / total:7.1f} {100 * own[name] / total:7.1f}  {name}")
    print("\nlargest self time:")
    for name, n in own.most_common(min(15, args.top)):
        print(f"{100 * n / total:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
