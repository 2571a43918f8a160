"""common/thread_cpu.py: CPU seconds by thread group, read from /proc, kept across thread exits."""

import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.common.thread_cpu import NATIVE, ThreadCPU, ThreadCPUCollector, thread_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(1000))


def test_groups_strip_a_pools_number_only():
    assert thread_group("pdserve-tokenize_3") == "pdserve-tokenize"
    assert thread_group("pdserve-engine") == "pdserve-engine"
    assert thread_group("MainThread") == "MainThread"


def test_a_threads_cpu_is_counted_in_its_group_and_kept_after_it_ends():
    cpu = ThreadCPU()
    before = cpu.read().get("burner", 0.0)
    done = [threading.Event(), threading.Event()]
    stop = threading.Event()

    def work(i):
        _burn(0.3)
        done[i].set()
        stop.wait(10)

    pool = [threading.Thread(target=work, args=(i,), name=f"burner_{i}") for i in range(2)]
    for t in pool:
        t.start()
    assert all(d.wait(30) for d in done)
    during = cpu.read()["burner"] - before
    assert during >= 0.5  # two threads of 0.3 s each, tick-rounded, in one group
    stop.set()
    for t in pool:
        t.join(10)
    after = cpu.read().get("burner", 0.0) - before
    assert after >= during  # the ended threads' time stays in the group
    assert "MainThread" in cpu.read()


def test_the_collector_exports_the_groups_with_the_workers_labels():
    reg = CollectorRegistry()
    reg.register(ThreadCPUCollector({"worker_id": "w1"}))
    _burn(0.05)
    text = generate_latest(reg).decode()
    assert 'pdserve_thread_cpu_seconds_total{thread="MainThread",worker_id="w1"}' in text
    main = [line for line in text.splitlines() if 'thread="MainThread"' in line][0]
    assert float(main.rsplit(" ", 1)[1]) > 0
    assert NATIVE == "native"
