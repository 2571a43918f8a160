"""The sweep's tables: one row per mode and rate, the per-mode summary, and the Markdown the command prints."""

from __future__ import annotations

BASELINES = ("colocated", "always-remote")
DEFAULT_ATTAINMENT = 0.9  # DistServe's "rate sustained within SLO" uses 90 % attainment


def sweep_table(results: dict) -> list[dict]:
    """One row per (mode, rate): the figures the study compares."""
    rows = []
    for mode, runs in results.items():
        for m in runs.values():
            mix = m["route_mix"]
            rows.append({
                "mode": mode, "request_rate": m["request_rate"], "num_prompts": m["num_prompts"],
                "completed": m["completed"], "failed": m["failed"],
                "request_throughput": m["request_throughput"], "request_goodput": m["request_goodput"],
                "request_goodput_per_worker": m["request_goodput_per_worker"],
                "slo_attainment": m["slo_attainment"], "output_throughput": m["output_throughput"],
                **{k: m.get(k) for k in ("mean_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                                         "mean_tpot_ms", "p90_tpot_ms", "p99_tpot_ms")},
                "remote_fraction": mix["remote_fraction"], "fell_back_to_local": mix["fell_back_to_local"],
                "load_avg_1m_before": m["load_avg_before"][0], "load_avg_1m_max": m.get("load_avg_1m_max"),
                "runs": len(m.get("repeats") or [m]), "spread": m.get("spread") or {},
            })
    return rows


def sweep_summary(results: dict, attainment: float = DEFAULT_ATTAINMENT) -> dict:
    """Each mode's goodput in the two forms the study compares, and the ratios to the others.

    - ``peak_goodput``: the highest request goodput (good requests / s) any rate reached;
    - ``max_rate_at_attainment``: the highest offered rate whose SLO attainment
      (good / sent) is at least ``attainment``, where every lower rate also made
      it (DistServe's "rate within SLO"); None if even the lowest rate missed.

    ``ratios[a][b]`` = a's figure / b's (None where b's is 0 or missing).
    """
    modes = {}
    for mode, runs in results.items():
        ordered = sorted(runs.values(), key=lambda m: m["request_rate"])
        goodputs = [m["request_goodput"] for m in ordered if m.get("request_goodput") is not None]
        sustained = None
        for m in ordered:
            if m.get("slo_attainment") is None or m["slo_attainment"] < attainment:
                break
            sustained = m["request_rate"]
        peak = max(goodputs, default=None)
        at = next((m["request_rate"] for m in ordered if m.get("request_goodput") == peak), None)
        modes[mode] = {"peak_goodput": peak, "peak_goodput_rate": at, "max_rate_at_attainment": sustained}
    ratios: dict = {}
    for a in modes:
        for b in modes:
            if a == b:
                continue
            ratios.setdefault(a, {})[b] = {
                key: (modes[a][key] / modes[b][key]) if modes[a][key] is not None and modes[b][key] else None
                for key in ("peak_goodput", "max_rate_at_attainment")}
    return {"attainment": attainment, "modes": modes, "ratios": ratios}


def summary_markdown(summary: dict) -> str:
    """The per-mode summary and each mode's ratio to the others, as Markdown."""
    lines = [f"| mode | peak goodput (req/s) | at rate | highest rate with >= {summary['attainment']:.0%} SLO met |",
             "|---|---|---|---|"]
    for mode, s in summary["modes"].items():
        rate = "-" if s["peak_goodput_rate"] is None else f"{s['peak_goodput_rate']:g}"
        sustained = "none" if s["max_rate_at_attainment"] is None else f"{s['max_rate_at_attainment']:g}"
        lines.append(f"| {mode} | {fmt(s['peak_goodput'])} | {rate} | {sustained} |")
    lines += ["", "| ratio | peak goodput | rate within SLO |", "|---|---|---|"]
    baselines = [m for m in BASELINES if m in summary["modes"]] or list(summary["modes"])
    for a, others in summary["ratios"].items():
        for b, r in others.items():
            if a in baselines or b not in baselines:
                continue  # the study's question: each conditional mode against the baselines
            lines.append(f"| {a} / {b} | {ratio(r['peak_goodput'])} | {ratio(r['max_rate_at_attainment'])} |")
    return "\n".join(lines)


def markdown_table(doc: dict) -> str:
    """The per-mode summary, the sweep table, then TTFT/TPOT per request kind, as Markdown."""
    lines = []
    if doc.get("summary"):
        lines += [summary_markdown(doc["summary"]), ""]
    lines += ["| mode | rate (req/s) | done/sent | throughput (req/s) | goodput (req/s) | goodput/worker | "
             "SLO met | TTFT mean / p90 / p99 (ms) | TPOT mean / p90 / p99 (ms) | remote | load 1m start / max |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["table"]:
        lines.append(
            f"| {r['mode']} | {r['request_rate']:g} | {r['completed']}/{r['num_prompts']} | "
            f"{r['request_throughput']:.2f} | {fmt(r['request_goodput'])} | {fmt(r['request_goodput_per_worker'])} | "
            f"{pct(r['slo_attainment'])} | {fmt(r['mean_ttft_ms'], 0)} / {fmt(r['p90_ttft_ms'], 0)} / "
            f"{fmt(r['p99_ttft_ms'], 0)} | {fmt(r['mean_tpot_ms'], 1)} / {fmt(r['p90_tpot_ms'], 1)} / "
            f"{fmt(r['p99_tpot_ms'], 1)} | {pct(r['remote_fraction'])} | {r['load_avg_1m_before']:.1f} / "
            f"{fmt(r['load_avg_1m_max'], 1)} |")
    spread_rows = [r for r in doc["table"] if r.get("runs", 1) > 1]
    if spread_rows:
        lines += ["", f"Median run of {spread_rows[0]['runs']} per cell (by goodput); min-max over the runs:", "",
                  "| mode | rate | goodput (req/s) | SLO met | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in spread_rows:
            sp = r["spread"]

            def mm(key, digits=0, scale=1.0):
                lo, hi = sp.get(key, (None, None))
                return "-" if lo is None else f"{lo * scale:.{digits}f}-{hi * scale:.{digits}f}"

            lines.append(f"| {r['mode']} | {r['request_rate']:g} | {mm('request_goodput', 2)} | "
                         f"{mm('slo_attainment', 0, 100)}% | {mm('median_ttft_ms')} | {mm('p99_ttft_ms')} | "
                         f"{mm('median_itl_ms', 1)} | {mm('p99_itl_ms')} |")
    lines += ["", "| mode | rate | kind | done/sent | SLO met | TTFT median / p90 (ms) | TPOT median / p90 (ms) | routes |",
              "|---|---|---|---|---|---|---|---|"]
    for mode, runs in doc["results"].items():
        for m in runs.values():
            for kind, k in m["by_kind"].items():
                routes = ", ".join(f"{a} {b}" for a, b in sorted(k["routes"].items())) or "-"
                lines.append(
                    f"| {mode} | {m['request_rate']:g} | {kind} | {k['completed']}/{k['num_requests']} | "
                    f"{fmt(k['good'], 0)} | {fmt(k['median_ttft_ms'], 0)} / {fmt(k['p90_ttft_ms'], 0)} | "
                    f"{fmt(k['median_tpot_ms'], 1)} / {fmt(k['p90_tpot_ms'], 1)} | {routes} |")
    lines += ["", "| mode | rate | remote: queue wait / prefill / transfer (mean ms) | KV MB/request | "
              "local: queue wait / prefill (mean ms) | fell back | ITL p99 / max (ms) |",
              "|---|---|---|---|---|---|---|"]
    for mode, runs in doc["results"].items():
        for m in runs.values():
            rem, loc = m["handoff"]["remote"], m["handoff"]["local"]
            mb = rem["mean_transfer_bytes"] / 1e6 if rem["mean_transfer_bytes"] is not None else None
            lines.append(
                f"| {mode} | {m['request_rate']:g} | {fmt(rem['mean_queue_wait_ms'], 0)} / "
                f"{fmt(rem['mean_prefill_ms'], 0)} / {fmt(rem['mean_transfer_ms'], 1)} | {fmt(mb)} | "
                f"{fmt(loc['mean_queue_wait_ms'], 0)} / {fmt(loc['mean_prefill_ms'], 0)} | "
                f"{m['route_mix']['fell_back_to_local']} | {fmt(m.get('p99_itl_ms'), 0)} / "
                f"{fmt(max((x for r in m['requests'] for x in r['itl_ms']), default=None), 0)} |")
    return "\n".join(lines)


def fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"
