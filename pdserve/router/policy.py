"""The router policy schema: every key an operator may write, with its default.

One YAML file (or the etcd key ``/pdserve/<cluster>/config/router``) holds two
top-level sections, ``router`` (offload decision and overrides) and ``qos``
(admission and degradation), described in docs/router.md. Both are
optional; an empty file is the all-defaults policy.

Defaults live here and nowhere else. Every model forbids unknown keys and is
strict (YAML ``"256"`` is not an integer), so a typo is an error naming the
key instead of a silently ignored setting. Models are frozen: a loaded policy
is swapped whole on reload, never edited in place.

Every key here has a reader in the router (``decide``, ``admit``, the
``CostModel``). A planned key that nothing reads yet (``router.worker_selection``)
is not in the schema: ``NOT_YET_USED`` refuses it with the reason and what to do,
so no operator believes a setting is live when it is not.

Units are in the key names: ``*_ms`` milliseconds, ``*_ms_per_token``
milliseconds per token, ``*_gb_per_s`` 10^9 bytes per second. Ratios used by
the router (``decode_kv_usage``, ``prefix_hit_ratio``, worker KV usage) are
fractions 0-1, not percentages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from pdserve.common.yaml_schema import YamlModel

Mode = Literal["always_local", "always_remote", "conditional"]
PolicyName = Literal["threshold", "score", "cost_model"]
ScoreMetric = Literal[
    "prefill_length",
    "prompt_length",
    "prefix_hit_ratio",
    "prefill_queue_depth",
    "prefill_queue_tokens",
    "decode_active_requests",
    "decode_kv_usage",
    "prefill_pool_size",
]
ScoreAction = Literal["prefer_remote", "prefer_local"]

# Score metrics that are fractions: a threshold above 1 is a percentage typo.
FRACTION_METRICS = frozenset({"prefix_hit_ratio", "decode_kv_usage"})


class StrictModel(YamlModel):
    """Base of every policy section (the one YAML base, common/yaml_schema.py): unknown keys
    and loose types are errors.

    A section written with no keys under it (``qos:`` followed by only
    comments) parses as YAML null; that means "all defaults", not an error.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_section_is_defaults(cls, data: Any) -> Any:
        return {} if data is None else data


# --- section 1: offload decision ------------------------------------------


class ThresholdParams(StrictModel):
    """Parameters of the ``threshold`` policy (the classic rule set)."""

    prefill_length_threshold: int = Field(256, ge=0)
    prefill_queue_max: int = Field(10, ge=0)
    decode_load_threshold: int = Field(8, ge=0)
    busy_min_length: int = Field(64, ge=0)


class ScoreRule(StrictModel):
    """One weighted vote of the ``score`` policy.

    The rule fires when ``metric >= threshold``; it then adds ``+weight``
    (``prefer_remote``) or ``-weight`` (``prefer_local``). The weight is a
    magnitude; the action gives the sign.
    """

    metric: ScoreMetric
    threshold: float = Field(ge=0)
    action: ScoreAction
    weight: float = Field(ge=0)

    @model_validator(mode="after")
    def _fraction_threshold(self) -> ScoreRule:
        if self.metric in FRACTION_METRICS and self.threshold > 1:
            raise ValueError(
                f"threshold for {self.metric} is a fraction 0-1, not a percentage "
                f"(got {self.threshold})"
            )
        return self


def _default_score_rules() -> list[ScoreRule]:
    # Long prompts go remote unless the queue is deep (docs/router.md; configs/router/score.yaml).
    return [
        ScoreRule(metric="prefill_length", threshold=256, action="prefer_remote", weight=0.7),
        ScoreRule(metric="prefill_queue_depth", threshold=10, action="prefer_local", weight=0.3),
    ]


class ScoreParams(StrictModel):
    """The ``disaggregated_router`` block, parameters of the ``score`` policy.

    Remote when the (rounded) sum of fired votes is strictly greater than
    ``remote_prefill_min_score``; a sum equal to it stays local. ``enable:
    false`` turns the score policy off: every request is prefilled locally.
    """

    enable: bool = True
    policies: list[ScoreRule] = Field(default_factory=_default_score_rules)
    remote_prefill_min_score: float = 0.5


class CostModelParams(StrictModel):
    """Parameters of the ``cost_model`` policy and seeds of the cost EMAs.

    The ``*_ms_per_token``, ``decode_step_ms``, ``transfer_*`` values are only
    seeds: the decode worker's CostModel replaces them with exponential moving
    averages of measured timings (weight ``ema_alpha`` per new sample).
    """

    prefill_local_ms_per_token: float = Field(0.1, gt=0)
    prefill_remote_ms_per_token: float = Field(0.1, gt=0)
    decode_ms_per_token: float = Field(1.0, gt=0)
    decode_step_ms: float = Field(25.0, gt=0)
    # The rest of a step's cost curve (with prefill_local_ms_per_token as its per-prompt-token
    # slope): step ms = step_fixed_ms + step_decode_ms_per_seq x decoding streams + prompt tokens
    # x prefill_local_ms_per_token + attention pairs / 1000 x prefill_attention_ms_per_kpair.
    # Seeds too: fitted from every step, and replaced at boot by the worker's calibration.
    step_fixed_ms: float = Field(10.0, ge=0)
    step_decode_ms_per_seq: float = Field(0.5, ge=0)
    # Attention: ms per 1000 (prompt token, earlier position) pairs (a prompt of n tokens has
    # n(n+1)/2): what makes a long prompt cost more per token than a short one.
    prefill_attention_ms_per_kpair: float = Field(0.0, ge=0)
    transfer_bandwidth_gb_per_s: float = Field(10.0, gt=0)
    transfer_setup_ms: float = Field(2.0, ge=0)
    # Cost charged for the decode stall a local prefill inflicts: this weight
    # x requests D is decoding x local prefill ms. 0 ignores the harm.
    itl_penalty_weight: float = Field(1.0, ge=0)
    # Cost charged for the requests expected to ARRIVE while a local prefill
    # occupies this worker: weight x arrival rate x local prefill ms x its
    # longest step ms / 2 (arrivals during the prefill, each waiting for the step
    # under way, half of it on average). Unchunked, that step is the whole
    # prefill (quadratic: short prompts barely pay it, long ones under steady
    # traffic do); chunked by the step plan, one chunk's step, so a long local
    # prefill no longer blocks arrivals. 0 ignores it (pure TTFT of this request).
    blocking_penalty_weight: float = Field(1.0, ge=0)
    # TPOT pressure: when the measured decode step is at least this fraction
    # of qos.tpot_slo_ms, every local prefill would push running requests
    # toward a TPOT miss, so prompts go remote whenever the remote route's
    # predicted TTFT still meets the TTFT SLO (the request's own, else
    # qos.ttft_slo_ms). 0 (the default) disables it: it pays only where the
    # prefill workers own separate compute (their own GPUs); on shared CPU
    # cores the remote path's own work slows decode as much (docs/PERFORMANCE.md).
    tpot_pressure_fraction: float = Field(0.0, ge=0)
    # Remote must beat local by strictly more than this to be chosen.
    min_gain_ms: float = Field(5.0, ge=0)
    ema_alpha: float = Field(0.2, gt=0, le=1)
    # One sample moves an estimate at most as far as this factor x (or 1/factor x) the
    # estimate itself, so one pathological request (a step slowed 100x) cannot poison
    # routing and admission; a real, lasting change still gets there in a few samples.
    ema_outlier_factor: float = Field(4.0, ge=1)
    # A route's TTFT residual learns only from requests that took that route, so one bad run of
    # samples could lock routing onto the other route for good (nothing would correct it). Once
    # a route's residual has gone this many TTFT samples of the other route without one of its
    # own, it halves toward 0 (the formula's own prediction) every further this many, and the
    # route is tried again when the formula says it wins. 0 never decays.
    residual_stale_after: int = Field(16, ge=0)
    # Seed of what loading a LoRA adapter takes a prefill worker that does not hold it (read from
    # its path and checked, engine/lora.py): the remote prediction of a request under an adapter
    # no prefill worker holds adds it. Measured from then on (each PrefillDone that loaded one).
    lora_load_ms: float = Field(50.0, ge=0)


class Overrides(StrictModel):
    """Request-class overrides of the conditional policy (docs/router.md, ``overrides``).

    The third override, "low priority kept local when the pool is busy", is
    switched by ``qos.degrade.no_remote_prefill_for_low_priority_when_busy``
    (one knob, in the QoS block);
    ``busy_queue_depth_per_worker`` below defines "busy" for it.
    """

    # High priority jumps the priority-ordered prefill queue, so the queue
    # checks (threshold's prefill_queue_max, score's queue metrics, the cost
    # model's remote queue wait) see an empty queue for it.
    high_priority_bypass_queue: bool = True
    # No live prefill worker: everything is prefilled locally.
    empty_pool_local: bool = True
    # The pool is busy when queue depth >= this x prefill_pool_size.
    busy_queue_depth_per_worker: float = Field(2.0, gt=0)


class RouterSection(StrictModel):
    """The ``router`` block: mode, offload policy, overrides.

    ``mode`` ``always_local`` / ``always_remote`` fix the route (except that a
    fully cached prompt or an empty pool is always local); ``conditional``
    applies the overrides and then the policy named by ``policy``. Parameter
    blocks of policies not selected are validated and kept, so switching
    ``policy`` is a one-word edit.
    """

    mode: Mode = "conditional"
    policy: PolicyName = "cost_model"
    threshold: ThresholdParams = ThresholdParams()
    disaggregated_router: ScoreParams = ScoreParams()
    cost_model: CostModelParams = CostModelParams()
    overrides: Overrides = Overrides()


# --- section 3: QoS --------------------------------------------------------


class Degrade(StrictModel):
    """What an admitted low-priority request gives up under pressure."""

    # Cap on max_tokens of low-priority requests while the worker is under
    # pressure (see qos.admit); null disables the cap.
    low_priority_max_tokens: int | None = Field(200, ge=1)
    no_remote_prefill_for_low_priority_when_busy: bool = True


class QosPolicy(StrictModel):
    """The ``qos`` block: admission, refusal and degradation (section 3).

    The defaults admit every request the worker can serve and refuse only what would hurt
    the requests already admitted: a predicted queue wait over ``max_queue_wait_ms``, or a
    prompt the KV pool cannot hold without evicting running streams (docs/router.md, "How the
    defaults were chosen"). The SLOs steer the step plan and the router; refusing a request
    because its own predicted TTFT misses the SLO is opt-in (``reject_on_slo_violation``).
    """

    ttft_slo_ms: float = Field(1000.0, gt=0)
    tpot_slo_ms: float = Field(50.0, gt=0)
    enable_early_rejection: bool = True
    reject_on_slo_violation: bool = False
    low_priority_threshold_ms: float = Field(1000.0, gt=0)
    max_queue_wait_ms: float = Field(2000.0, gt=0)
    # Refuse (kv_pool_full) a prompt that would not fit in the KV pool's free blocks (with the
    # prompts already waiting) while streams hold the rest: admitted, it would only preempt them.
    reject_when_kv_full: bool = True
    # Before that refusal, the prompt waits up to this long (from its arrival; prompts held
    # this way are served in arrival order) for the running streams to free room, and is
    # admitted once it fits, as vLLM queues it. 0: refuse at once (the behaviour before).
    kv_full_wait_ms: float = Field(1000.0, ge=0)
    # Tokens one tenant (an API key; with keys off a client address) may claim on a worker with
    # all its calls in flight together: each prompt's tokens + max_tokens of each of its
    # sequences (a request without max_tokens claims the rest of the context). A call that would
    # take its tenant past it is refused before any of its sequences is admitted
    # (router/qos.py admit_tenant_tokens). null: twice the worker's KV pool (router/qos.py
    # DEFAULT_TENANT_POOLS: a pool's worth running and as much again waiting for room). Whatever
    # enable_early_rejection says, and for every priority: with keys off any client may send
    # priority high.
    max_tokens_per_tenant: int | None = Field(None, ge=1)
    degrade: Degrade = Degrade()


# --- keys refused until something reads them -----------------------------------

# Key path -> why it is refused and what to do. The loader reports these instead
# of a bare "unknown key" (pdserve policy check, reloads from file or etcd).
NOT_YET_USED: dict[tuple[str, ...], str] = {
    ("router", "worker_selection"): (
        "not used yet: prefill workers pull tasks from one shared queue, so a decode worker "
        "never chooses a prefill worker, and no other component picks a worker by policy "
        "(per-pool worker selection has no caller in pdserve). Setting it would change nothing; "
        "delete the worker_selection block from this file"
    ),
}


class RouterPolicy(StrictModel):
    """A whole router policy file: ``router`` + ``qos``."""

    router: RouterSection = RouterSection()
    qos: QosPolicy = QosPolicy()


DEFAULT_POLICY = RouterPolicy()
