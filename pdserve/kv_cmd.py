"""`pdserve kv ...`: the cluster's KV index (cluster/kvindex/service.py).

    pdserve kv index --topology FILE        run the index of a running cluster (foreground)
    pdserve kv index --etcd HOST:PORT --cluster NAME
    pdserve kv status --url URL             per worker: blocks held by tier, the subscription
    pdserve kv status --topology FILE       the index `pdserve up` started (kv_index.enabled)
    pdserve kv explain --url URL --prompt TEXT --model DIR   who holds this prompt's prefix
    pdserve kv explain --url URL --token-ids 1,2,3

Workers publish KV events when their engine arguments say ``kv_events: true``.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from .topology_args import add_topology_arg, load_topology_arg

if TYPE_CHECKING:
    from pdserve.cluster.etcd_auth import EtcdTLS

HTTP_TIMEOUT_S = 10.0


def register(subparsers) -> None:
    kv = subparsers.add_parser("kv", help="the cluster's KV index: run it, its status, who holds a prompt's prefix",
                               description=__doc__, formatter_class=_raw())
    sub = kv.add_subparsers(dest="kv_command", metavar="KV_COMMAND")
    p = sub.add_parser("index", help="run the KV index of a cluster (until Ctrl-C)",
                       description="Follow every worker that publishes KV events (engine arg kv_events: true; "
                                   "its etcd record lists them) and answer over HTTP: GET /status, "
                                   "POST /explain {token_ids}, GET /metrics.")
    add_topology_arg(p)
    p.add_argument("--etcd", help="etcd HOST:PORT[,HOST:PORT] (default: the cluster `pdserve up` started)")
    p.add_argument("--cluster", help="cluster name (default: the topology's)")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="HTTP port (default 0: a free one, printed)")
    p.add_argument("--check", action="store_true", help="validate the arguments and exit; start nothing")
    p.set_defaults(func=run_index)
    p = sub.add_parser("status", help="per worker: KV blocks held by tier, and how its events are followed")
    _add_url_args(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(func=status)
    p = sub.add_parser("explain", help="each worker's cached prefix of a prompt, longest first")
    _add_url_args(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text (tokenized with --model's tokenizer)")
    what.add_argument("--token-ids", help="comma-separated token ids")
    p.add_argument("--model", help="model directory whose tokenizer encodes --prompt")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(func=explain)
    kv.set_defaults(func=lambda args: (kv.print_help(), 2)[1])


def _add_url_args(p) -> None:
    p.add_argument("--url", help="the index's address, as `pdserve kv index` printed it (default: the index "
                   "`pdserve up` started for --topology, with kv_index.enabled)")
    add_topology_arg(p)


def index_url(args) -> str:
    """--url, or the KV index in the state file of the cluster `pdserve up` started for --topology."""
    if args.url:
        return args.url
    from pdserve.launcher import ClusterState, state_path

    topo = load_topology_arg(args.topology)
    path = state_path(topo)
    if not path.is_file():
        raise ValueError(f"--topology {args.topology}: no running cluster (no state file {path}); start it with "
                         "`pdserve up`, or pass --url")
    state = ClusterState.load(path)
    rec = next((a for a in state.actors if a.get("role") == "kv-index" and a.get("url")), None)
    if rec is None:
        raise ValueError(f"cluster {state.cluster} runs no KV index: set `kv_index: {{enabled: true}}` in "
                         f"{args.topology} and restart it, or run `pdserve kv index` and pass its --url")
    return rec["url"]


def _raw():
    import argparse

    return argparse.RawDescriptionHelpFormatter


def run_index(args) -> int:
    from pdserve.cluster.kvindex.service import KVIndexService

    etcd, cluster, tls = _cluster_of(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: a port is 0-65535 (0: a free one)")
    if args.check:
        from pdserve.cluster.keys import parse_endpoints

        parse_endpoints(etcd)
        who = f", etcd identity {tls.identity}" if tls is not None else ""
        print(f"kv index arguments OK: cluster {cluster}, etcd {', '.join(etcd)}{who}")
        return 0

    async def serve():
        svc = await KVIndexService(etcd, cluster, args.host, args.port, tls=tls).start()
        print(f"KV index of cluster {cluster} (etcd {', '.join(etcd)}): {svc.url}", flush=True)
        print(f"  pdserve kv status --url {svc.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await svc.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


def _cluster_of(args) -> tuple[list[str], str, EtcdTLS | None]:
    """(etcd endpoints, cluster, etcd TLS): --etcd and --cluster, else the cluster `pdserve up`
    started from --topology. The etcd identity is the topology's either way (a follower's:
    `reader`, else `operator`, else `worker`), so a pod passes --etcd with its own topology."""
    from pdserve.cluster.etcd_auth import FOLLOWER_IDENTITIES

    topo = load_topology_arg(args.topology)
    tls = topo.etcd_tls(*FOLLOWER_IDENTITIES)
    if args.etcd:
        if not args.cluster:
            raise ValueError("--etcd needs --cluster (the cluster's name)")
        return [e.strip() for e in args.etcd.split(",") if e.strip()], args.cluster, tls
    from pdserve.launcher import ClusterState, state_path

    state = ClusterState.load(state_path(topo))
    # Through the etcd gate when the cluster has one (it serves the reader; etcd grants it nothing).
    return state.follower_etcd_endpoints(tls.identity if tls is not None else None), args.cluster or state.cluster, tls


def _call(url: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url.rstrip("/") + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise ValueError(f"the KV index answered {exc.code}: {json.loads(exc.read()).get('error')}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"--url {url}: the KV index did not answer ({exc}); is `pdserve kv index` running?") from exc


def status(args) -> int:
    st = _call(index_url(args), "/status")
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"cluster {st['cluster']}: {st['blocks']} distinct blocks of {st['block_size']} tokens, "
          f"{st['queries']} prefix queries answered")
    print(f"{'worker':<24} {'blocks':>8}  {'by tier':<24} {'synced':<7} {'gaps':>5} {'replayed':>8} {'snapshots':>9}")
    for wid, w in st["workers"].items():
        tiers = ", ".join(f"{m} {n}" for m, n in sorted(w["by_medium"].items())) or "-"
        print(f"{wid:<24} {w['blocks']:>8}  {tiers:<24} {'yes' if w['synced'] else 'NO':<7} {w['gaps']:>5} "
              f"{w['replayed']:>8} {w['snapshots']:>9}")
    for wid, why in st.get("not_followed", {}).items():
        print(f"{wid}: not followed: {why}")
    return 0


def explain(args) -> int:
    if args.prompt is not None:
        if not args.model:
            raise ValueError("--prompt needs --model (the tokenizer that encodes it); or pass --token-ids")
        from pdserve.engine.tokenizer import Tokenizer

        tokens = Tokenizer(args.model).encode(args.prompt)
    else:
        try:
            tokens = [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError as exc:
            raise ValueError(f"--token-ids {args.token_ids!r}: comma-separated integers") from exc
    ans = _call(index_url(args), "/explain", {"token_ids": tokens})
    if args.json:
        print(json.dumps(ans, indent=2))
        return 0
    if not ans.get("workers"):
        print(ans.get("note", "no worker publishes KV events"))
        return 0
    print(f"prompt: {ans['prompt_tokens']} tokens = {ans['blocks']} full blocks of {ans['block_size']}")
    for w in ans["workers"]:
        tiers = ", ".join(f"{m} {n}" for m, n in sorted(w["by_medium"].items())) or "-"
        print(f"  {w['worker_id']:<24} {w['cached_blocks']:>5} blocks cached ({w['cached_tokens']} tokens; {tiers})")
    return 0
