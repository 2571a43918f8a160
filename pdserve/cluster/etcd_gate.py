"""The etcd gate: workers and readers reach etcd only through it, and it lets each do only its own part.

etcd's RBAC covers keys, not leases: any authenticated identity may keep alive, inspect or
grant any lease, and compact the store (measured on etcd 3.5; docs/security.md). A worker
(or a gateway) that keeps a hung peer's lease alive keeps that peer in the registry. So with
`etcd.gate` in the topology the workers' etcd users and the `reader` get no permissions on
the cluster at all (etcd refuses them everything directly) and they connect here instead,
with the same certificates:

- **Who:** the client certificate's common name, checked against the topology's CA
  (mutual TLS): `worker/<cluster>/<id>` (one identity per worker slot), `worker` (the
  shared worker identity, while the topology lists one) or `reader` (gateways, the KV
  index: read and watch the cluster, nothing else). Any other name is refused.
- **Keys:** the same grants etcd would enforce for that identity (`etcd_auth.worker_grants`,
  `etcd_auth.grants`): read the cluster's prefix, write the worker's own record and NIXL
  metadata. Every request is checked before it is forwarded: ranges, puts, deletes, each
  compare and operation of a transaction (nested ones too), each watch it creates.
- **Leases:** a lease is the identity's own when it was granted through the gate by it, or
  when every key attached to it is one the identity may write (asked of etcd once, so a
  restarted gate knows its workers' leases again). Keep-alive, time-to-live and revoke of
  any other lease are refused; listing leases and compaction are refused to every identity.
  A put may attach only the identity's own lease. Live leases per identity are capped. The
  reader writes nothing, so it has no lease of its own: it may not grant one, and every
  other lease operation is refused to it.
- **Upstream** the gate acts as the topology's `operator` identity; etcd's RBAC bounds it to
  the cluster's prefix, and the gate never forwards a compaction or an auth change.

A refusal is gRPC PERMISSION_DENIED with "permission denied" in its message, as etcd's own,
so a worker reports it as `EtcdAccessDenied` naming its identity. `python -m
pdserve.cluster.etcd_gate` runs it; `--supervise` runs it under a supervisor that restarts
it, on the same port, whenever it exits (`pdserve up` starts it so, beside its embedded etcd:
`up` itself exits after start-up, so something long-lived must restart the gate, and `down`
stops the supervisor's process group, the gate with it). In the Helm chart Kubernetes
restarts it instead (a Deployment, probes on its port). `EtcdGate` embeds it (tests). The
rules are etcd_gate_policy.py's, the gRPC server etcd_gate_server.py's; this module runs the
gate as a process.
"""

from __future__ import annotations

import asyncio
import logging
import os

from pdserve.cluster.etcd_gate_policy import GatePolicy
from pdserve.cluster.etcd_gate_server import EtcdGate


# -- the gate as a process (`python -m pdserve.cluster.etcd_gate`; the launcher starts it) ----
# A gate that exits is started again after a backoff: doubling from RESTART_BACKOFF_S up to
# RESTART_BACKOFF_MAX_S while it keeps dying at once, back to the first once it ran
# HEALTHY_AFTER_S (a crash loop must not spin; a rare crash must not wait long).
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
HEALTHY_AFTER_S = 30.0

log = logging.getLogger("pdserve.cluster.etcd_gate")


def parse_workers(text: str) -> list[tuple[str, str]]:
    """"prefill:prefill-0,decode:decode-0" -> [(role, worker_id), ...]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        role, sep, worker_id = item.partition(":")
        if not sep or role not in ("prefill", "decode") or not worker_id:
            raise ValueError(f"--workers: {item!r} is not ROLE:WORKER_ID (ROLE prefill or decode)")
        out.append((role, worker_id))
    return out


def _die_with_parent() -> None:
    """In the gate's child process: SIGTERM it if the supervisor dies (even by SIGKILL), so a
    gate never outlives what restarts it and `down` stops."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: `down` still stops the process group
        pass


def supervise(child_argv: list[str], *, backoff_s: float = RESTART_BACKOFF_S,
              backoff_max_s: float = RESTART_BACKOFF_MAX_S, healthy_after_s: float = HEALTHY_AFTER_S) -> int:
    """Run `child_argv` (the gate), restarting it whenever it exits, until SIGTERM or SIGINT,
    which is passed on to it; then wait for it and return 0. Each restart is logged with the
    child's exit status. The child stays in this process's group, so signalling the group
    (`pdserve down`) reaches both."""
    import signal
    import subprocess
    import threading
    import time

    stop = threading.Event()
    child: subprocess.Popen | None = None

    def on_signal(signum, _frame) -> None:
        stop.set()
        if child is not None and child.returncode is None:
            try:
                os.kill(child.pid, signum)  # (a group signal reached it already: a repeat is harmless)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    delay, restarts = backoff_s, 0
    while not stop.is_set():
        started = time.monotonic()
        child = subprocess.Popen(child_argv, preexec_fn=_die_with_parent)
        if stop.is_set():  # the signal came while it was being started: it never saw it
            child.terminate()
        log.info("etcd gate started (pid %d%s)", child.pid, f", restart {restarts}" if restarts else "")
        rc = child.wait()
        if stop.is_set():
            break
        if time.monotonic() - started >= healthy_after_s:
            delay = backoff_s
        restarts += 1
        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        log.warning("etcd gate (pid %d) died (%s) after %.1f s; restarting it on the same port in %.1f s "
                    "(restart %d)", child.pid, how, time.monotonic() - started, delay, restarts)
        if stop.wait(delay):
            break
        delay = min(delay * 2, backoff_max_s)
    log.info("etcd gate supervisor stopping (%d restarts)", restarts)
    return 0


def main(argv=None) -> int:
    import argparse
    import signal
    import sys

    from pdserve.cluster.keys import parse_endpoints
    from pdserve.cluster.topology import TopologyError, load_topology

    p = argparse.ArgumentParser(prog="python -m pdserve.cluster.etcd_gate",
                                description="The etcd gate: workers and readers reach etcd through it, each scoped "
                                            "to its own keys and leases (docs/security.md). `pdserve up` starts it "
                                            "(supervised) when the topology sets etcd.gate.")
    p.add_argument("--topology", required=True, help="the topology file (etcd.tls: ca, server, operator)")
    p.add_argument("--upstream", required=True, help="etcd endpoint host:port")
    p.add_argument("--workers", default="", help="ROLE:WORKER_ID,... the worker slots with identities of their own")
    p.add_argument("--shared-worker", action="store_true", help="also serve the shared `worker` identity")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--supervise", action="store_true",
                   help="run the gate as a child process and restart it (same port) whenever it exits; needs --port")
    p.add_argument("--check", action="store_true", help="validate the arguments and the topology, serve nothing")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        workers = parse_workers(args.workers)
        parse_endpoints([args.upstream])
    except ValueError as exc:
        p.error(str(exc))
    if args.supervise and not args.port:
        p.error("--supervise needs --port: a restarted gate must listen where its clients reconnect")
    try:
        topo = load_topology(args.topology)
    except (TopologyError, OSError) as exc:
        p.error(f"--topology: {exc}")
    tls = topo.etcd.tls
    if tls is None or tls.server is None or tls.operator is None:
        p.error(f"{args.topology}: the gate needs etcd.tls with ca, server (the gate's own certificate) and "
                "operator (what it acts as towards etcd)")
    if args.check:
        print(f"etcd gate arguments OK: cluster {topo.cluster}, upstream {args.upstream}, {len(workers)} worker "
              f"identities{', the shared worker' if args.shared_worker else ''}, the reader")
        return 0
    if args.supervise:
        child = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--supervise"]
        return supervise([sys.executable, "-m", "pdserve.cluster.etcd_gate", *child])
    policy = GatePolicy(topo.cluster, workers, shared_worker=args.shared_worker)
    server = tls.server  # checked above

    async def run() -> None:
        operator = topo.etcd_tls("operator")
        if operator is None:  # etcd.tls is set (checked above): etcd_tls gives None only without it
            raise RuntimeError("etcd.tls is not set: the gate has no operator identity to reach etcd as")
        gate = await EtcdGate(policy, args.upstream, operator,
                              server_cert=str(topo.resolve(server.cert)), server_key=str(topo.resolve(server.key)),
                              ca_file=str(topo.resolve(tls.ca)), host=args.host, port=args.port).start()
        print(f"etcd gate serving on {gate.endpoint}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await gate.stop()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
