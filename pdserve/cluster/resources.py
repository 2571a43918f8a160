"""The Ray resources everything `pdserve up` starts asks for, and what a cluster lacks of them.

Ray places an actor only where its resources fit; an actor that fits nowhere waits forever
(the launcher then times out minutes later on a `ray.get`). So the launcher sizes the Ray head
it starts from this list, and checks a cluster it joins against it before starting anything;
`pdserve topology check` prints the same list. Pure: a topology in, values out.

Accounted for: the prefill and decode replicas (the planner's max_replicas when larger: it
may start that many), tensor-parallel ranks (placement-group bundles, cluster/actors.py
`rank_bundles`), the gateways, the KV index. The prefill queue and the planner are actors that
ask for no CPU (`num_cpus=0`); the etcd gate and the embedded etcd are plain child processes
of `up`, not Ray actors: listed with 0 so that the table names everything `up` starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.cluster.actors import RANK_BUNDLE_MIN_CPU

if TYPE_CHECKING:
    from pdserve.cluster.topology import Topology

# A Ray head `up` starts never gets fewer logical CPUs than this (the queue's and Ray's own
# tasks share them with the workers; 2 is what the launcher always gave).
MIN_HEAD_CPUS = 2
# Float sums of fractions (0.1 + 0.2) must not read as a shortfall.
_EPS = 1e-9


@dataclass(frozen=True)
class Demand:
    """`count` actors of one kind, each asking Ray for `each` (resource name -> amount)."""

    what: str
    count: int
    each: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def total(self) -> dict[str, float]:
        return {key: amount * self.count for key, amount in self.each.items() if amount > 0}


def _role_each(spec) -> dict[str, float]:
    """What one replica of a role asks for: its actor's, or with TP > 1 the sum of its ranks'
    placement-group bundles (a rank of a worker that asks for no CPU still reserves a sliver)."""
    res = spec.resources
    each = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.custom}
    if spec.tensor_parallel_size > 1 and res.num_cpus <= 0 and res.num_gpus <= 0:
        each["CPU"] = RANK_BUNDLE_MIN_CPU * spec.tensor_parallel_size
    return {key: float(amount) for key, amount in each.items() if amount > 0}


def ray_demand(topo: "Topology", max_replicas: dict[str, int] | None = None) -> list[Demand]:
    """Every kind of process `pdserve up` starts for `topo`, with what each asks of Ray."""
    demands = []
    for role in ("prefill", "decode"):
        spec = getattr(topo.roles, role)
        most = max(spec.replicas, (max_replicas or {}).get(role, 0))
        note = f"planner max_replicas {most}" if most > spec.replicas else ""
        tp = f", TP={spec.tensor_parallel_size}" if spec.tensor_parallel_size > 1 else ""
        demands.append(Demand(f"{role} worker{tp}", most, _role_each(spec), note))
    if topo.gateway.replicas:
        demands.append(Demand("gateway", topo.gateway.replicas,
                              {k: float(v) for k, v in {"CPU": topo.gateway.num_cpus, **topo.gateway.custom}.items()
                               if v > 0}))
    if topo.kv_index.enabled:
        demands.append(Demand("kv index", 1, {k: float(v) for k, v in
                                              {"CPU": topo.kv_index.num_cpus, **topo.kv_index.custom}.items() if v > 0}))
    demands.append(Demand("prefill queue", 1, {}, "num_cpus 0"))
    if topo.autoscale_policy:
        demands.append(Demand("planner", 1, {}, "num_cpus 0"))
    if topo.etcd.gate is not None:
        demands.append(Demand("etcd gate", 1, {}, "a child process of `up`, not a Ray actor"))
    return demands


def total(demands: list[Demand]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in demands:
        for key, amount in d.total().items():
            out[key] = out.get(key, 0.0) + amount
    return out


def head_cpus(demands: list[Demand]) -> int:
    """The logical CPUs of a Ray head `up` starts: room for every actor in `demands`."""
    return max(MIN_HEAD_CPUS, math.ceil(total(demands).get("CPU", 0.0) - _EPS))


def shortfall(demands: list[Demand], available: dict[str, float]) -> list[str]:
    """One line per resource the demands need more of than `available` has, naming who
    asks for it; [] when everything fits (by sum: a cluster can still split it badly
    across nodes, which Ray then reports)."""
    lines = []
    for key, need in sorted(total(demands).items()):
        have = float(available.get(key, 0.0))
        if need > have + _EPS:
            who = ", ".join(f"{d.what} {d.count}x{d.each[key]:g}" for d in demands if d.each.get(key, 0) > 0)
            lines.append(f"{key}: need {need:g}, the Ray cluster has {have:g} free ({who})")
    return lines


def describe(demands: list[Demand]) -> list[str]:
    """The table `pdserve topology check` prints: one line per kind, then the sums."""
    lines = []
    for d in demands:
        asks = ", ".join(f"{k} {v:g}" for k, v in d.each.items()) or "nothing"
        lines.append(f"  {d.what:<20} x{d.count}  each {asks}" + (f"  ({d.note})" if d.note else ""))
    sums = ", ".join(f"{k} {v:g}" for k, v in sorted(total(demands).items())) or "nothing"
    lines.append(f"  total: {sums}; a Ray head `pdserve up` starts gets {head_cpus(demands)} CPUs")
    return lines


def custom_without_cluster(demands: list[Demand]) -> list[str]:
    """Resources a Ray head `up` starts cannot have (it declares only CPUs; GPUs Ray detects):
    custom ones, which only nodes of a cluster you start (`ray up`, `ray start --resources`) carry."""
    keys = sorted({key for d in demands for key in d.each
                   if key not in ("CPU", "GPU") and not key.startswith("node:")})  # node:<ip>: every node has its own
    return [f"{key} (asked by {', '.join(d.what for d in demands if key in d.each)})" for key in keys]
