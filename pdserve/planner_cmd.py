"""`pdserve planner run | explain | history`: the autoscaling planner by hand, and why it
decides what it decides. The loop itself is cluster/planner/; `pdserve up` starts it as a
Ray actor when the topology names an `autoscale_policy`.

This lives in the composition root because it reads autoscale policy files with the
router package's parser, which the control plane does not import.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time

from pdserve.topology_args import add_topology_arg, load_topology_arg


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "planner", help="run the autoscaling planner, explain its decisions, show its history",
        description=("The planner scales prefill and decode workers from an autoscale policy "
                     "(configs/autoscale/*.yaml; threshold or SLA mode). `pdserve up` starts it when the "
                     "topology names autoscale_policy; `run` runs it in the foreground instead (one per "
                     "cluster: a second waits for the first to stop). `explain` samples the cluster now "
                     "and prints what it would decide and why; `history` prints recorded decisions."))
    sub = p.add_subparsers(dest="planner_command", metavar="SUBCOMMAND")

    run = sub.add_parser("run", help="run the planner in the foreground (Ctrl-C stops it)")
    add_topology_arg(run)
    run.add_argument("--policy", default=None, help="autoscale policy file (default: the topology's autoscale_policy)")
    run.add_argument("--dry-run", action="store_true", help="decide and record, but start or drain nothing")
    run.add_argument("--once", action="store_true", help="take one decision, print it and exit")
    run.set_defaults(func=_run)

    ex = sub.add_parser("explain", help="print what the planner would decide now, and every figure behind it")
    add_topology_arg(ex)
    ex.add_argument("--policy", default=None,
                    help="autoscale policy file (default: the one in etcd, else the topology's)")
    ex.add_argument("--sample-s", type=float, default=3.0,
                    help="seconds between the two snapshots rates are measured over (default 3)")
    ex.add_argument("--json", action="store_true", help="machine-readable output")
    ex.set_defaults(func=_explain)

    hist = sub.add_parser("history", help="print the planner's recorded decisions, oldest first")
    add_topology_arg(hist)
    hist.add_argument("-n", type=int, default=20, help="how many (default 20)")
    hist.add_argument("--json", action="store_true")
    hist.set_defaults(func=_history)

    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _cluster(args):
    from pdserve.state import ClusterState, state_path

    topo = load_topology_arg(args.topology)
    return topo, ClusterState.load(state_path(topo))


def _policy_text(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--policy {path}: no such file")
    with open(path) as f:
        return f.read()


def _run(args) -> int:
    import ray

    from pdserve.cluster.planner.actor import PlannerConfig, build_planner
    from pdserve.ray_auth import apply_ray_auth

    topo, state = _cluster(args)
    if args.policy:
        _policy_text(args.policy)
    apply_ray_auth(topo)
    ray.init(address=state.ray_address, namespace=state.namespace, log_to_driver=False)
    cfg = PlannerConfig(topology=os.path.abspath(args.topology), model=state.model, etcd_endpoints=state.etcd_endpoints,
                        worker_etcd_endpoints=state.gate_endpoints, policy=args.policy, dry_run=args.dry_run, known_workers=[a["worker_id"] for a in state.actors])
    planner = build_planner(cfg)

    async def go() -> int:
        print(f"planner: electing for cluster {topo.cluster} (waits while another planner runs)", flush=True)
        await planner.start()
        print(f"planner {planner.id}: mode {planner.section.mode}, every {planner.section.interval_s:g} s"
              f"{', dry run' if args.dry_run else ''}; metrics {planner.metrics_address}", flush=True)
        try:
            if args.once:
                decisions = None
                for _ in range(2 + int(planner.section.interval_s)):  # the first tick decides
                    decisions = await planner.tick()
                    if decisions:
                        break
                for d in decisions or []:
                    _print_decision(d.to_dict())
                return 0
            stop = asyncio.Event()
            await planner.run(stop)
            return 0 if planner.leader else 1
        finally:
            await planner.close()

    try:
        return asyncio.run(go())
    finally:
        ray.shutdown()


def _explain(args) -> int:
    from pdserve.cluster.registry import Registry
    from pdserve.cluster.planner.actor import cpu_units, queue_stats_fn
    from pdserve.cluster.planner.core import take_snapshot
    from pdserve.cluster.planner.decide import decide, learn
    from pdserve.cluster.planner.observe import observe
    from pdserve.cluster.planner.policy import parse_autoscale
    from pdserve.cluster.planner.state import read_planner
    from pdserve.ray_auth import apply_ray_auth

    topo, state = _cluster(args)
    apply_ray_auth(topo)  # the queue's stats come through Ray

    async def go():
        import ray

        async with Registry(state.etcd_endpoints, state.cluster, tls=topo.etcd_tls("operator", "worker")) as reg:
            if args.policy:
                policy, source = parse_autoscale(_policy_text(args.policy), args.policy), args.policy
            elif (text := await reg.get_policy("autoscale")) is not None:
                policy, source = parse_autoscale(text, "etcd config/autoscale"), "etcd config/autoscale"
            elif topo.autoscale_policy_path is not None:
                path = str(topo.autoscale_policy_path)
                policy, source = parse_autoscale(_policy_text(path), path), path
            else:
                raise ValueError("no autoscale policy: pass --policy, or name autoscale_policy in the topology")
            running = await read_planner(reg)
            ray.init(address=state.ray_address, namespace=state.namespace, log_to_driver=False)
            try:
                stats = queue_stats_fn(topo.queue.name, topo.ray.namespace)
                first = await take_snapshot(reg, stats)
                await asyncio.sleep(max(0.0, args.sample_s))
                second = await take_snapshot(reg, stats)
            finally:
                ray.shutdown()
        pstate = running["state"]
        memory = copy.deepcopy(pstate.memory)
        obs = observe(first, second)
        learn(memory, obs)
        from pdserve.cluster.planner.state import current_replicas

        counted, serving = current_replicas(second, pstate)
        units = {r: u or getattr(policy.autoscale, r).gpus_per_replica for r, u in cpu_units(topo).items()}
        busy = {r: sum(1 for p in pstate.pending.values() if p["role"] == r) for r in ("prefill", "decode")}
        decisions = decide(policy.autoscale, obs, memory, current=counted, units=units, now=time.time(),
                           in_progress=busy)
        return policy, source, running, obs, decisions, serving

    policy, source, running, obs, decisions, serving = asyncio.run(go())
    if args.json:
        print(json.dumps({"policy": source, "leader": running["leader"], "pending": running["state"].pending,
                          "decisions": [d.to_dict() for d in decisions]}, indent=2, default=str))
        return 0
    sec = policy.autoscale
    print(f"policy {source}: mode {sec.mode}, interval {sec.interval_s:g} s, cooldown {sec.cooldown_s:g} s, "
          f"max_step {sec.max_step}, gpu_budget {sec.gpu_budget}")
    leader = running["leader"]
    print("running planner: " + (f"{leader['planner']} on {leader['host']} (pid {leader['pid']})" if leader else "none"))
    for wid, p in sorted(running["state"].pending.items()):
        print(f"  in progress: {wid} {p['state']} since {time.time() - p['since']:.0f} s ({p.get('reason', '')})")
    q = obs.queue
    if q is not None:
        print(f"prefill queue: depth {q.get('depth')}, {q.get('queued_tokens')} tokens queued, "
              f"oldest wait {q.get('oldest_wait_ms', 0):.0f} ms")
    for d in decisions:
        print(f"\n{d.role}: serving {', '.join(serving[d.role]) or 'none'}")
        _print_decision(d.to_dict())
    return 0


def _print_decision(d: dict) -> None:
    tag = " [dry run]" if d.get("dry_run") else ""
    seq = f"#{d['seq']} " if "seq" in d else ""
    when = time.strftime("%H:%M:%S", time.localtime(d["at"]))
    print(f"  {seq}{when} {d['role']}: {d['action'].upper()} {d['current']} -> {d['desired']} ({d['reason']}){tag}")
    for line in d["explanation"]:
        print(f"      {line}")


def _history(args) -> int:
    from pdserve.cluster.registry import Registry
    from pdserve.cluster.planner.state import read_decisions

    topo, state = _cluster(args)

    async def go():
        async with Registry(state.etcd_endpoints, state.cluster, tls=topo.etcd_tls("operator", "worker")) as reg:
            return await read_decisions(reg, args.n)

    decisions = asyncio.run(go())
    if args.json:
        print(json.dumps(decisions, indent=2))
        return 0
    if not decisions:
        print("no decisions recorded (no planner has run for this cluster)")
        return 0
    for d in decisions:
        _print_decision(d)
    return 0


async def planner_summary(registry) -> tuple[list[str], set[str]]:
    """(lines for `pdserve status`: the running planner, desired vs actual, the last decisions;
    the workers it drained and stopped on purpose)."""
    from pdserve.cluster.planner.state import read_planner

    got = await read_planner(registry)
    leader, st = got["leader"], got["state"]
    if leader is None and not st.last:
        return [], set()
    lines = ["planner: " + (f"{leader['planner']} on {leader['host']}" if leader else "not running")]
    for role, last in sorted(st.last.items()):
        age = time.time() - last["at"]
        lines.append(f"  {role:<8} desired {st.desired.get(role, last['desired'])}, counted {last['current']}; "
                     f"last decision {age:.0f} s ago: {last['action']} ({last['reason']})"
                     + (" [dry run]" if last.get("dry_run") else ""))
    for wid, p in sorted(st.pending.items()):
        lines.append(f"  {wid}: {p['state']} for {time.time() - p['since']:.0f} s")
    return lines, set(st.stopped)

