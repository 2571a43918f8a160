"""What the planner sees: a snapshot of the cluster, and per-role figures derived from two.

A `Snapshot` is plain data (JSON): the prefill queue's stats and every registered
worker's `load` record (cluster/load.py), stamped with the wall clock. Rates need
earlier snapshots: `observe(past, cur)` turns each worker's cumulative counters
into per-second figures against its own earlier reading, timed by the worker's
publish time `t` (a record refreshes every `load_report_s`, whatever the planner's
interval, so two snapshots may hold the same reading). The planner records the snapshots it
decided on, so `pdserve planner explain` can replay exactly what it saw.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pdserve.cluster.keys import ROLES


@dataclass
class Snapshot:
    """The cluster at one instant: queue stats and each worker's role and load."""

    t: float  # wall-clock seconds
    queue: dict | None  # depth, queued_tokens, oldest_wait_ms, in_flight_tokens; None: unreachable
    workers: dict[str, dict] = field(default_factory=dict)  # worker_id -> {"role", "load"}

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Snapshot":
        body = json.loads(text)
        return cls(t=float(body["t"]), queue=body.get("queue"), workers=dict(body.get("workers") or {}))


@dataclass
class RoleView:
    """One role's figures. Percentages are 0-100, as the autoscale policy writes them;
    None where nothing was measured (no worker, or no interval yet)."""

    role: str
    workers: list[str]  # registered worker ids (serving or draining)
    queue_length: float | None = None  # prefill: tasks waiting in the queue; decode: waiting per worker
    in_system: float | None = None  # decode: sequences running + waiting, all workers
    utilization: float | None = None  # mean busy % of the role's engines (NVML's GPU % when all report it)
    utilization_source: str = "busy"  # "busy" (engine loop) | "nvml"
    kv_cache_usage: float | None = None  # mean KV usage %
    # Rates: each worker's counters against its own earlier reading (see `observe`).
    interval_s: float | None = None  # mean span of those readings
    tokens_per_s: float | None = None  # prefill: prompt tokens computed; decode: output tokens
    requests_per_s: float | None = None  # prefill: tasks served; decode: requests that got a first token
    busy_s: float | None = None  # summed busy seconds of the role's workers in the interval
    tokens: float | None = None  # prefill: prompt tokens computed in the interval
    tasks: float | None = None  # prefill: tasks served in the interval
    mean_output_tokens: float | None = None  # decode: per request, in the interval
    mean_prompt_tokens: float | None = None  # decode: per request, in the interval
    decode_batch: float | None = None  # decode: mean sequences per decode-only step
    decode_step_ms: float | None = None  # decode: mean decode-only step time
    ttft_p90_ms: float | None = None  # worst worker's windowed p90
    itl_p90_ms: float | None = None


@dataclass
class Observation:
    """Both roles' views, the queue, and the snapshots they came from."""

    at: float
    prefill: RoleView
    decode: RoleView
    queue: dict | None
    backlog_growth_tokens_per_s: float | None = None  # d(queued_tokens)/dt against an earlier snapshot

    def role(self, name: str) -> RoleView:
        return getattr(self, name)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _max(values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _delta(cur: dict, prev: dict, key: str) -> float | None:
    """cur[key] - prev[key] for a cumulative counter; a counter that went down (the worker
    restarted) gives None."""
    now = cur.get(key)
    if not isinstance(now, (int, float)):
        return None
    before = prev.get(key, 0.0)
    if not isinstance(before, (int, float)) or now < before:
        return None
    return float(now - before)


def _sum_deltas(pairs: list[tuple[dict, dict]], key: str) -> float | None:
    maybe = [_delta(cur, prev, key) for cur, prev in pairs]
    deltas = [d for d in maybe if d is not None]
    return sum(deltas) if deltas else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _earlier(past: list[Snapshot], cur: Snapshot, wid: str, min_span_s: float) -> tuple[dict, float] | None:
    """The newest earlier reading of worker `wid` at least `min_span_s` older than its current
    one, by the worker's own publish time `t` (records refresh on the worker's schedule, not
    the planner's): (that load, seconds between the two). None if there is none."""
    load = cur.workers[wid].get("load") or {}
    t_now = load.get("t", cur.t)
    for snap in reversed(past):
        rec = snap.workers.get(wid)
        if rec is None:
            continue
        old = rec.get("load") or {}
        span = t_now - old.get("t", snap.t)
        if span > 0 and span >= min_span_s:
            return old, span
    return None


def observe(past: Snapshot | list[Snapshot] | None, cur: Snapshot, min_span_s: float = 0.0) -> Observation:
    """Per-role figures from `cur`, with rates against the earlier snapshots `past` (oldest
    first; one snapshot or None also do): for each worker, against its newest earlier reading
    at least `min_span_s` older (the planner passes its interval)."""
    past = [] if past is None else [past] if isinstance(past, Snapshot) else list(past)
    views = {}
    for role in ROLES:
        ids = sorted(w for w, rec in cur.workers.items() if rec.get("role") == role)
        loads = [cur.workers[w].get("load") or {} for w in ids]
        view = RoleView(role=role, workers=ids)
        view.kv_cache_usage = _scale(_mean(ld.get("kv_usage") for ld in loads))
        view.ttft_p90_ms = _max(ld.get("ttft_p90_ms") for ld in loads)
        view.itl_p90_ms = _max(ld.get("itl_p90_ms") for ld in loads)
        if role == "prefill":
            view.queue_length = None if cur.queue is None else float(cur.queue.get("depth", 0))
        else:
            view.queue_length = _mean(ld.get("waiting") for ld in loads)
            counts = [ld.get("running", 0) + ld.get("waiting", 0) for ld in loads]
            view.in_system = float(sum(counts)) if loads else None
        # Rates: each worker against its own earlier reading; workers without one are left out.
        pairs, spans, busy = [], [], []
        for w, ld in zip(ids, loads):
            got = _earlier(past, cur, w, min_span_s)
            if got is None:
                continue
            old, span = got
            pairs.append((ld, old))
            spans.append(span)
            b = _delta(ld, old, "busy_s")
            busy.append(None if b is None else min(1.0, b / span))

        def rate(key: str) -> float | None:
            timed = [(_delta(c, p, key), span) for (c, p), span in zip(pairs, spans)]
            parts = [d / span for d, span in timed if d is not None]
            return sum(parts) if parts else None

        view.utilization = _scale(_mean(busy))
        if view.utilization is None:  # no earlier reading yet: each worker's own window
            view.utilization = _scale(_mean(ld.get("busy") for ld in loads))
        gpu = [ld.get("gpu_util") for ld in loads]
        if loads and all(isinstance(g, (int, float)) for g in gpu):  # GPUs, as NVML sees them
            view.utilization, view.utilization_source = _scale(_mean(gpu)), "nvml"
        if pairs:
            view.interval_s = sum(spans) / len(spans)
            view.busy_s = _sum_deltas(pairs, "busy_s")
            if role == "prefill":
                view.tokens = _sum_deltas(pairs, "tokens")
                view.tasks = _sum_deltas(pairs, "tasks")
                view.tokens_per_s = rate("tokens")
                view.requests_per_s = rate("tasks")
            else:
                requests = _sum_deltas(pairs, "requests")
                out_tokens = _sum_deltas(pairs, "output_tokens")
                view.requests_per_s = rate("requests")
                view.tokens_per_s = rate("output_tokens")
                view.mean_output_tokens = _ratio(out_tokens, requests)
                view.mean_prompt_tokens = _ratio(_sum_deltas(pairs, "prompt_tokens"), requests)
                steps = _sum_deltas(pairs, "decode_steps")
                view.decode_batch = _ratio(_sum_deltas(pairs, "decode_seqs"), steps)
                view.decode_step_ms = _ratio(_sum_deltas(pairs, "decode_ms"), steps)
        views[role] = view
    growth = None
    if cur.queue is not None:
        for snap in reversed(past):
            if snap.queue is not None and cur.t - snap.t > 0 and cur.t - snap.t >= min_span_s:
                growth = (cur.queue.get("queued_tokens", 0) - snap.queue.get("queued_tokens", 0)) / (cur.t - snap.t)
                break
    return Observation(at=cur.t, prefill=views["prefill"], decode=views["decode"], queue=cur.queue,
                       backlog_growth_tokens_per_s=growth)


def _scale(fraction: float | None) -> float | None:
    """A 0-1 fraction as the policy's 0-100 percentage."""
    return None if fraction is None else round(100.0 * fraction, 2)
