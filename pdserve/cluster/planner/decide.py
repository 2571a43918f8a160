"""The planner's decisions: pure functions from (policy, observation, memory) to a target.

Threshold mode (docs/planner.md, "How it decides"): a role scales up by `max_step` when ANY of
its up-thresholds holds, down when ALL of its down-thresholds hold. SLA mode
computes the replicas each role needs from the latency targets and the capacity
learned from the workers' own figures (`learn`), with hysteresis on the way down.
Both are then bounded the same way: `min_replicas`/`max_replicas`, `max_step`,
`cooldown_s` per role (a role below its minimum is repaired at once), and
`gpu_budget` over both roles (replicas x units, where a unit is a GPU, or a CPU on
a CPU cluster). Every `Decision` carries the figures and one line per step of
its reasoning: the planner logs and records them, `pdserve planner explain`
prints them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, TypeAlias

from pdserve.cluster.planner.observe import Observation, RoleView

# The policy is the router package's `AutoscaleSection` (cluster/planner/policy.py): the control
# plane does not import the router, it is handed a parsed policy (see cluster/planner/core.py), and
# reads its fields: prefill/decode (min_replicas, max_replicas, scale_up/scale_down
# thresholds with `set_values()`), mode, sla, max_step, cooldown_s, gpu_budget.
AutoscaleSection: TypeAlias = Any
RoleScaling: TypeAlias = Any
SlaTargets: TypeAlias = Any

EWMA_ALPHA = 0.3  # weight of a new capacity sample
MIN_BUSY_SAMPLE_S = 0.5  # a prefill capacity sample needs this much work behind it
DECODE_POINTS = 32  # (batch, step ms) points kept for the decode step-time fit
MIN_UTILIZATION = 0.05  # the lowest target utilisation SLA mode plans for

_METRICS = {"queue_length": "queue_length", "gpu_utilization": "utilization", "kv_cache_usage": "kv_cache_usage"}


@dataclass
class Memory:
    """What the planner learns and remembers across ticks (persisted in etcd with its state)."""

    last_action_at: dict[str, float] = field(default_factory=dict)  # role -> wall time of its last action
    down_since: dict[str, float] = field(default_factory=dict)  # role -> since when its down condition holds
    prefill_tokens_per_busy_s: float | None = None  # EWMA of one prefill worker's throughput
    prefill_task_tokens: float | None = None  # EWMA of prompt tokens per prefill task
    decode_points: list[list[float]] = field(default_factory=list)  # recent [mean batch, mean step ms]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: dict | None) -> "Memory":
        body = body or {}
        known = {k: body[k] for k in ("last_action_at", "down_since", "prefill_tokens_per_busy_s",
                                      "prefill_task_tokens", "decode_points") if k in body}
        return cls(**known)


@dataclass
class Decision:
    """One role's decision at one tick."""

    role: str
    mode: str
    current: int  # replicas counted: serving + starting (draining ones are leaving)
    desired: int
    action: str  # "up" | "down" | "hold"
    reason: str  # short label (metrics, logs): threshold_up, sla_down, cooldown, budget, ...
    explanation: list[str]
    figures: dict
    at: float

    @property
    def step(self) -> int:
        return self.desired - self.current

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        arrow = {"up": "scale up", "down": "scale down", "hold": "hold"}[self.action]
        return f"{self.role}: {arrow} {self.current} -> {self.desired} ({self.reason})"


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * sample


def learn(memory: Memory, obs: Observation) -> None:
    """Fold this interval's capacity samples into `memory`."""
    p = obs.prefill
    if p.busy_s is not None and p.busy_s >= MIN_BUSY_SAMPLE_S and p.tokens:
        memory.prefill_tokens_per_busy_s = _ewma(memory.prefill_tokens_per_busy_s, p.tokens / p.busy_s)
    if p.tasks and p.tokens:
        memory.prefill_task_tokens = _ewma(memory.prefill_task_tokens, p.tokens / p.tasks)
    d = obs.decode
    if d.decode_batch and d.decode_step_ms:
        memory.decode_points.append([round(d.decode_batch, 3), round(d.decode_step_ms, 3)])
        del memory.decode_points[:-DECODE_POINTS]


def decode_step_model(points: list[list[float]]) -> tuple[float, float] | None:
    """(fixed ms, ms per sequence) of a decode step, fitted to recent (batch, step ms) points:
    least squares when the batches spread by at least one sequence, else proportional
    (all of the step is per-sequence work: conservative, it under-states capacity)."""
    if not points:
        return None
    bs = [p[0] for p in points]
    ss = [p[1] for p in points]
    if max(bs) - min(bs) >= 1.0:
        n = len(points)
        mb, ms = sum(bs) / n, sum(ss) / n
        var = sum((b - mb) ** 2 for b in bs)
        k = sum((b - mb) * (s - ms) for b, s in zip(bs, ss)) / var
        a = ms - k * mb
        if k > 0 and a >= 0:
            return a, k
    k = sum(ss) / sum(bs)
    return 0.0, k


# -- the target of one role ---------------------------------------------------------------
def _threshold_target(scaling: RoleScaling, view: RoleView, current: int, step: int) -> tuple[int, str, list[str]]:
    lines = []
    up_hits = []
    for metric, threshold in scaling.scale_up.set_values().items():
        value = getattr(view, _METRICS[metric])
        held = value is not None and value >= threshold
        lines.append(f"scale_up.{metric}: {_fmt(value)} {'>=' if held else '<'} {threshold:g}"
                     + (" (holds)" if held else ""))
        if held:
            up_hits.append(metric)
    if up_hits:
        lines.append(f"up: {', '.join(up_hits)} hold{'s' if len(up_hits) == 1 else ''} (any one is enough)")
        return current + step, "threshold_up", lines
    down_all = True
    for metric, threshold in scaling.scale_down.set_values().items():
        value = getattr(view, _METRICS[metric])
        held = value is not None and value <= threshold
        down_all &= held
        lines.append(f"scale_down.{metric}: {_fmt(value)} {'<=' if held else '>'} {threshold:g}"
                     + (" (holds)" if held else "" if value is not None else " (not measured)"))
    if down_all:
        lines.append("down: every scale_down threshold holds")
        return current - step, "threshold_down", lines
    lines.append("no up-threshold holds and not every down-threshold holds: steady")
    return current, "steady", lines


def _sla_prefill(sla: SlaTargets, view: RoleView, obs: Observation, memory: Memory) -> tuple[float, float, dict] | str:
    """(demand in tokens/s, one worker's planned tokens/s, figures), or why it cannot be computed."""
    mu = memory.prefill_tokens_per_busy_s or sla.prefill_tokens_per_s
    if not mu:
        return "no prefill capacity measured yet (and no sla.prefill_tokens_per_s prior)"
    queued = float((obs.queue or {}).get("queued_tokens", 0))
    served = view.tokens_per_s or 0.0
    growth = max(0.0, obs.backlog_growth_tokens_per_s or 0.0)
    target_s = sla.ttft_ms / 1e3
    demand = served + growth + queued / target_s
    task_tokens = memory.prefill_task_tokens or 0.0
    service_s = task_tokens / mu
    util = min(sla.max_utilization, max(MIN_UTILIZATION, 1.0 - service_s / target_s))
    return demand, mu * util, {
        "demand_tokens_per_s": round(demand, 1), "served_tokens_per_s": round(served, 1),
        "backlog_growth_tokens_per_s": round(growth, 1), "queued_tokens": queued,
        "worker_tokens_per_busy_s": round(mu, 1), "mean_task_tokens": round(task_tokens, 1),
        "service_ms": round(service_s * 1e3, 1), "target_utilization": round(util, 3),
    }


def _sla_decode(sla: SlaTargets, view: RoleView, memory: Memory) -> tuple[float, float, dict] | str:
    """(demand in sequences, sequences one worker is planned to hold, figures), or why not."""
    model = decode_step_model(memory.decode_points)
    itl = sla.itl_ms
    fixed: float | None
    per_seq: float | None
    if model is not None:
        fixed, per_seq = model
        seqs = (itl - fixed) / per_seq if itl > fixed else 1.0
    elif sla.decode_seqs_per_worker:
        fixed = per_seq = None
        seqs = sla.decode_seqs_per_worker
    else:
        return "no decode step time measured yet (and no sla.decode_seqs_per_worker prior)"
    seqs = max(1.0, seqs)
    rate = view.requests_per_s or 0.0
    out = view.mean_output_tokens or 0.0
    little = rate * out * itl / 1e3  # sequences in flight when each decodes at the ITL target
    demand = max(little, view.in_system or 0.0)
    return demand, seqs * sla.max_utilization, {
        "demand_sequences": round(demand, 2), "littles_law_sequences": round(little, 2),
        "in_system": view.in_system, "requests_per_s": round(rate, 3), "mean_output_tokens": round(out, 1),
        "step_fixed_ms": None if fixed is None else round(fixed, 3),
        "step_ms_per_sequence": None if per_seq is None else round(per_seq, 4),
        "worker_sequences_at_itl": round(seqs, 1),
    }


def _sla_target(sla: SlaTargets, role: str, view: RoleView, obs: Observation, memory: Memory,
                current: int) -> tuple[int | None, str, list[str], dict]:
    got = _sla_prefill(sla, view, obs, memory) if role == "prefill" else _sla_decode(sla, view, memory)
    if isinstance(got, str):
        return None, "no_capacity_yet", [got], {}
    demand, per_worker, figures = got
    unit = "tokens/s" if role == "prefill" else "sequences"
    need_up = math.ceil(demand / per_worker - 1e-9) if demand > 0 else 0
    need_down = math.ceil(demand * (1 + sla.hysteresis) / per_worker - 1e-9) if demand > 0 else 0
    figures.update(need=need_up, need_with_hysteresis=need_down)
    lines = [", ".join(f"{k}={v}" for k, v in figures.items() if v is not None),
             f"need = ceil({demand:.1f} {unit} / {per_worker:.1f} per worker) = {need_up}"]
    if need_up > current:
        lines.append(f"{need_up} > {current} replicas: up")
        return need_up, "sla_up", lines, figures
    if need_down < current:
        lines.append(f"with {sla.hysteresis:g} hysteresis the load fits {need_down} < {current} replicas: down")
        return need_down, "sla_down", lines, figures
    lines.append(f"{current} replicas fit the load (down only below {need_down} with hysteresis): steady")
    return current, "steady", lines, figures


# -- both roles, bounded ------------------------------------------------------------------
def decide(policy: AutoscaleSection, obs: Observation, memory: Memory, *, current: dict[str, int],
           units: dict[str, int], now: float, in_progress: dict[str, int] | None = None) -> list[Decision]:
    """One decision per role (prefill first: it is decided against the budget first).
    `in_progress[role]`: starts and drains of the role not finished yet; while there are any,
    the role holds (a new worker's capacity is not measured yet, a draining one's still is)."""
    in_progress = in_progress or {}
    out = []
    used = {role: current[role] * units[role] for role in ("prefill", "decode")}
    for role in ("prefill", "decode"):
        scaling: RoleScaling = getattr(policy, role)
        view = obs.role(role)
        cur = current[role]
        figures: dict = {"replicas": cur, "queue_length": view.queue_length, "utilization": view.utilization,
                         "utilization_source": view.utilization_source,
                         "kv_cache_usage": view.kv_cache_usage, "ttft_p90_ms": view.ttft_p90_ms,
                         "itl_p90_ms": view.itl_p90_ms}
        if policy.mode == "sla":
            want, reason, lines, extra = _sla_target(policy.sla, role, view, obs, memory, cur)
            figures.update(extra)
            if want is None:
                want = cur
        else:
            want, reason, lines = _threshold_target(scaling, view, cur, policy.max_step)
        desired = want
        last = memory.last_action_at.get(role)
        if want < cur:
            since = memory.down_since.setdefault(role, now)
        else:
            memory.down_since.pop(role, None)
        stable_s = getattr(policy, "down_stable_s", 0.0)
        if cur < scaling.min_replicas:
            desired, reason = scaling.min_replicas, "below_min"
            lines.append(f"{cur} replicas < min_replicas {scaling.min_replicas}: repair at once (no cooldown)")
        elif cur > scaling.max_replicas:
            desired, reason = scaling.max_replicas, "above_max"
            lines.append(f"{cur} replicas > max_replicas {scaling.max_replicas}")
        elif desired < cur and view.interval_s is None:
            lines.append(f"no {role} rates measured yet (a worker's record refreshes every few seconds): "
                         "no scale-down on start-up figures")
            desired, reason = cur, "no_data"
        elif desired < cur and cur > scaling.min_replicas and now - since < stable_s:
            lines.append(f"down condition held {now - since:.0f} s < down_stable_s {stable_s:g}: wait")
            desired, reason = cur, "stabilizing"
        elif desired != cur and in_progress.get(role, 0) > 0:
            lines.append(f"{in_progress[role]} start(s)/drain(s) of {role} still in progress: wait for them")
            desired, reason = cur, "in_progress"
        elif desired != cur and last is not None and now - last < policy.cooldown_s:
            lines.append(f"cooldown: last {role} action {now - last:.0f} s ago < cooldown_s {policy.cooldown_s:g}")
            desired, reason = cur, "cooldown"
        else:
            bounded = max(scaling.min_replicas, min(scaling.max_replicas, desired))
            if bounded != desired:
                lines.append(f"{desired} bounded to [{scaling.min_replicas}, {scaling.max_replicas}] -> {bounded}")
                if bounded == cur:
                    reason = "at_max" if desired > cur else "at_min"
            desired = bounded
            stepped = max(cur - policy.max_step, min(cur + policy.max_step, desired))
            if stepped != desired:
                lines.append(f"max_step {policy.max_step}: {cur} -> {stepped} now (target {desired})")
            desired = stepped
        if desired > cur:
            other = sum(v for r, v in used.items() if r != role)
            room = (policy.gpu_budget - other) // units[role]
            if desired > room:
                lines.append(f"gpu_budget {policy.gpu_budget}: {other} units used by the other role, "
                             f"{units[role]} per {role} replica: at most {room} replicas")
                desired = max(cur, room)
                if desired == cur:
                    reason = "budget"
        used[role] = desired * units[role]
        action = "up" if desired > cur else "down" if desired < cur else "hold"
        out.append(Decision(role=role, mode=policy.mode, current=cur, desired=desired, action=action,
                            reason=reason, explanation=lines, figures=figures, at=now))
    if getattr(policy, "allow_role_flip", False):
        _pair_flips(out)
    return out


def _pair_flips(decisions: list[Decision]) -> None:
    """One role up and the other down in the same decision: move workers across instead
    (each flip is one of the down role's workers re-registering as the up role)."""
    by = {d.role: d for d in decisions}
    for up, down in ((by["prefill"], by["decode"]), (by["decode"], by["prefill"])):
        if up.action == "up" and down.action == "down":
            n = min(up.step, -down.step)
            for d, other in ((up, down), (down, up)):
                d.figures["flip"] = n
                d.explanation.append(f"role flip: {n} {down.role} worker(s) move to {up.role} in place "
                                     "(allow_role_flip; no weights reloaded)")
            up.reason = down.reason = "role_flip"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"
