"""How many threads a process's share of the host's cores affords.

`transfer_threads` sizes a NIXL agent's posting threads (the topology's
``network.kv_transport.threads``; kvtransfer/nixl/agent.py `KVTransferAgent` num_threads): a
write of many descriptors is posted from that many threads, which pays only where each
thread has a core of its own.
"""

from __future__ import annotations

import os

MAX_TRANSFER_THREADS = 4


def transfer_threads(setting: int | str, ranks: int = 1) -> int:
    """NIXL posting threads for one of ``ranks`` agents sharing this process's cores:
    ``setting`` itself when a number; ``auto``: the cores each rank has (at most
    MAX_TRANSFER_THREADS), or 0 (post inline) when it has fewer than two, where a thread would
    only take turns with the caller on one core."""
    if setting != "auto":
        threads = int(setting)
        if threads < 0:
            raise ValueError(f"threads={setting!r}: use auto or a number >= 0")
        return threads
    cores = len(os.sched_getaffinity(0)) // max(1, ranks)
    return 0 if cores < 2 else min(cores, MAX_TRANSFER_THREADS)
