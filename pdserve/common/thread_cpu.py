"""CPU time of this process by thread: where a worker's cores go (Linux).

A worker runs its event loop (HTTP, gRPC, streaming; the main thread), its engine thread and
pools (tokenizers, grammar compilers), and native threads no Python code names (the OpenMP
workers of the engine's forward pass, gRPC's pollers). Whether the API side competes with the
step for the cores is read here, under load, instead of guessed: ``pdserve_thread_cpu_seconds
{thread=...}`` on ``/metrics`` (user + system time from ``/proc/self/task/*/stat``).

Threads are grouped by their Python name without a pool's ``_<n>`` suffix (``pdserve-engine``,
``MainThread``, ``pdserve-tokenize``, ``grammar``); a thread Python does not know is ``native``.
A thread that ended keeps its time in its group (the counter never goes back); what it ran
after the last read before it ended is not counted.
"""

from __future__ import annotations

import os
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, Metric

NATIVE = "native"  # threads without a Python name: OpenMP workers, gRPC pollers, ...
_POOL_SUFFIX = re.compile(r"_\d+$")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def thread_group(name: str) -> str:
    """A thread's group: its name without a pool's ``_<n>`` suffix."""
    return _POOL_SUFFIX.sub("", name)


def task_cpu_seconds(task_dir: Path) -> float | None:
    """User + system CPU seconds of one thread (``/proc/<pid>/task/<tid>``); None once it ended."""
    try:
        stat = (task_dir / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the comm may hold spaces
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: fields 14 and 15 of stat


class ThreadCPU:
    """Cumulative CPU seconds per thread group of this process, monotonic across thread exits."""

    def __init__(self, proc: Path = Path("/proc/self")):
        self.proc = proc
        self._last: dict[int, tuple[str, float]] = {}  # tid -> (group, seconds at the last read)
        self._ended: defaultdict[str, float] = defaultdict(float)  # seconds of threads gone since

    def read(self) -> dict[str, float]:
        names = {t.native_id: thread_group(t.name) for t in threading.enumerate() if t.native_id is not None}
        now: dict[int, tuple[str, float]] = {}
        try:
            tasks = list((self.proc / "task").iterdir())
        except OSError:  # not Linux: nothing to report
            return {}
        for task in tasks:
            if not task.name.isdigit():
                continue
            secs = task_cpu_seconds(task)
            if secs is not None:
                tid = int(task.name)
                # a thread leaves threading.enumerate() before its task ends: it keeps the group it had
                group = names.get(tid) or (self._last[tid][0] if tid in self._last else NATIVE)
                now[tid] = (group, secs)
        for tid, (group, secs) in self._last.items():
            if tid not in now:
                self._ended[group] += secs
        self._last = now
        totals: defaultdict[str, float] = defaultdict(float, self._ended)
        for group, secs in now.values():
            totals[group] += secs
        return dict(totals)


class ThreadCPUCollector:
    """``pdserve_thread_cpu_seconds_total{thread}`` with a worker's labels, read at scrape time."""

    def __init__(self, labels: Mapping[str, str], source: ThreadCPU | None = None):
        self.labels = dict(labels)
        self.source = source or ThreadCPU()
        # Another process's groups, already named (a decode worker's engine core: "core/<group>")
        self._others: list[Callable[[], Mapping[str, float]]] = []

    def add_process(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Also report ``read()``'s groups (another process of the worker, read at each scrape)."""
        self._others.append(read)

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        groups = dict(self.source.read())
        for read in self._others:
            groups.update(read())
        for group, secs in sorted(groups.items()):
            family.add_metric([*self.labels.values(), group], secs)
        yield family

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(
            "pdserve_thread_cpu_seconds", "CPU time (user + system) of this process's threads, by thread "
            "(Python name without a pool's _<n>; 'native': OpenMP workers, gRPC pollers; 'core/...': the "
            "threads of a decode worker's engine-core process)",
            labels=[*self.labels, "thread"])
