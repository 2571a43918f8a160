"""PNG plots of a sweep document (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

COLORS = {"colocated": "tab:blue", "always-remote": "tab:orange", "conditional": "tab:green"}
EXTRA_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:red", "tab:gray")


def mode_color(mode: str, modes) -> str:
    """The three modes keep their colours in every plot; further modes (extra policies) take
    the next unused ones in sweep order, never one of the three."""
    if mode in COLORS:
        return COLORS[mode]
    extras = [m for m in modes if m not in COLORS]
    return EXTRA_COLORS[extras.index(mode) % len(EXTRA_COLORS)]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _runs(doc: dict):
    """(mode, [(rate, metrics)] sorted by rate)."""
    for mode, runs in doc["results"].items():
        yield mode, sorted(((m["request_rate"], m) for m in runs.values()), key=lambda rm: rm[0])


def _title(doc: dict) -> str:
    c = doc["config"]
    return (f"{c['dataset']['name']} workload, {c['num_workers']} workers per mode "
            f"(model {Path(c['model_dir']).name})")


def goodput_vs_rate(doc: dict, path: Path) -> None:
    plt = _plt()
    n = doc["config"]["num_workers"]
    slos = doc["config"]["slos"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    finite = [r for r in doc["config"]["request_rates"] if not (isinstance(r, str) or math.isinf(r))]
    if finite:
        xs = sorted(finite)
        ax.plot(xs, [x / n for x in xs], ":", color="grey", label="offered load / worker")
    for mode, runs in _runs(doc):
        pts = [(r, m["request_goodput_per_worker"] if slos else m["request_throughput"] / n)
               for r, m in runs if not math.isinf(r)]
        if pts:
            ax.plot(*zip(*pts), "o-", color=mode_color(mode, doc["results"]), label=mode)
    slo = " ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
    ax.set_xlabel("request rate (req/s, whole cluster)")
    ax.set_ylabel("goodput (req/s per worker)" if slos else "throughput (req/s per worker)")
    ax.set_title(f"Goodput vs rate [{slo}]\n{_title(doc)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def latency_vs_rate(doc: dict, path: Path) -> None:
    plt = _plt()
    slos = doc["config"]["slos"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, name in zip(axes, ("ttft", "tpot")):
        for mode, runs in _runs(doc):
            pts = [(r, m[f"p90_{name}_ms"]) for r, m in runs if not math.isinf(r) and m.get(f"p90_{name}_ms") is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", color=mode_color(mode, doc["results"]), label=f"{mode} p90")
        if name in slos:
            ax.axhline(slos[name], color="red", ls="--", lw=1, label=f"SLO {slos[name]:g} ms")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"P90 TTFT and TPOT vs rate: {_title(doc)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cdf(doc: dict, path: Path, name: str, rate: float) -> None:
    """Empirical CDF of one metric over the completed requests of every mode at one rate."""
    plt = _plt()
    slos = doc["config"]["slos"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, runs in _runs(doc):
        m = next((m for r, m in runs if r == rate), None)
        if m is None:
            continue
        vals = np.sort([r[f"{name}_ms"] for r in m["requests"] if r["success"] and r[f"{name}_ms"] is not None])
        if vals.size:
            ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", color=mode_color(mode, doc["results"]),
                    label=f"{mode} (n={vals.size})")
    if name in slos:
        ax.axvline(slos[name], color="red", ls="--", lw=1, label=f"SLO {slos[name]:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel(f"{name.upper()} (ms, log scale)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{name.upper()} CDF at {rate:g} req/s\n{_title(doc)}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(doc: dict, out_dir: Path, cdf_rate: float) -> dict:
    """All four PNGs; returns {plot name: path}."""
    paths = {name: out_dir / f"{name}.png" for name in ("goodput_vs_rate", "latency_vs_rate", "ttft_cdf", "tpot_cdf")}
    goodput_vs_rate(doc, paths["goodput_vs_rate"])
    latency_vs_rate(doc, paths["latency_vs_rate"])
    cdf(doc, paths["ttft_cdf"], "ttft", cdf_rate)
    cdf(doc, paths["tpot_cdf"], "tpot", cdf_rate)
    return {k: str(v) for k, v in paths.items()} | {"cdf_rate": cdf_rate}
