"""`pdserve sim search`: which XpYd, tensor-parallel sizes and router mode serve a traffic best
under a device budget.

Every candidate (prefill workers x their TP size, decode workers x theirs, the router's mode)
whose devices fit the budget is simulated on the same requests with the same seed; candidates
are ranked by goodput at the SLO (then by goodput per device, then by TTFT p99). The margin of
each is its goodput against the best one's, and its TTFT p99 and TPOT p99 against the SLO: how
much room it leaves. Colocated candidates (no prefill worker) run ``always_local``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.router import RouterPolicy

from .cluster import SimTopology, Simulation
from .profile import CostProfile
from .report import Slo, summarize
from .workload import SimRequest

MODES = ("conditional", "always_remote")


@dataclass(frozen=True)
class Candidate:
    topology: SimTopology
    mode: str  # the router's mode: conditional | always_remote | always_local (colocated)

    @property
    def label(self) -> str:
        return f"{self.topology.label} {self.mode}"


def with_mode(policy: RouterPolicy, mode: str) -> RouterPolicy:
    """``policy`` with its router's mode replaced (a validated copy)."""
    body = policy.model_dump()
    body["router"]["mode"] = mode
    return RouterPolicy.model_validate(body)


def candidates(budget: int, tps: tuple[int, ...], modes: tuple[str, ...] = MODES, ingress: str = "round_robin",
               max_workers: int = 64, profile: CostProfile | None = None) -> list[Candidate]:
    """Every (X prefill x TP p, Y decode x TP d, mode) using at most ``budget`` devices and at
    least half of it (smaller ones waste what was bought), with sizes the profile can time."""
    if profile is not None:
        tps = tuple(t for t in tps if t in profile.steps)
    out = []
    for dtp in tps:
        for d in range(1, min(budget // dtp, max_workers) + 1):
            left = budget - d * dtp
            if d * dtp * 2 >= budget:
                out.append(Candidate(SimTopology(0, d, 1, dtp, ingress), "always_local"))
            for ptp in tps:
                for p in range(1, min(left // ptp, max_workers) + 1):
                    if (d * dtp + p * ptp) * 2 < budget:
                        continue
                    for mode in modes:
                        out.append(Candidate(SimTopology(p, d, ptp, dtp, ingress), mode))
    return out


def search(requests: list[SimRequest], profile: CostProfile, policy: RouterPolicy, cands: list[Candidate],
           slo: Slo, seed: int = 0, progress=None) -> list[dict]:
    """Simulate every candidate; rows ranked best first, each with its summary and margins."""
    rows = []
    for i, c in enumerate(cands, 1):
        t0 = time.perf_counter()
        sim = Simulation(requests, profile, with_mode(policy, c.mode), c.topology, seed=seed).run()
        s = summarize(sim, slo)
        s.update(candidate=c.label, mode=c.mode, devices=c.topology.gpus,
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
