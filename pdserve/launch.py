"""`pdserve up | status | down | drain | demo`: run a topology and talk to it.

This lives in the composition root because `up` may make the `auto` model
with the engine's model maker, which the control plane must not import
(`engine.model_maker.resolve_model`, which the benchmarks use too: nothing in
the product imports bench/).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from pdserve.status_cmd import status
from pdserve.topology_args import add_topology_arg, load_topology_arg


def register(subparsers) -> None:
    up = subparsers.add_parser(
        "up", help="start a topology: etcd, Ray, prefill queue, prefill and decode workers",
        description=(
            "Start the deployment a topology file describes and wait until every worker is "
            "registered and healthy, then print the endpoints. With no arguments: the local "
            "default, 1P1D on CPU with a small model made on first run. Ray is joined with "
            "--ray-address, else a Ray head is started for this cluster; etcd is started when "
            "the topology names no endpoint. `pdserve down` stops what `up` started."))
    add_topology_arg(up)
    up.add_argument("--ray-address", default=None, help="join this Ray cluster (host:port) instead of starting one")
    up.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the cluster")
    up.set_defaults(func=_up)

    st = subparsers.add_parser("status", help="show members, roles, load and queue depth of a running topology")
    add_topology_arg(st)
    st.add_argument("--json", action="store_true", help="print machine-readable JSON")
    st.set_defaults(func=status)

    down = subparsers.add_parser("down", help="stop everything `pdserve up` started for a topology")
    add_topology_arg(down)
    down.set_defaults(func=_down)

    dr = subparsers.add_parser(
        "drain", help="drain one worker: it takes no new work, finishes what it holds, and leaves",
        description=("Write the worker's drain key in etcd and revoke its lease: peers stop sending it "
                     "work at once; the worker finishes in-flight requests or prefill tasks, deregisters "
                     "and stays out (it does not re-register as after an ordinary lease loss)."))
    dr.add_argument("worker_id", help="e.g. prefill-0 (see `pdserve status`), or a pod's name")
    add_topology_arg(dr)
    dr.add_argument("--etcd", default=None, metavar="ENDPOINTS",
                    help="etcd endpoints host:port[,host:port]; with --cluster, drain without `pdserve up`'s "
                         "state file (a Kubernetes preStop hook)")
    dr.add_argument("--cluster", default=None, help="the topology's cluster name (with --etcd)")
    dr.add_argument("--check", action="store_true", help="validate the arguments and exit; drain nothing")
    dr.set_defaults(func=_drain)

    demo = subparsers.add_parser(
        "demo", help="send a mix of short and long prompts to a running topology and show each route",
        description=("Send short chat-like and long document-like prompts concurrently through the "
                     "gRPC API of the first decode worker, then print for each the route taken and why, "
                     "TTFT, KV transfer bytes and time, and the completion."))
    add_topology_arg(demo)
    demo.add_argument("--target", default=None, help="gRPC host:port (default: from the running topology)")
    demo.add_argument("--route", choices=["auto", "local", "remote"], default="auto")
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.add_argument("--long-tokens", type=int, default=1200, help="approximate length of the long prompts")
    demo.set_defaults(func=_demo)


def _up(args) -> int:
    from pdserve.engine.model_maker import resolve_model
    from pdserve.launcher import Launcher

    topo = load_topology_arg(args.topology)  # the launcher sets Ray's authentication from it (ray.auth)
    t0 = time.monotonic()
    model = resolve_model(topo)
    autoscale = _autoscale_policy(topo)
    max_replicas = {r: getattr(autoscale.autoscale, r).max_replicas for r in ("prefill", "decode")} if autoscale else None
    launcher = Launcher(topo, args.topology, model, ray_address=args.ray_address,
                        progress=lambda line: print(line, flush=True), max_replicas=max_replicas,
                        flexible=bool(autoscale and autoscale.autoscale.allow_role_flip))
    state = launcher.up()
    if autoscale is not None:
        _start_planner(topo, args.topology, state, launcher)
    print(f"\ncluster {state.cluster!r} is up in {time.monotonic() - t0:.1f} s; model {model}")
    scheme = "https" if topo.security is not None and topo.security.tls is not None else "http"
    for rec in state.decode_endpoints:
        print(f"  {rec['worker_id']}: gRPC {rec['grpc']}   HTTP {scheme}://{rec['http']}/v1/completions")
    print(f"\nnext: pdserve demo --topology {args.topology}   |   pdserve status   |   pdserve down")
    if args.foreground:
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            _down(args)
    return 0


def _autoscale_policy(topo):
    """The topology's autoscale policy, parsed (an invalid one stops `up` before it starts anything)."""
    if topo.autoscale_policy_path is None:
        return None
    from pdserve.cluster.planner.policy import load_autoscale_file

    return load_autoscale_file(topo.autoscale_policy_path)


def _start_planner(topo, topology_file: str, state, launcher) -> None:
    """Start the planner actor on this node (it reads the topology and policy files here)."""
    import ray

    from pdserve.cluster.planner.actor import PlannerConfig, start_planner_actor

    cfg = PlannerConfig(topology=os.path.abspath(topology_file), model=state.model,
                        etcd_endpoints=state.etcd_endpoints, worker_etcd_endpoints=state.gate_endpoints,
                        known_workers=[a["worker_id"] for a in state.actors])
    try:
        _, ref = start_planner_actor(cfg, topo.ray.namespace, topo.cluster, ray.util.get_node_ip_address())
        info = ray.get(ref, timeout=60)
    except BaseException:
        print("planner did not start; stopping the cluster", flush=True)
        from pdserve.state import state_path

        launcher.down(state)
        state_path(topo).unlink(missing_ok=True)
        raise
    print(f"planner   {info['planner']} started (policy {topo.autoscale_policy}; "
          f"`pdserve planner explain` shows its reasoning)", flush=True)


def _down(args) -> int:
    from pdserve.launcher import ClusterState, Launcher, state_path

    topo = load_topology_arg(args.topology)
    path = state_path(topo)
    state = ClusterState.load(path)
    Launcher(topo, args.topology, state.model, progress=lambda line: print(line, flush=True)).down(state)
    path.unlink(missing_ok=True)
    print(f"cluster {state.cluster!r} is down")
    return 0


def _drain_target(args):
    """(etcd endpoints, cluster, etcd TLS as the operator): from --etcd and --cluster, else
    from `up`'s state file. The TLS settings come from the topology (when its file exists)."""
    from pdserve.cluster.keys import check_name, parse_endpoints

    check_name("worker_id", args.worker_id)
    if (args.etcd is None) != (args.cluster is None):
        raise ValueError("--etcd and --cluster go together (or neither: read `pdserve up`'s state file)")
    if args.etcd is None:
        from pdserve.launcher import ClusterState, state_path

        topo = load_topology_arg(args.topology)
        state = ClusterState.load(state_path(topo))
        return state.etcd_endpoints, state.cluster, topo.etcd_tls("operator")
    endpoints = [e.strip() for e in args.etcd.split(",") if e.strip()]
    try:
        parse_endpoints(endpoints)
    except ValueError as exc:
        raise ValueError(f"--etcd {args.etcd!r}: {exc}") from None
    tls = load_topology_arg(args.topology).etcd_tls("operator") if Path(args.topology).is_file() else None
    return endpoints, check_name("--cluster", args.cluster), tls


def _drain(args) -> int:
    from pdserve.cluster.registry import Registry

    endpoints, cluster, tls = _drain_target(args)
    if args.check:
        print(f"OK: drain {args.worker_id} of cluster {cluster} (etcd {','.join(endpoints)}"
              f"{', TLS as ' + tls.identity if tls else ''})")
        return 0

    async def go() -> bool:
        async with Registry(endpoints, cluster, tls=tls) as reg:
            return await reg.request_drain(args.worker_id, f"pdserve drain at {time.ctime()}")

    if not asyncio.run(go()):
        print(f"{args.worker_id}: not registered (drain key written anyway: it drains if it comes back)")
        return 1
    print(f"{args.worker_id}: draining (it finishes in-flight work, then leaves the registry)")
    return 0


DEMO_SHORT = ["What is disaggregated serving?", "Say hello in French.", "Name three prime numbers.",
              "Why is the sky blue?"]
DEMO_DOC = ("Disaggregated serving splits the prefill phase, which is compute bound, from the decode "
            "phase, which is memory-bandwidth bound, so each runs on workers sized for it. ")


DEMO_SHORT_TOKENS = 64  # the demo's summary line calls prompts up to this long short


def _demo(args) -> int:
    from pdserve.api import AsyncClient

    target = args.target
    tls = {}  # with --target: the client's own settings (PDSERVE_CA_FILE, ...; docs/security.md)
    if target is None:
        from pdserve.cluster.security import internal_client_tls
        from pdserve.launcher import ClusterState, state_path

        topo = load_topology_arg(args.topology)
        state = ClusterState.load(state_path(topo))
        target = state.decode_endpoints[0]["grpc"]
        # The cluster's own workers: trust and present what the topology names (an API key,
        # if the workers need one, comes from PDSERVE_API_KEY: the topology holds only hashes).
        own = internal_client_tls(topo.security, topo.resolve)
        if own is not None:
            tls = {"tls": True, "ca_file": os.environ.get("PDSERVE_CA_FILE") or own.ca_file,
                   "client_cert": os.environ.get("PDSERVE_CLIENT_CERT") or own.cert_file,
                   "client_key": os.environ.get("PDSERVE_CLIENT_KEY") or own.key_file}
    n_rep = max(1, args.long_tokens // 30)
    prompts = DEMO_SHORT[:2] + [f"Document {i}: " + DEMO_DOC * n_rep + "Summarise it." for i in range(2)] + DEMO_SHORT[2:]
    # A long prompt sharing the first document's prefix: the prefix cache at work.
    prompts.append(prompts[2][:-len("Summarise it.")] + "List its key terms.")

    async def run():
        async with AsyncClient(target, timeout_s=300, **tls) as c:
            await c.list_models()
            return await asyncio.gather(*(c.generate(p, max_tokens=args.max_tokens, temperature=0.0,
                                                     ignore_eos=True, route=args.route) for p in prompts))

    t0 = time.monotonic()
    outs = asyncio.run(run())
    print(f"{len(prompts)} requests to {target} in {time.monotonic() - t0:.2f} s\n")
    for p, o in zip(prompts, outs):
        b = o.breakdown
        print(f"- prompt {b['prompt_tokens']} tokens ({b['cached_tokens']} cached): route {b['route'].upper()}"
              f"  TTFT {b['ttft_ms']:.0f} ms")
        print(f"    why: {b['reason']}")
        print(f"    predicted TTFT: local {b['predicted_ttft_local_ms']:.0f} ms, remote "
              f"{b['predicted_ttft_remote_ms']:.0f} ms; measured {b['ttft_ms']:.0f} ms on the {b['route']} route")
        if b["route"] == "remote":
            print(f"    transfer: {b['transfer_bytes'] / 1e6:.2f} MB in {b['transfer_ms']:.1f} ms from "
                  f"{b['prefill_worker']} (queue {b['queue_wait_ms']:.1f} ms, prefill {b['prefill_ms']:.1f} ms)")
        print(f"    completion ({len(o.token_ids)} tokens, {o.finish_reason}): {o.text[:80]!r}")
    routes = sorted({o.breakdown["route"] for o in outs})
    print(f"\nroutes used: {', '.join(routes)}")
    short = [o.breakdown["ttft_ms"] for o in outs if o.breakdown["prompt_tokens"] <= DEMO_SHORT_TOKENS]
    long_ = [o.breakdown["ttft_ms"] for o in outs if o.breakdown["prompt_tokens"] > DEMO_SHORT_TOKENS]
    if short and long_:
        # A decode worker chunks its local prefills (engine/step_plan.py), so short prompts
        # do not wait behind a long one.
        print(f"TTFT: short prompts (<= {DEMO_SHORT_TOKENS} tokens) max {max(short):.0f} ms; long prompts "
              f"{', '.join(f'{t:.0f}' for t in sorted(long_))} ms, all sent at once")
    return 0
