"""The autoscale policy schema (docs/planner.md, "Policy keys"): per-role replica bounds
and thresholds, loop timing, step and GPU budget.

A policy file of its own (`configs/autoscale/*.yaml`, top-level `autoscale`), parsed by
router/loader.py (`parse_autoscale`, `load_autoscale_file`) with the same line-numbered errors
as the router's policy, and read by `pdserve policy check`. The scaling loop itself (scale up
when any up-threshold holds, down when all down-thresholds hold, bounded by replicas,
``max_step``, ``cooldown_s`` and ``gpu_budget``) is the planner's (cluster/planner/decide.py);
this module makes sure what it is handed is coherent.

Unlike the router's fractions, autoscale utilisations are percentages 0-100
(``gpu_utilization: 80``); a value between 0 and 1 is refused as a fraction typo.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdserve.router.policy import StrictModel


class ScaleThresholds(StrictModel):
    """Metric thresholds of one scaling direction; unset metrics are ignored."""

    queue_length: int | None = Field(None, ge=0)
    gpu_utilization: float | None = Field(None, ge=0, le=100)
    kv_cache_usage: float | None = Field(None, ge=0, le=100)

    @model_validator(mode="after")
    def _check(self) -> ScaleThresholds:
        values = self.set_values()
        if not values:
            raise ValueError(
                "set at least one of queue_length, gpu_utilization, kv_cache_usage"
            )
        for name in ("gpu_utilization", "kv_cache_usage"):
            value = values.get(name)
            if value is not None and 0 < value < 1:
                raise ValueError(
                    f"{name} is a percentage 0-100; {value} looks like a fraction "
                    f"(write {value * 100:g})"
                )
        return self

    def set_values(self) -> dict[str, float]:
        """The thresholds that are set, by metric name."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


class RoleScaling(StrictModel):
    """Replica bounds and thresholds for one role (prefill or decode)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    # GPUs one replica occupies (tensor parallel size); counts against gpu_budget.
    gpus_per_replica: int = Field(1, ge=1)
    scale_up: ScaleThresholds
    scale_down: ScaleThresholds

    @model_validator(mode="after")
    def _check(self) -> RoleScaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        up, down = self.scale_up.set_values(), self.scale_down.set_values()
        for metric in up.keys() & down.keys():
            # Down at or above up would scale up and down on the same reading.
            if down[metric] >= up[metric]:
                raise ValueError(
                    f"scale_down.{metric} ({down[metric]:g}) must be below "
                    f"scale_up.{metric} ({up[metric]:g})"
                )
        return self


class PrefillScaling(RoleScaling):
    """Prefill pool scaling; the defaults are the documented ones (docs/planner.md, "Policy keys")."""

    max_replicas: int = Field(12, ge=1)
    scale_up: ScaleThresholds = ScaleThresholds(queue_length=8, gpu_utilization=80)
    scale_down: ScaleThresholds = ScaleThresholds(queue_length=2, gpu_utilization=40)


class DecodeScaling(RoleScaling):
    """Decode pool scaling; the defaults are the documented ones (docs/planner.md, "Policy keys")."""

    max_replicas: int = Field(24, ge=1)
    scale_up: ScaleThresholds = ScaleThresholds(queue_length=16, kv_cache_usage=75)
    scale_down: ScaleThresholds = ScaleThresholds(queue_length=4, kv_cache_usage=30)


class SlaTargets(StrictModel):
    """SLA mode: the latency targets, and how close to them the planner may run.

    Per-worker capacity is learned online from the workers' own figures: prefill
    tokens per busy second, and decode sequences a worker holds at the ITL target.
    Until a role has been measured, the optional priors stand in for it.
    """

    ttft_ms: float = Field(gt=0)
    itl_ms: float = Field(gt=0)
    # Run each worker at most this busy: queueing delay grows without bound near 1.
    max_utilization: float = Field(0.8, gt=0, le=1)
    # Scale down only when the load would fit in fewer replicas with this much room to
    # spare (0.2: the smaller pool at most 80% of what it can take): no flapping at a boundary.
    hysteresis: float = Field(0.2, ge=0, lt=1)
    prefill_tokens_per_s: float | None = Field(None, gt=0)  # prior: one prefill worker's throughput
    decode_seqs_per_worker: float | None = Field(None, gt=0)  # prior: sequences one decode worker holds at itl_ms


class AutoscaleSection(StrictModel):
    """The ``autoscale`` block."""

    prefill: PrefillScaling = PrefillScaling()
    decode: DecodeScaling = DecodeScaling()
    # threshold: the scale_up/scale_down thresholds; sla: replicas computed from `sla` targets.
    mode: Literal["threshold", "sla"] = "threshold"
    sla: SlaTargets | None = None
    interval_s: float = Field(10.0, gt=0)
    cooldown_s: float = Field(60.0, ge=0)
    # Scale down only once the down condition has held this long without a break (like the
    # Kubernetes HPA's scale-down stabilization window): a lull is not a trend.
    down_stable_s: float = Field(30.0, ge=0)
    max_step: int = Field(1, ge=1)
    gpu_budget: int = Field(32, ge=1)
    # A scale-down drains: the worker finishes what it holds; past this it is stopped anyway.
    drain_timeout_s: float = Field(120.0, gt=0)
    # A new worker that is not registered within this is counted as failed (and retried).
    start_timeout_s: float = Field(300.0, gt=0)
    # When one role scales up while the other scales down in the same decision, move workers
    # from one role to the other in place (drain, re-register, serve) instead of stopping one
    # and starting another: no weights reloaded. Needs the default worker entry points.
    allow_role_flip: bool = True

    @model_validator(mode="after")
    def _check(self) -> AutoscaleSection:
        if self.mode == "sla" and self.sla is None:
            raise ValueError("mode: sla needs an `sla` block with ttft_ms and itl_ms")
        floor = (
            self.prefill.min_replicas * self.prefill.gpus_per_replica
            + self.decode.min_replicas * self.decode.gpus_per_replica
        )
        if floor > self.gpu_budget:
            raise ValueError(
                f"the minimum replicas need {floor} GPUs, more than gpu_budget ({self.gpu_budget})"
            )
        return self


class AutoscalePolicy(StrictModel):
    """A whole autoscale policy file: one ``autoscale`` block."""

    autoscale: AutoscaleSection = AutoscaleSection()
