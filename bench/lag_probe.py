"""How late a process wakes from short sleeps: a probe of host stalls beside a benchmark.

    python bench/lag_probe.py --seconds 200 --nice -10 &      # beside e.g. bench/prefix_cluster.py

It sleeps ``--sleep-ms`` in a loop and records every wake-up later than ``--report-ms``; at the
end it prints how many, the largest, and their times. A process that only sleeps needs
almost no CPU, so on an otherwise fair scheduler its lateness is the machine's (a host that
holds the guest's CPUs off, a run queue it cannot jump), not its own work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=200.0, help="how long to probe")
    p.add_argument("--sleep-ms", type=float, default=20.0)
    p.add_argument("--report-ms", type=float, default=50.0, help="record wake-ups later than this")
    p.add_argument("--nice", type=int, default=-10, help="niceness (root only below 0; 0 leaves it)")
    p.add_argument("--json", default=None, help="also write the stalls here")
    args = p.parse_args(argv)
    if args.nice and (args.nice > 0 or os.geteuid() == 0):
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    stalls: list[tuple[float, float]] = []  # (wall time, ms late)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        time.sleep(args.sleep_ms / 1e3)
        late = (time.perf_counter() - t) * 1e3 - args.sleep_ms
        if late > args.report_ms:
            stalls.append((time.time(), late))
    worst = max((ms for _, ms in stalls), default=0.0)
    print(f"{len(stalls)} wake-ups more than {args.report_ms:.0f} ms late in {args.seconds:.0f} s; "
          f"the worst {worst:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "stalls": stalls}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
