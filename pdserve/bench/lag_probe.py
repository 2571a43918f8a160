"""How late a process wakes from short sleeps: a probe of host stalls beside a benchmark.

    python bench/lag_probe.py --seconds 200 --nice -10 &      # beside e.g. bench/prefix_cluster.py

It sleeps ``--sleep-ms`` in a loop and records every wake-up later than ``--report-ms``; at the
end it prints how many, the largest, and their times. A process that only sleeps needs
almost no CPU, so on an otherwise fair scheduler its lateness is the machine's (a host that
holds the guest's CPUs off, a run queue it cannot jump), not its own work.

``--why`` also reads the kernel's counters at every wake-up (``/proc/stat``, ``/proc/pressure``,
``/proc/vmstat``, ``/proc/loadavg``) and keeps, for each late one, what changed while it
slept: where the CPUs' time went (user, system, idle, iowait, irq, softirq, steal), the
pressure stalls, reclaim and compaction, and the runnable count. CPUs that were idle through a
stall point at timers or the host; CPUs busy in user time at a run queue; steal at the host.
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
    p.add_argument("--why", action="store_true",
                   help="keep what the kernel counted during each late wake-up (CPU time by kind, pressure, reclaim)")
    args = p.parse_args(argv)
    if args.nice and (args.nice > 0 or os.geteuid() == 0):
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    stalls: list[tuple] = []  # (wall time, ms late[, what the kernel counted meanwhile])
    end = time.monotonic() + args.seconds
    before = kernel_counters() if args.why else None
    while time.monotonic() < end:
        t = time.perf_counter()
        time.sleep(args.sleep_ms / 1e3)
        late = (time.perf_counter() - t) * 1e3 - args.sleep_ms
        after = kernel_counters() if args.why else None
        if late > args.report_ms:
            stalls.append((time.time(), late, changed(before, after)) if args.why else (time.time(), late))
        before = after
    worst = max((s[1] for s in stalls), default=0.0)
    print(f"{len(stalls)} wake-ups more than {args.report_ms:.0f} ms late in {args.seconds:.0f} s; "
          f"the worst {worst:.0f} ms")
    if args.why:
        for s in sorted(stalls, key=lambda s: -s[1])[:10]:
            print(f"  {s[1]:7.0f} ms late at {time.strftime('%H:%M:%S', time.localtime(s[0]))}: "
                  + ", ".join(f"{k} {v:g}" for k, v in s[2].items() if v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "stalls": stalls}, f)
    return 0


CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
VMSTAT = ("pgscan_direct", "pgscan_kswapd", "compact_stall", "pgmajfault", "thp_fault_alloc", "pgfault")


def kernel_counters() -> dict[str, float]:
    """The machine-wide counters a stall may show in (cumulative, ms or counts; Linux only)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/stat") as f:
            ticks = 1000.0 / os.sysconf("SC_CLK_TCK")
            for line in f:
                if line.startswith("cpu "):
                    vals = line.split()[1:1 + len(CPU_FIELDS)]
                    out.update({f"cpu_{k}_ms": float(v) * ticks for k, v in zip(CPU_FIELDS, vals)})
                elif line.startswith("ctxt "):
                    out["context_switches"] = float(line.split()[1])
        for what in ("cpu", "io", "memory"):
            with open(f"/proc/pressure/{what}") as f:
                for line in f:
                    kind, *fields = line.split()
                    total = dict(x.split("=") for x in fields)["total"]
                    out[f"pressure_{what}_{kind}_ms"] = float(total) / 1e3
        with open("/proc/vmstat") as f:
            for line in f:
                k, v = line.split()
                if k in VMSTAT:
                    out[k] = float(v)
        with open("/proc/loadavg") as f:
            out["runnable"] = float(f.read().split()[3].split("/")[0])
    except OSError:
        pass
    return out


def changed(before: dict | None, after: dict | None) -> dict[str, float]:
    """What the counters did between two readings (the runnable count as it is now)."""
    if not before or not after:
        return {}
    out = {k: round(after[k] - before.get(k, 0.0), 1) for k in after if k != "runnable"}
    out["runnable"] = after.get("runnable", 0.0)
    return out


if __name__ == "__main__":
    sys.exit(main())
