"""The host's scheduler settings a benchmark on a shared box must control: autogroups.

With ``kernel.sched_autogroup_enabled = 1`` (the default of many desktop and VM kernels), the
CFS scheduler shares the CPUs between *sessions* first (each ``setsid`` makes an autogroup),
then between the tasks of each session; a task's niceness counts only inside its session.
Ray starts its raylet, GCS and every actor (pdserve's workers) in a session of their own, so
on a box where the benchmark client shares the cores with a cluster started through Ray, the
client and the workers are scheduled as two groups. Measured here (2 vCPUs, 2P2D behind
`bench/prefix_cluster.py`, `python bench/lag_probe.py --why` beside it): with autogroups on, a
process that only sleeps 20 ms woke up to 1.3 s late while both CPUs ran user code (no steal,
no I/O), and the client's TTFT p90 was 1,754 ms where the workers measured 290 ms; with them
off, the same probe was never more than 22 ms late and the client's p90 was the workers'.
A server host does not schedule this way (systemd services and containers sit in CPU
cgroups, which autogroups do not apply to), and a peer started as one plain process tree
(``vllm serve``) is not split from its client at all, so a side-by-side run on such a box
compares the scheduler's grouping, not the servers.

``autogroups_off`` turns them off for a benchmark's run (root only) and restores the setting
after it, also on an exception or a SIGTERM; ``--autogroups keep`` leaves the host as it is.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def add_autogroup_option(parser, both: bool = False) -> None:
    """``--autogroups off|keep`` (``both`` adds the choice 'both': the whole run twice, off then kept)."""
    parser.add_argument("--autogroups", choices=("off", "keep", "both") if both else ("off", "keep"), default="off",
                        help="the kernel's session autogroups during the run: 'off' (default; root only, "
                             "restored after) so the client and a Ray-started cluster are scheduled as tasks, "
                             "not as two sessions (bench/host.py); 'keep' leaves the host's setting"
                             + ("; 'both' runs everything twice, off then kept, and reports the two" if both else ""))


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def autogroups_off(mode: str = "off", log=print, path: Path = AUTOGROUP):
    """Yields what the run had: ``{"autogroups": "on"|"off"|"n/a", "changed": bool}``."""
    try:
        before = path.read_text().strip()
    except OSError:
        yield {"autogroups": "n/a", "changed": False}
        return
    state = {"autogroups": "off" if before == "0" else "on", "changed": False}
    if mode != "off" or before == "0":
        if before != "0":
            log(f"note: scheduler autogroups are on ({path}); the client and a Ray-started cluster are "
                "scheduled as separate sessions (bench/host.py); --autogroups off turns them off for the run")
        yield state
        return
    try:
        path.write_text("0\n")
    except OSError as exc:
        log(f"note: could not turn scheduler autogroups off ({exc.__class__.__name__}: {exc}); "
            "run as root, or set kernel.sched_autogroup_enabled=0 yourself")
        yield state
        return
    log(f"scheduler autogroups off for this run ({path} 1 -> 0; restored after)")
    state.update(autogroups="off", changed=True)
    # A run stopped with SIGTERM (`kill`, a CI timeout) restores them too: the signal ends the
    # run as SystemExit, through the finally below (the main thread only can take signals).
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        yield state
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        try:
            path.write_text(before + "\n")
        except OSError as exc:  # pragma: no cover - the file was writable a moment ago
            log(f"warning: could not restore {path} to {before}: {exc}")
