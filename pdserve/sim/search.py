"""`pdserve sim search`: which XpYd, tensor-parallel sizes, router mode and router / QoS
parameters serve a traffic best under a device budget.

Every candidate (prefill workers x their TP size, decode workers x theirs, the router's mode,
and each combination of the policy values asked to vary, e.g. ``router.cost_model.min_gain_ms=
0,20`` or ``qos.enable_early_rejection=true,false``) whose devices fit the budget is simulated
on the same requests with the same seed; candidates are ranked by goodput at the SLO (then by goodput per device, then by TTFT p99). The margin of
each is its goodput against the best one's, and its TTFT p99 and TPOT p99 against the SLO: how
much room it leaves. Colocated candidates (no prefill worker) run ``always_local``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import yaml
from pydantic import ValidationError

from pdserve.router import RouterPolicy

from .cluster import SimTopology, Simulation
from .profile import CostProfile
from .report import Slo, summarize
from .workload import SimRequest

MODES = ("conditional", "always_remote")


Params = tuple[tuple[str, object], ...]  # (dotted policy path, value) pairs


@dataclass(frozen=True)
class Candidate:
    topology: SimTopology
    mode: str  # the router's mode: conditional | always_remote | always_local (colocated)
    params: Params = ()  # policy values set for this candidate (``--vary``)

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.params)
        return f"{self.topology.label} {self.mode}{extra}"

    def policy(self, base: RouterPolicy) -> RouterPolicy:
        return with_params(with_mode(base, self.mode), self.params)


def with_mode(policy: RouterPolicy, mode: str) -> RouterPolicy:
    """``policy`` with its router's mode replaced (a validated copy)."""
    return with_params(policy, (("router.mode", mode),))


def with_params(policy: RouterPolicy, params: Params) -> RouterPolicy:
    """``policy`` with each dotted path set (a validated copy; ValueError names a bad path or value)."""
    if not params:
        return policy
    body = policy.model_dump()
    for path, value in params:
        node = body
        keys = path.split(".")
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                raise ValueError(f"--vary {path}: {k!r} is not a section of the router policy")
            node = node[k]
        if keys[-1] not in node or isinstance(node[keys[-1]], dict):
            raise ValueError(f"--vary {path}: no such setting (the {'.'.join(keys[:-1]) or 'top'} level has "
                             f"{', '.join(sorted(k for k, v in node.items() if not isinstance(v, dict)))})")
        node[keys[-1]] = value
    try:
        return RouterPolicy.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(f"--vary: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def variations(specs: list[str]) -> list[Params]:
    """Every combination of ``PATH=V1,V2,...`` specs (values read as YAML: numbers, true/false)."""
    axes = []
    for spec in specs:
        path, sep, values = spec.partition("=")
        if not sep or not path.strip() or not values.strip():
            raise ValueError(f"--vary {spec!r}: expected PATH=V1,V2 (e.g. router.cost_model.min_gain_ms=0,20)")
        axes.append([(path.strip(), yaml.safe_load(v.strip())) for v in values.split(",") if v.strip()])
    for axis in axes:  # each value checked against the default policy now, not after an hour of search
        for p in axis:
            with_params(RouterPolicy(), (p,))
    return [tuple(combo) for combo in itertools.product(*axes)] if axes else [()]


def candidates(budget: int, tps: tuple[int, ...], modes: tuple[str, ...] = MODES, ingress: str = "round_robin",
               max_workers: int = 64, profile: CostProfile | None = None,
               grid: list[Params] | None = None) -> list[Candidate]:
    """Every (X prefill x TP p, Y decode x TP d, mode, policy values of ``grid``) using at most
    ``budget`` devices and at least half of it (smaller ones waste what was bought), with sizes
    the profile can time."""
    grid = grid or [()]
    if profile is not None:
        tps = tuple(t for t in tps if t in profile.steps)
    out = []
    for dtp in tps:
        for d in range(1, min(budget // dtp, max_workers) + 1):
            left = budget - d * dtp
            if d * dtp * 2 >= budget:
                out += [Candidate(SimTopology(0, d, 1, dtp, ingress), "always_local", g) for g in grid]
            for ptp in tps:
                for p in range(1, min(left // ptp, max_workers) + 1):
                    if (d * dtp + p * ptp) * 2 < budget:
                        continue
                    for mode in modes:
                        out += [Candidate(SimTopology(p, d, ptp, dtp, ingress), mode, g) for g in grid]
    return out


def search(requests: list[SimRequest], profile: CostProfile, policy: RouterPolicy, cands: list[Candidate],
           slo: Slo, seed: int = 0, progress=None) -> list[dict]:
    """Simulate every candidate; rows ranked best first, each with its summary and margins."""
    rows = []
    for i, c in enumerate(cands, 1):
        t0 = time.perf_counter()
        sim = Simulation(requests, profile, c.policy(policy), c.topology, seed=seed).run()
        s = summarize(sim, slo)
        s.update(candidate=c.label, mode=c.mode, params=dict(c.params), devices=c.topology.gpus,
                 goodput_per_device=round(s["goodput_req_s"] / c.topology.gpus, 4))
        rows.append(s)
        if progress:
            progress(f"[{i}/{len(cands)}] {c.label}: goodput {s['goodput_req_s']:.3f} req/s, "
                     f"TTFT p99 {s['ttft_ms']['p99']} ms ({time.perf_counter() - t0:.1f} s)")
    rows.sort(key=lambda r: (-r["goodput_req_s"], -r["goodput_per_device"], r["ttft_ms"]["p99"] or 0.0))
    best = rows[0]["goodput_req_s"] if rows else 0.0
    for r in rows:
        r["margin"] = {
            "goodput_vs_best": round(r["goodput_req_s"] / best, 3) if best else None,
            "ttft_p99_vs_slo": _ratio(r["ttft_ms"]["p99"], slo.ttft_ms),
            "tpot_p99_vs_slo": _ratio(r["tpot_ms"]["p99"], slo.tpot_ms),
        }
    return rows


def _ratio(x, y):
    return None if x is None or not y else round(x / y, 3)
