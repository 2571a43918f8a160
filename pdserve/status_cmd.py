"""`pdserve status`: what a running topology looks like from etcd, the queue and the planner.

Members and their load (etcd), workers `up` started that are not registered, the
prefill queue's depth and counters (through Ray), the planner's summary, and which
surfaces the topology protects (docs/security.md). The LoRA adapters a worker serves (its
record's ``load["lora_adapters"]``, docs/lora.md) get a line under it, and each member's
``lora_adapters`` in the JSON; so does what its KV pool holds (model family, KV dtype, layout and
block size, from the record's ``kv_layout``). `--json` prints it as one object.
"""

from __future__ import annotations

import asyncio
import json
import sys

from pdserve.topology_args import load_topology_arg

STATUS_ETCD_TIMEOUT_S = 5.0
SERVICES = ("gateway", "kv-index")  # actors `up` starts that are not workers (not in etcd)


def status(args) -> int:
    """`pdserve status`: members, the queue, the planner and what the topology protects; 0 when
    every worker `up` started is registered."""
    from pdserve.cluster.records import TRANSIENT_ERRORS, short_error
    from pdserve.launcher import ClusterState, state_path

    topo = load_topology_arg(args.topology)
    state = ClusterState.load(state_path(topo))
    security = _security(topo)
    try:
        members = asyncio.run(asyncio.wait_for(_members(state, _status_tls(topo)), STATUS_ETCD_TIMEOUT_S))
    except (*TRANSIENT_ERRORS, asyncio.TimeoutError) as exc:
        # etcd down or restarting: say so in one line and still show the queue.
        print(f"pdserve status: etcd at {', '.join(state.etcd_endpoints)} did not answer within "
              f"{STATUS_ETCD_TIMEOUT_S:.0f} s ({short_error(exc)}); membership unknown. Is etcd running? "
              "(`pdserve up` starts it for local clusters)", file=sys.stderr)
        members = None
    queue = _queue_stats_as(topo, state)
    if args.json:
        print(json.dumps({"cluster": state.cluster, "members": members, "queue": queue,
                          "etcd": state.etcd_endpoints, "etcd_gate": state.gate_endpoints,
                          "security": [s.to_dict() for s in security]}, indent=2))
        return 0 if members is not None else 1
    gate = f", workers through the etcd gate at {', '.join(state.gate_endpoints)}" if state.gate_endpoints else ""
    print(f"cluster {state.cluster}  (etcd {', '.join(state.etcd_endpoints)}{gate}, ray {state.ray_address})")
    if members is None:
        _print_queue(state, queue)
        _print_security(security, topo.network.bind)
        return 1
    print(f"{'worker':<14} {'role':<8} {'ranks':<6} {'host (address)':<30} {'endpoints':<44} load")
    for wid, m in sorted(members.items()):
        host = f"{m.get('hostname') or '?'} ({m.get('address') or '?'})"
        eps = " ".join(f"{k}={v}" for k, v in m["endpoints"].items()) or "-"
        load = " ".join(f"{k}={v}" for k, v in m["load"].items() if k != "lora_adapters") or "-"
        print(f"{wid:<14} {m['role']:<8} {tp_ranks(m):<6} {host:<30} {eps:<44} {load}")
        if m["lora_adapters"]:
            print(f"{'':<14} LoRA adapters: {', '.join(m['lora_adapters'])}")
        if kv := kv_summary(m):
            print(f"{'':<14} {kv}")
    _print_rank_groups(queue)
    planner, drained = _planner_lines(state, _status_tls(topo))
    # Workers the planner drained on purpose are not missing; gateways and the KV index do not
    # register in etcd (their addresses are in the state file).
    workers = [a for a in state.actors if a.get("role") not in SERVICES]
    missing = {a["worker_id"] for a in workers} - set(members) - drained
    for wid in sorted(missing):
        print(f"{wid:<14} MISSING  (started by `up`, not registered: dead or restarting)")
    for a in state.actors:
        if a.get("role") in SERVICES:
            eps = " ".join(f"{k}={a[k]}" for k in ("grpc", "http", "url") if a.get(k)) or "-"
            print(f"{a['worker_id']:<14} {a['role']:<8} {'':<6} {'(Ray actor ' + a['name'] + ')':<30} {eps}")
    _print_queue(state, queue)
    for line in planner:
        print(line)
    _print_security(security, topo.network.bind)
    return 0 if not missing else 1


def _security(topo):
    from pdserve.protection import surfaces

    return surfaces(topo)


def _print_security(security, bind: str) -> None:
    """Which surfaces the topology protects and how (docs/security.md, "What is protected")."""
    print(f"security (as the topology configures it; servers bind {bind}; docs/security.md):")
    width = max(len(s.name) for s in security)
    for s in security:
        hint = f"  [set {s.setting}]" if s.setting else ""
        print(f"  {s.name:<{width}}  {s.protected:<6} {s.how}{hint}")


def _queue_stats_as(topo, state) -> dict | None:
    """The queue's stats, reached through Ray with the topology's authentication (ray.auth)."""
    from pdserve.ray_auth import RayAuthError, apply_ray_auth

    try:
        apply_ray_auth(topo)
    except RayAuthError as exc:
        print(f"(prefill queue not reachable: {exc})", file=sys.stderr)
        return None
    return _queue_stats(state)


def _status_tls(topo):
    """`status` only reads: as the operator, or as a worker on a host that has only that."""
    return topo.etcd_tls("operator", "worker")


def _planner_lines(state, tls=None) -> tuple[list[str], set[str]]:
    from pdserve.cluster.registry import Registry
    from pdserve.planner_cmd import planner_summary

    async def go():
        async with Registry(state.etcd_endpoints, state.cluster, tls=tls) as reg:
            return await planner_summary(reg)

    try:
        return asyncio.run(asyncio.wait_for(go(), STATUS_ETCD_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001  (status shows the rest anyway)
        return [f"planner: unknown ({exc.__class__.__name__})"], set()


def _print_queue(state, queue: dict | None) -> None:
    if queue:
        print(f"prefill queue {state.queue_name}: depth {queue['depth']}, {queue['queued_tokens']} tokens queued, "
              f"in flight {queue['in_flight']}, oldest wait {queue['oldest_wait_ms']:.0f} ms")
        c = queue["counters"]
        print(f"  tasks put {c.get('put', 0)}, dispatched {c.get('dispatched', 0)}, completed {c.get('completed', 0)}, "
              f"requeued {c.get('requeued', 0)}; wire: {c.get('wire_connections', 0)} connections, "
              f"{c.get('wire_calls', 0)} calls, {c.get('wire_errors', 0)} errors")
        if any(k.startswith("prefix_") for k in c):  # prefix-aware dispatch (docs/kvindex.md)
            print(f"  prefix-aware: to the worker holding the prefix {c.get('prefix_routed', 0)}, kept for it "
                  f"{c.get('prefix_kept', 0)}, given to another {c.get('prefix_overridden', 0)}")


async def _members(state, tls=None) -> dict:
    return await read_members(state.etcd_endpoints, state.cluster, tls)


async def read_members(endpoints: list[str], cluster: str, tls=None) -> dict:
    """Each registered worker's record as a plain dict (role, hostname, address, endpoints,
    load, kv_layout, and the LoRA adapters it serves: `lora_adapters`), by worker id: what
    `status` and `top` (top_cmd.py) show."""
    from pdserve.cluster.registry import Registry

    async with Registry(endpoints, cluster, tls=tls) as reg:
        members = await reg.members()
    return {wid: {"role": m.role, "hostname": m.hostname, "address": m.address, "endpoints": m.endpoints,
                  "load": m.load, "kv_layout": m.kv_layout, "lora_adapters": lora_adapters(m.load)}
            for wid, m in members.items()}


def lora_adapters(load: dict) -> list[str]:
    """The LoRA adapters a record's load lists (``lora_adapters``, sorted names); [] without."""
    names = (load or {}).get("lora_adapters")
    return sorted(n for n in names if isinstance(n, str)) if isinstance(names, list) else []


def tp_ranks(member: dict) -> str:
    """A worker's tensor-parallel ranks and pool layout, e.g. "2 HND" ("1" for a plain worker)."""
    layout = member.get("kv_layout") or {}
    tp = layout.get("tensor_parallel_size", 1)
    return f"{tp} {layout['kv_layout']}" if tp > 1 or layout.get("kv_layout") == "HND" else str(tp)


def kv_summary(member: dict) -> str:
    """What a worker's pool holds, from its record's ``kv_layout``: the model family, the KV
    element type (and the ``kv_cache_dtype`` asked for, when not auto), layout and block size;
    "" for a record without one. Two workers pair only when these agree (docs/kv_cache.md)."""
    lay = member.get("kv_layout") or {}
    if not lay:
        return ""
    kv = lay.get("kv_dtype") or lay.get("dtype") or "?"
    cache = lay.get("kv_cache_dtype")
    if cache and cache != "auto":
        kv = f"{kv} ({cache})"
    return (f"model {lay.get('model_id', '?')}: family {lay.get('architecture', '?')}, KV {kv}, "
            f"layout {lay.get('kv_layout', '?')}, blocks of {lay.get('block_size', '?')} tokens")


def _rank_groups(state) -> dict[str, dict]:
    """The Ray placement group of each TP worker `up` started (cluster/actors.py): its strategy,
    state, bundles and the node addresses its bundles sit on (one, for STRICT_PACK)."""
    import ray
    from ray.util.placement_group import get_placement_group, placement_group_table

    from pdserve.cluster.actors import ranks_group_name

    ips = {n["NodeID"]: n.get("NodeManagerAddress") for n in ray.nodes()}
    out = {}
    for a in state.actors:
        try:
            table = placement_group_table(get_placement_group(ranks_group_name(a["name"])))
        except ValueError:
            continue  # a TP=1 worker: no group
        nodes = sorted({ips.get(n, n) for n in table.get("bundles_to_node_id", {}).values()})
        out[a["worker_id"]] = {"strategy": table["strategy"], "state": table["state"],
                               "bundles": len(table["bundles"]), "nodes": nodes}
    return out


def _print_rank_groups(queue: dict | None) -> None:
    for wid, g in sorted(((queue or {}).get("rank_groups") or {}).items()):
        print(f"ranks of {wid}: placement group {g['strategy']} {g['state'].lower()}, {g['bundles']} bundles "
              f"(one per rank) on node {', '.join(g['nodes']) or '(not placed yet)'}")


def _queue_stats(state) -> dict | None:
    import ray

    try:
        ray.init(address=state.ray_address, namespace=state.namespace, log_to_driver=False)
        from .cluster.queue.client import ray_call_sync

        st = ray_call_sync(ray.get_actor(state.queue_name, namespace=state.namespace), "stats", timeout_s=10)
        return {"depth": st.depth, "queued_tokens": st.queued_tokens, "in_flight": st.in_flight,
                "oldest_wait_ms": st.oldest_wait_ms, "counters": st.counters, "rank_groups": _rank_groups(state)}
    except Exception as exc:  # noqa: BLE001  (status must still show the members)
        print(f"(prefill queue not reachable: {exc.__class__.__name__})", file=sys.stderr)
        return None
    finally:
        ray.shutdown()
