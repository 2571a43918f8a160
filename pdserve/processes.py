"""The processes `pdserve up` starts itself (etcd, the etcd gate, a Ray head): waiting for their
ports, and stopping them (SIGTERM to the process group, SIGKILL after a timeout)."""

from __future__ import annotations

import os
import signal
import time


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port now."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def terminate_group(pid: int, what: str, progress, own_group: bool = True, timeout_s: float = 20.0,
                     leader_first: bool = False) -> None:
    """SIGTERM (the process group when it leads one), then SIGKILL after a timeout.

    `leader_first`: SIGTERM the leader alone first and give it the timeout to stop its own
    children (`ray start --block` stops its node in ~2 s on SIGTERM, but hangs when its
    children are signalled at the same moment), then the group for whatever is left."""
    if leader_first and own_group:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if wait_gone(pid, timeout_s):
            try:  # leftovers of the group get a short grace (until they are gone), then SIGKILL
                os.killpg(pid, signal.SIGTERM)
                if not wait_group_gone(pid, 0.5):
                    os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            progress(f"{what:<9} stopped (pid {pid})")
            return
    kill = os.killpg if own_group else os.kill
    try:
        kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not wait_gone(pid, timeout_s):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    progress(f"{what:<9} stopped (pid {pid})")


def wait_gone(pid: int, timeout_s: float) -> bool:
    """True once `pid` has exited (or is a zombie) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if is_zombie(pid):
                return True
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """True once no live (non-zombie) process is left in process group `pgid` within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (Linux /proc; zombies do not count)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def is_zombie(pid: int) -> bool:
    """Whether `pid` has exited and waits to be reaped (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False
