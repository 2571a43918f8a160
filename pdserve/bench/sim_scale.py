"""A scale study on paper: Llama-3-70B on H100s at 16, 64 and 256 GPUs, with `pdserve sim`.

    python bench/sim_scale.py                         # both mixes, the three scales, and the plot
    python bench/sim_scale.py --mixes rag --scales 16,64
    python bench/sim_scale.py --profile runs/sim-validate/profile-gpu-calibrated.yaml --tp 1,2

The profile is, by default, the roofline of sim/profile.py (`pdserve sim profile --roofline
llama-3-70b --gpu h100`): datasheet numbers and stated efficiencies, **not calibrated** on any
served run. ``--profile PATH`` takes another (a measured one, or one `pdserve sim calibrate`
fitted to a real run). What the study rests on (the profile's name and source, and whether it
was measured, calibrated, or a roofline alone: `describe`) is printed first, kept in the result
(``profile_basis``), and written into the plot's title and the table's heading; its assumptions
are printed and kept too. For each traffic mix:

1. the load: per GPU, the highest rate (on a doubling-then-bisecting probe at 16 GPUs) at which
   the best 16-GPU candidate still serves >= 90 % of the offered requests within the SLO;
2. 16 GPUs: `sim.search` over every candidate (TP 4 and 8 per role, X prefill and Y decode
   workers using at least half of the GPUs; conditional, always-remote and colocated);
3. 64 and 256 GPUs: the best shape of each family (conditional, always_remote, colocated) at
   16 GPUs, scaled by 4 and 16 (and its neighbours: one prefill worker more and fewer per 16
   GPUs), at 4 and 16 times the load, each simulated at full size.

4. each family at its own capacity: its three best 16-GPU shapes from step 2, each probed for
   the highest per-GPU rate at which it keeps >= 90 % of the requests within the SLO (a
   bisection); the best of them is that family's capacity, and its shape, scaled by 4 and 16,
   is run at 4 and 16 times that load to see whether the capacity per GPU holds at scale.

Printed: per mix and scale, the best configuration of each family, its goodput (per GPU) and
TTFT/TPOT p99; then each family's capacity per GPU and how it holds at scale. Written to
runs/sim-scale/result.json, and the plot (goodput per GPU against the scale at the common
load, and capacity per GPU per family) to docs/img/sim-scale.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]  # the checkout (bench/ is pdserve/bench, linked from the top)
sys.path.insert(0, str(REPO))

from pdserve.router import DEFAULT_POLICY  # noqa: E402
from pdserve.sim.cluster import SimTopology, Simulation  # noqa: E402
from pdserve.sim.profile import GPUS, MODELS, CostProfile, load_profile, roofline  # noqa: E402
from pdserve.sim.report import Slo, summarize  # noqa: E402
from pdserve.sim.search import Candidate, candidates, search, with_mode  # noqa: E402
from pdserve.sim.workload import generate, mix  # noqa: E402

FAMILIES = ("conditional", "always_remote", "always_local")
SIM_SECONDS = 40.0  # traffic simulated per run (arrivals), whatever the rate


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


CALIBRATED = "calibrated on a real run"  # how sim/calibrate.py `calibrated` notes its fit in a profile's assumptions


def describe(prof: CostProfile) -> str:
    """What a study on ``prof`` rests on, in one line: a roofline alone (uncalibrated), a profile
    measured on an idle engine (uncalibrated: no serving costs), or either calibrated on a real
    served run (sim/calibrate.py), with the profile's name and source."""
    fits = [a for a in prof.assumptions if a.startswith(CALIBRATED)]
    kind = ("roofline" if prof.source.startswith("roofline") else
            "measured" if prof.source.startswith("measured") else "hand-written or unknown")
    basis = f"{kind}, calibrated ({fits[-1]})" if fits else f"{kind}, uncalibrated (no served run fitted)"
    return f"{prof.name} [{prof.source}]: {basis}"


def requests_for(name: str, rate: float, seed: int):
    return generate(mix(name, rate, max(50, int(rate * SIM_SECONDS))), seed)


def run_one(cand: Candidate, reqs, prof, slo: Slo, seed: int) -> dict:
    sim = Simulation(reqs, prof, with_mode(DEFAULT_POLICY, cand.mode), cand.topology, seed=seed).run()
    s = summarize(sim, slo)
    s.update(candidate=cand.label, mode=cand.mode, devices=cand.topology.gpus,
             goodput_per_device=round(s["goodput_req_s"] / cand.topology.gpus, 4))
    return s


def attained(s: dict) -> float:
    return s["good"] / max(1, s["requests"])


def probe_rate(name: str, prof, slo: Slo, seed: int, cands: list[Candidate]) -> float:
    """Per-GPU rate at which the best of a few strong 16-GPU shapes keeps >= 90 % within the SLO."""
    def ok(rate: float) -> bool:
        reqs = requests_for(name, rate * 16, seed)
        best = max(attained(run_one(c, reqs, prof, slo, seed)) for c in cands)
        log(f"   probe {name} at {rate:.3g} req/s per GPU: best attainment {best:.2f}")
        return best >= 0.9

    lo, hi = 0.0, 0.25
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 64:
            break
    for _ in range(4):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def bisect_rate(ok, lo: float, hi: float, steps: int = 5) -> float:
    """The highest rate in [lo, hi) that ``ok`` accepts, assuming lo is accepted (0 if it is not)."""
    if not ok(lo):
        return 0.0
    while ok(hi):
        lo, hi = hi, hi * 1.5
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def capacity(name: str, cand: Candidate, prof, slo: Slo, seed: int, near: float) -> float:
    """Per-GPU rate at which ``cand`` alone keeps >= 90 % within the SLO (probed around ``near``)."""
    gpus = cand.topology.gpus

    def ok(rate: float) -> bool:
        return attained(run_one(cand, requests_for(name, rate * gpus, seed), prof, slo, seed)) >= 0.9

    return bisect_rate(ok, near * 0.5, near * 1.25)


def capacities(name: str, rows16: list[dict], cands: list[Candidate], prof, slo: Slo, seed: int, near: float,
               scales: list[int]) -> dict:
    """Each family's capacity per GPU at 16 GPUs (its best of three shapes), and the attainment
    of that shape scaled to each larger scale at that load scaled alike."""
    by_label = {c.label: c for c in cands}
    out = {}
    for fam in FAMILIES:
        shapes = [by_label[r["candidate"]] for r in rows16 if r["mode"] == fam][:3]
        if not shapes:
            continue
        probed = [(capacity(name, c, prof, slo, seed, near), c) for c in shapes]
        cap, shape = max(probed, key=lambda x: x[0])
        log(f"   capacity {name} {fam}: {cap:.3g} req/s per GPU with {shape.label} "
            f"(also {', '.join(f'{c.label} {v:.3g}' for v, c in probed if c is not shape)})")
        entry = {"per_gpu": round(cap, 4), "shape": shape.label, "probed": {c.label: round(v, 4) for v, c in probed},
                 "at_scale": {}}
        for k in (1, *(s // 16 for s in scales if s > 16)):
            big = scaled(shape, k)
            r = run_one(big, requests_for(name, cap * big.topology.gpus, seed), prof, slo, seed)
            entry["at_scale"][str(16 * k)] = {"shape": big.label, "attained": round(attained(r), 3),
                                              "goodput_per_device": r["goodput_per_device"],
                                              "ttft_p99": r["ttft_ms"]["p99"], "tpot_p99": r["tpot_ms"]["p99"]}
            log(f"   capacity {name} {fam} at {16 * k} GPUs: {big.label} attains {attained(r):.2f}")
        out[fam] = entry
    return out


def scaled(cand: Candidate, k: int) -> Candidate:
    t = cand.topology
    return Candidate(SimTopology(t.prefill * k, t.decode * k, t.prefill_tp, t.decode_tp, t.ingress), cand.mode)


def neighbours(cand: Candidate, k: int) -> list[Candidate]:
    """The shape scaled by k, with k prefill workers more and fewer (one more or fewer per 16
    GPUs), trading decode workers to keep the GPU count."""
    base = scaled(cand, k)
    out = [base]
    t = base.topology
    if t.prefill == 0:
        return out
    for dp in (-k, k):
        p = t.prefill + dp
        gpus_left = k * 16 - p * t.prefill_tp
        d = gpus_left // t.decode_tp
        if p >= 1 and d >= 1:
            out.append(Candidate(SimTopology(p, d, t.prefill_tp, t.decode_tp, t.ingress), cand.mode))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", default="rag,chat")
    ap.add_argument("--scales", default="16,64,256")
    ap.add_argument("--tp", default="4,8")
    ap.add_argument("--slo-ttft", type=float, default=2000.0)
    ap.add_argument("--slo-tpot", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-capacity", action="store_true", help="skip step 4 (each family at its own capacity)")
    ap.add_argument("--work", default=str(REPO / "runs/sim-scale"))
    ap.add_argument("--plot", default=str(REPO / "docs/img/sim-scale.png"))
    ap.add_argument("--profile", help="a cost profile file (YAML or JSON) instead of the roofline of Llama-3-70B "
                    "on H100; it must time every --tp size")
    args = ap.parse_args(argv)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    tps = tuple(int(x) for x in args.tp.split(","))
    prof = load_profile(args.profile) if args.profile else roofline(MODELS["llama-3-70b"], GPUS["h100"], tps)
    for tp in tps:
        prof.step(tp)  # a size the profile cannot time is refused here, before any run (ProfileError)
    basis = describe(prof)
    log(f"profile: {basis}")
    for a in prof.assumptions:
        log(f"assumption: {a}")
    scales = [int(x) for x in args.scales.split(",")]
    doc = {"profile": prof.to_dict(), "profile_basis": basis, "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
           "mixes": {}}
    t_start = time.perf_counter()
    for name in args.mixes.split(","):
        cands = candidates(16, tps, ("conditional", "always_remote"), profile=prof)
        strong = [c for c in cands if c.topology.gpus == 16 and c.topology.prefill_tp == c.topology.decode_tp == 8]
        strong += [c for c in cands if c.topology.gpus == 16 and c.topology.prefill == 0]
        per_gpu = probe_rate(name, prof, slo, args.seed, strong)
        log(f"== {name}: load {per_gpu:.3g} req/s per GPU")
        entry = {"rate_per_gpu": per_gpu, "scales": {}}
        reqs = requests_for(name, per_gpu * 16, args.seed)
        rows = search(reqs, prof, DEFAULT_POLICY, cands, slo, args.seed,
                      progress=lambda line: log(f"   16 GPUs {line}"))
        best = {f: next((r for r in rows if r["mode"] == f), None) for f in FAMILIES}
        entry["scales"]["16"] = {"best": best, "candidates": len(rows)}
        shapes = {f: next(c for c in cands if c.label == r["candidate"]) for f, r in best.items() if r}
        for k in (s // 16 for s in scales if s > 16):
            reqs = requests_for(name, per_gpu * 16 * k, args.seed)
            got = {}
            for fam, cand in shapes.items():
                trial = [run_one(c, reqs, prof, slo, args.seed) for c in neighbours(cand, k)]
                got[fam] = max(trial, key=lambda r: (r["goodput_req_s"], -(r["ttft_ms"]["p99"] or 0)))
                log(f"   {16 * k} GPUs {fam}: {got[fam]['candidate']} goodput {got[fam]['goodput_req_s']:.3g} req/s")
            entry["scales"][str(16 * k)] = {"best": got}
        if not args.no_capacity:
            entry["capacity"] = capacities(name, rows, cands, prof, slo, args.seed, per_gpu, scales)
        doc["mixes"][name] = entry
    doc["wall_s"] = round(time.perf_counter() - t_start, 1)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "result.json").write_text(json.dumps(doc, indent=1))
    print(report(doc))
    plot(doc, Path(args.plot))
    return 0


def report(doc: dict) -> str:
    lines = [f"Profile: {doc.get('profile_basis') or doc['profile']['name'] + ' [' + doc['profile']['source'] + ']'}",
             "",
             "| mix | GPUs | load req/s | family | best configuration | goodput req/s | per GPU | TTFT p99 ms | "
             "TPOT p99 ms | vs best family |", "|" + "---|" * 10]
    for name, entry in doc["mixes"].items():
        for scale, sc in entry["scales"].items():
            best = {f: r for f, r in sc["best"].items() if r}
            top = max(r["goodput_req_s"] for r in best.values())
            for fam, r in best.items():
                lines.append(f"| {name} | {scale} | {entry['rate_per_gpu'] * int(scale):.3g} | {fam} | {r['candidate']} | "
                             f"{r['goodput_req_s']:.3g} | {r['goodput_per_device']:.3g} | {r['ttft_ms']['p99']} | "
                             f"{r['tpot_ms']['p99']} | {r['goodput_req_s'] / top:.2f}x |")
    caps = [(name, fam, c) for name, entry in doc["mixes"].items() for fam, c in entry.get("capacity", {}).items()]
    if caps:
        lines += ["", "| mix | family | shape within 16 GPUs | capacity req/s per GPU | vs best family | "
                  "attained at 16 / 64 / 256 GPUs (shape and load x1 / x4 / x16) | goodput per GPU there |", "|" + "---|" * 7]
        for name, entry in doc["mixes"].items():
            cap = entry.get("capacity", {})
            if not cap:
                continue
            top = max(c["per_gpu"] for c in cap.values()) or 1.0
            for fam, c in cap.items():
                at = [v for _, v in sorted(c["at_scale"].items(), key=lambda x: int(x[0]))]
                held = " / ".join(f"{v['attained']:.2f}" for v in at)
                good = " / ".join(f"{v['goodput_per_device']:.3g}" for v in at)
                lines.append(f"| {name} | {FAMILY_NAME[fam]} | {c['shape'].rsplit(' ', 1)[0]} | {c['per_gpu']:.3g} | "
                             f"{c['per_gpu'] / top:.2f}x | {held} | {good} |")
    return "\n".join(lines)


FAMILY_NAME = {"conditional": "conditional", "always_remote": "always-remote", "always_local": "colocated"}


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_caps = any(e.get("capacity") for e in doc["mixes"].values())
    rows = 2 if with_caps else 1
    fig, axes = plt.subplots(rows, len(doc["mixes"]), figsize=(6 * len(doc["mixes"]), 4.2 * rows), squeeze=False)
    colors = {"conditional": "tab:green", "always_remote": "tab:orange", "always_local": "tab:blue"}
    if with_caps:
        for ax, (name, entry) in zip(axes[1], doc["mixes"].items()):
            cap = entry.get("capacity", {})
            scales = sorted({s for c in cap.values() for s in c["at_scale"]}, key=int)
            width = 0.8 / max(1, len(cap))
            for i, (fam, c) in enumerate(cap.items()):
                ys = [c["at_scale"][s]["goodput_per_device"] for s in scales]
                ax.bar([j + i * width for j in range(len(scales))], ys, width, color=colors[fam],
                       label=f"{FAMILY_NAME[fam]} ({c['shape'].rsplit(' ', 1)[0]}, scaled)")
            ax.set_xticks([j + width * (len(cap) - 1) / 2 for j in range(len(scales))], scales)
            ax.set_xlabel("GPUs")
            ax.set_ylabel("goodput per GPU (req/s)")
            ax.set_title(f"{name}: each family at its own 16-GPU capacity, scaled")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
    for ax, (name, entry) in zip(axes[0], doc["mixes"].items()):
        scales = sorted(int(s) for s in entry["scales"])
        for fam in FAMILIES:
            ys = [(s, entry["scales"][str(s)]["best"].get(fam)) for s in scales]
            ys = [(s, r["goodput_per_device"]) for s, r in ys if r]
            if ys:
                ax.plot([s for s, _ in ys], [y for _, y in ys], marker="o", color=colors[fam],
                        label="colocated" if fam == "always_local" else fam.replace("_", "-"))
        ax.set_xscale("log", base=2)
        ax.set_xticks(scales, [str(s) for s in scales])
        ax.set_xlabel("GPUs")
        ax.set_ylabel("goodput per GPU (req/s)")
        ax.set_title(f"{name}: {entry['rate_per_gpu']:.3g} req/s per GPU offered")
        ax.grid(alpha=0.3)
        ax.legend()
    slo = doc["slo"]
    basis = doc.get("profile_basis") or doc["profile"]["name"]
    fig.suptitle(f"Simulated on {basis[:110]}\ngoodput at TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
