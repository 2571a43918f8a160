"""What `LLMEngine` (llm_engine.py) hands its callers: each step's `RequestDelta`s, the
errors of a step (`StepError`, `EngineStateError`), its load and its counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestDelta:
    """What one step added to a request (for streaming)."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    error: str | None = None  # with finish_reason "error": why this request failed
    # on the first token's delta when prompt_logprobs was asked: an entry per prompt token, the
    # first without a logprob (engine/prompt_logprobs.py `reported`)
    prompt_logprobs: list[dict] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepError(RuntimeError):
    """The forward pass of a step failed. ``request_ids`` were in that step; the engine
    left them as they were before it (the caller decides: abort them or retry)."""

    def __init__(self, cause: BaseException, request_ids: list[str]):
        super().__init__(f"engine step failed: {cause.__class__.__name__}: {cause}")
        self.cause = cause
        self.request_ids = request_ids


class EngineStateError(RuntimeError):
    """The engine's own state failed (the scheduler, the block pool), not one request's:
    its serving loop must stop and the worker be replaced (decode/async_engine.py)."""


@dataclass(frozen=True)
class EngineLoad:
    """What a worker reports about its engine's load (registry record, status, metrics)."""

    running: int
    waiting: int
    awaiting_remote_kv: int  # requests whose prompt KV another worker is writing
    num_blocks: int
    num_free_blocks: int
    kv_usage: float  # fraction of the KV pool in use


@dataclass
class EngineStats:
    """Counters that tests and metrics read."""

    num_prompt_tokens_computed: int = 0  # prompt positions this engine ran through the model
    num_prompt_tokens_cached: int = 0  # prompt positions served by the prefix cache
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_failed: int = 0  # requests finished with "error" (their sampling or detokenization raised)
    # Speculative decoding (engine/spec_decode.py): verifications, tokens proposed in them, those
    # accepted, and how often the proposal at each position (0 first) was accepted.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    num_spec_cost_off_steps: int = 0  # decode steps the measured-cost rule kept plain (engine/spec_cost.py)
    # Remote prompts of a draft model's engine: their draft KV shipped by the prefill worker, or
    # computed here (speculative_config.draft_prompt_kv; engine/kv_connector.py remote_ready)
    num_spec_prompts_shipped: int = 0
    num_spec_prompts_local: int = 0
    # Planned steps with prompt tokens to place, by the step plan's rule (engine/step_budget.py
    # RULES): the scheduler's own dict, every rule's key there from the start
    step_plan_rules: dict[str, int] = field(default_factory=dict)
