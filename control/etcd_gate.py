"""The etcd gate: workers reach etcd only through it, and it lets each do only its own part.

etcd's RBAC covers keys, not leases: any authenticated identity may keep alive, inspect or
grant any lease, and compact the store (measured on etcd 3.5; docs/security.md). A worker
that keeps a hung peer's lease alive keeps that peer in the registry. So with `etcd.gate` in
the topology the workers' etcd users get no permissions at all (etcd refuses them
everything directly) and the workers connect here instead, with the same certificates:

- **Who:** the client certificate's common name, checked against the topology's CA
  (mutual TLS): `worker/<cluster>/<id>` (one identity per worker slot) or `worker` (the
  shared worker identity, while the topology lists one). Any other name is refused.
- **Keys:** the same grants etcd would enforce for that identity (`etcd_auth.worker_grants`,
  `etcd_auth.grants`): read the cluster's prefix, write the worker's own record and NIXL
  metadata. Every request is checked before it is forwarded: ranges, puts, deletes, each
  compare and operation of a transaction (nested ones too), each watch it creates.
- **Leases:** a lease is the identity's own when it was granted through the gate by it, or
  when every key attached to it is one the identity may write (asked of etcd once, so a
  restarted gate knows its workers' leases again). Keep-alive, time-to-live and revoke of
  any other lease are refused; listing leases and compaction are refused to every worker.
  A put may attach only the identity's own lease. Live leases per identity are capped.
- **Upstream** the gate acts as the topology's `operator` identity; etcd's RBAC bounds it to
  the cluster's prefix, and the gate never forwards a compaction or an auth change.

A refusal is gRPC PERMISSION_DENIED with "permission denied" in its message, as etcd's own,
so a worker reports it as `EtcdAccessDenied` naming its identity. `pdserve etcd-gate` runs
it (the launcher starts one beside its embedded etcd); `EtcdGate` embeds it (tests). The rules
are etcd_gate_policy.py's, the gRPC server etcd_gate_server.py's; this module runs the gate
as a process.
"""

from __future__ import annotations

import asyncio
import logging

from .etcd_gate_policy import GatePolicy
from .etcd_gate_server import EtcdGate


# -- the gate as a process (`python -m pdserve.control.etcd_gate`; the launcher starts it) ----
def parse_workers(text: str) -> list[tuple[str, str]]:
    """"prefill:prefill-0,decode:decode-0" -> [(role, worker_id), ...]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        role, sep, worker_id = item.partition(":")
        if not sep or role not in ("prefill", "decode") or not worker_id:
            raise ValueError(f"--workers: {item!r} is not ROLE:WORKER_ID (ROLE prefill or decode)")
        out.append((role, worker_id))
    return out


def main(argv=None) -> int:
    import argparse
    import signal

    from .topology import load_topology

    p = argparse.ArgumentParser(prog="python -m pdserve.control.etcd_gate",
                                description="The etcd gate: workers reach etcd through it, each scoped to its own "
                                            "keys and leases (docs/security.md). `pdserve up` starts it when the "
                                            "topology sets etcd.gate.")
    p.add_argument("--topology", required=True, help="the topology file (etcd.tls: ca, server, operator)")
    p.add_argument("--upstream", required=True, help="etcd endpoint host:port")
    p.add_argument("--workers", default="", help="ROLE:WORKER_ID,... the worker slots with identities of their own")
    p.add_argument("--shared-worker", action="store_true", help="also serve the shared `worker` identity")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    topo = load_topology(args.topology)
    tls = topo.etcd.tls
    if tls is None or tls.server is None:
        p.error("the topology's etcd.tls needs ca and server (the gate's own certificate)")
    policy = GatePolicy(topo.cluster, parse_workers(args.workers), shared_worker=args.shared_worker)

    async def run() -> None:
        gate = await EtcdGate(policy, args.upstream, topo.etcd_tls("operator"),
                              server_cert=str(topo.resolve(tls.server.cert)), server_key=str(topo.resolve(tls.server.key)),
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
