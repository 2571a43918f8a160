"""Hosts as Linux network namespaces, for tests of what crosses a network.

`Network(["a", "b", "c"])` makes one namespace per host, each with loopback
and an ``eth0`` whose address lies in a private /24 chosen for this run
(10.x.y.0/24), all plugged into one bridge that lives in a namespace of its
own (the machine's own network is never touched). Everything it made is
deleted on exit, also when the test fails; namespaces that a crashed earlier
run left behind (their creator process is gone) are deleted at start.

Processes enter a host with `Host.cmd()` (``ip netns exec``) or, inside a
spawned Python child, with `enter_netns()` before they open any socket.
Namespaces share the filesystem (and /dev/shm): give each host its own temp
dirs, and make UCX use TCP on ``eth0`` so bytes really cross the link.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import subprocess
from dataclasses import dataclass

PREFIX = "pdt"  # every namespace this harness makes: pdt<pid>-<host>
CLONE_NEWNET = 0x40000000
# UCX settings that make a NIXL agent in a namespace host talk TCP over its eth0 (no shared
# memory or cross-memory-attach shortcut between processes that share one kernel).
TCP_UCX_ENV = {"UCX_MODULES": "^ib", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


def unavailable() -> str | None:
    """Why this machine cannot make test hosts (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete namespaces an earlier run of this harness left (its process is gone)."""
    removed = []
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def enter_netns(name: str) -> None:
    """Move the calling thread into namespace ``name`` (call first thing in a fresh process,
    before any other thread exists: threads started later inherit it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")


@dataclass
class Host:
    name: str  # the test's name for it ("a", "prefill", ...)
    netns: str  # the namespace
    addr: str  # its eth0 address
    peer_if: str  # the veth end on the bridge

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run(self.cmd(*argv), capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} -> {res.returncode}: {res.stderr.strip()[-2000:]}")
        return res

    def link_stats(self) -> dict[str, int]:
        """eth0's counters (rx_bytes, tx_bytes, ...) as the kernel keeps them."""
        out = _ip("-n", self.netns, "-s", "-j", "link", "show", "dev", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return {f"rx_{k}": v for k, v in stats["rx"].items()} | {f"tx_{k}": v for k, v in stats["tx"].items()}

    def link(self, up: bool) -> None:
        """Bring this host's link to the bridge down (a cable pulled) or up again."""
        _ip("-n", self.netns, "link", "set", "eth0", "up" if up else "down")

    def kill_all(self) -> list[int]:
        """SIGKILL every process living in this host (``ip netns pids``): what a test started
        there, daemons included (Ray, sshd), and nothing outside it."""
        out = _ip("netns", "pids", self.netns, check=False).stdout.split()
        pids = [int(p) for p in out if p.isdigit() and int(p) != os.getpid()]
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        return pids

    def start_sshd(self, keys: "SshKeys") -> subprocess.Popen:
        """An sshd for this host only (listening on its address), letting ``keys`` in as root."""
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.path.exists(sshd):
            raise RuntimeError("sshd is not installed (Debian package openssh-server; .ci/run installs it)")
        os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory
        opts = {"ListenAddress": self.addr, "Port": "22", "HostKey": keys.host_key,
                "AuthorizedKeysFile": keys.authorized, "PermitRootLogin": "prohibit-password",
                "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no", "UsePAM": "no",
                "StrictModes": "no", "PidFile": os.path.join(keys.dir, f"sshd-{self.name}.pid"),
                "LogLevel": "ERROR", "MaxStartups": "100", "MaxSessions": "100"}
        argv = [sshd, "-D", "-e", "-f", "/dev/null"] + [a for k, v in opts.items() for a in ("-o", f"{k}={v}")]
        return subprocess.Popen(self.cmd(*argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def limit_rate(self, mbit: float | None) -> None:
        """Shape what this host sends to ``mbit`` Mbit/s (tc tbf); None removes the limit.
        (This kernel has no sch_netem, so latency cannot be added; a slower link can.)"""
        base = ["tc", "qdisc"]
        if mbit is None:
            self.run(*base, "del", "dev", "eth0", "root", check=False)
        else:
            self.run(*base, "replace", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit",
                     "burst", "64kb", "latency", "400ms")


class SshKeys:
    """A throw-away SSH key pair (client) and host key in ``dir``, for sshd in test hosts."""

    def __init__(self, dir: str):
        self.dir = dir
        self.private = os.path.join(dir, "id_ed25519")
        self.host_key = os.path.join(dir, "host_ed25519")
        self.authorized = os.path.join(dir, "authorized_keys")
        for path in (self.private, self.host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True, timeout=30)
        shutil.copy(self.private + ".pub", self.authorized)


class Network:
    """N hosts on one private /24 behind a bridge (see the module docstring)."""

    def __init__(self, hosts: list[str], subnet: str | None = None):
        if len(set(hosts)) != len(hosts) or not 0 < len(hosts) < 250:
            raise ValueError(f"host names must be distinct, 1..249 of them: {hosts}")
        rng = random.Random()
        self.subnet = subnet or f"10.{rng.randrange(200, 250)}.{rng.randrange(0, 256)}"
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._names = hosts
        self._made: list[str] = []

    def __enter__(self) -> "Network":
        remove_leftovers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        suffix = f"{os.getpid() % 100000}"
        for i, name in enumerate(self._names):
            ns = f"{self.tag}-{name}"
            self._netns(ns)
            host_if, peer_if = f"h{suffix}x{i}"[:15], f"s{suffix}x{i}"[:15]
            # Made in the host's namespace: nothing is ever created in the machine's own.
            _ip("-n", ns, "link", "add", host_if, "type", "veth", "peer", "name", peer_if, "netns", self.switch)
            _ip("-n", ns, "link", "set", host_if, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", peer_if, "master", "br0")
            _ip("-n", self.switch, "link", "set", peer_if, "up")
            self.hosts[name] = Host(name, ns, f"{self.subnet}.{i + 1}", peer_if)

    def close(self) -> None:
        """Kill what runs in the hosts, then delete every namespace made (their veth pairs go
        with them)."""
        for host in self.hosts.values():
            host.kill_all()
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
