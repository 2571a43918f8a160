"""Sampling parameters, request state and request outputs."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.common import Priority

if TYPE_CHECKING:
    import torch
    from .lora_request import LoRARequest
    from .structured_state import RequestGrammar

# Temperatures below this sample greedily: logits / 1e-40 overflow float32 to inf and the
# softmax turns into NaN. vLLM uses the same threshold (_SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4  # far above any useful value; the bound keeps the arithmetic finite
MAX_REPETITION_PENALTY = 1e4
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1


@dataclass(frozen=True)
class RequestLimits:
    """Per-request size limits, checked before any work (the edge refuses in O(limit))."""

    max_stop_strings: int = 64
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # entries of logit_bias
    max_bad_words: int = 128
    max_allowed_token_ids: int = 1 << 20


def check_text(field_name: str, text: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate such as JSON "\\ud800"
    parses into a Python str, and the tokenizer then raises a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            field_name, f"is not valid Unicode text (unpaired surrogate at character {exc.start})") from None


def _token_key(k):
    """A logit_bias key as a token id ("5" -> 5); anything else stays as given for validate()."""
    if isinstance(k, str) and k.isdigit() and len(k) < 20:
        return int(k)
    return k


class InvalidRequestError(ValueError):
    """A request or sampling parameter is invalid; ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (vLLM-compatible names)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the sampled one)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # -- logits controls (engine/sampler.py), vLLM's names and meanings --
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability (0: off)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # never generate these words (their last token is masked)
    prompt_logprobs: int | None = None  # logprobs of each prompt token (and the N most likely)
    # -- structured output (engine/structured.py): vLLM's `StructuredOutputsParams` as a dict with
    # exactly one of json / regex / choice / grammar / json_object / structural_tag (None: free text)
    structured_outputs: dict | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Anything else that is not a list stays as given: validate() names it.
        if self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.bad_words is None or isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words or [])
        if isinstance(self.logit_bias, dict):
            # msgpack maps on the wire have string keys ("5": 1.0, as OpenAI sends them): back to ids
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or below `GREEDY_TEMPERATURE` where dividing the
        logits by it would overflow float32 (vLLM treats such temperatures the same way)."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None, limits: "RequestLimits | None" = None) -> None:
        """Raise `InvalidRequestError` naming the first bad field.

        Every number must have its JSON type (a bool is not an int, a string is
        neither) and be finite: one request's NaN must never reach the sampler.
        """
        lim = limits or RequestLimits()

        def bad(name, msg):
            raise InvalidRequestError(name, msg)

        def number(name, lo, hi, lo_open=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                bad(name, f"must be a number, got {type(v).__name__}")
            if not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
            if v < lo or (lo_open and v == lo) or v > hi:
                bad(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")

        def integer(name, lo, hi):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, f"must be an integer, got {type(v).__name__}")
            if not lo <= v <= hi:
                bad(name, f"must be an integer in [{lo}, {hi}], got {v!r}")

        integer("max_tokens", 1, INT64_MAX)
        number("temperature", 0.0, MAX_TEMPERATURE)
        number("top_p", 0.0, 1.0, lo_open=True)
        integer("top_k", -1, INT64_MAX)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, MAX_REPETITION_PENALTY, lo_open=True)
        if self.logprobs is not None:
            integer("logprobs", 0, 20)
        if self.seed is not None:
            integer("seed", INT64_MIN, UINT64_MAX)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be a boolean, got {type(getattr(self, name)).__name__}")
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), list):
                bad(name, f"must be a list, got {type(getattr(self, name)).__name__}")
        if len(self.stop) > lim.max_stop_strings:
            bad("stop", f"{len(self.stop)} stop strings; at most {lim.max_stop_strings} are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", "stop strings must be non-empty strings")
            if len(s) > lim.max_stop_chars:
                bad("stop", f"a stop string has {len(s)} characters; at most {lim.max_stop_chars} are allowed")
            check_text("stop", s)
        if len(self.stop_token_ids) > lim.max_stop_token_ids:
            bad("stop_token_ids", f"{len(self.stop_token_ids)} ids; at most {lim.max_stop_token_ids} are allowed")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids", f"{t!r} is not a token id of this model")

        number("min_p", 0.0, 1.0)
        integer("min_tokens", 0, self.max_tokens)
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", 0, 20)
        self._validate_token_controls(vocab_size, lim)

    def _validate_token_controls(self, vocab_size: int | None, lim: RequestLimits) -> None:
        """bad_words, logit_bias, allowed_token_ids and structured_outputs (its shape only:
        engine/structured.py checks the grammar itself)."""

        def bad(name, msg):
            raise InvalidRequestError(name, msg)

        if not isinstance(self.bad_words, list):
            bad("bad_words", f"must be a list, got {type(self.bad_words).__name__}")
        if len(self.bad_words) > lim.max_bad_words:
            bad("bad_words", f"{len(self.bad_words)} words; at most {lim.max_bad_words} are allowed")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                bad("bad_words", "bad words must be non-empty strings")
            if len(w) > lim.max_stop_chars:
                bad("bad_words", f"a bad word has {len(w)} characters; at most {lim.max_stop_chars} are allowed")
            check_text("bad_words", w)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", f"must be a map of token id to bias, got {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > lim.max_logit_bias:
                bad("logit_bias", f"{len(self.logit_bias)} entries; at most {lim.max_logit_bias} are allowed")
            for t, v in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                    bad("logit_bias", f"{t!r} is not a token id of this model")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                        or not -100.0 <= v <= 100.0:
                    bad("logit_bias", f"the bias of token {t} must be a number in [-100, 100], got {v!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                bad("allowed_token_ids", "must be a non-empty list of token ids")
            if len(self.allowed_token_ids) > lim.max_allowed_token_ids:
                bad("allowed_token_ids", f"{len(self.allowed_token_ids)} ids; at most "
                    f"{lim.max_allowed_token_ids} are allowed")
            for t in self.allowed_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                    bad("allowed_token_ids", f"{t!r} is not a token id of this model")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, dict):
            bad("structured_outputs", f"must be an object, got {type(self.structured_outputs).__name__}")

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if self.logit_bias is not None:  # string keys: msgpack's strict map keys, and OpenAI's JSON
            d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequestError(sorted(unknown)[0], "unknown sampling parameter")
        return cls(**d)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    LOADING_KV = "loading_kv"  # its prefix is being loaded back from the second tier (engine/kv_tier.py)
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request's sampling or detokenization failed; the engine went on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


_arrival_counter = itertools.count()


class Request:
    """One generation request inside the engine: tokens, progress, status."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = Priority.NORMAL, arrival: float | None = None, cache_salt: bytes | None = None,
                 tenant: str | None = None):
        self.request_id = request_id
        # Whose request it is (the API key's identity; None: keys off): the scheduler shares the
        # sequence slots fairly among the tenants that wait (engine/scheduler.py).
        self.tenant = tenant
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.priority = priority  # lower value = more urgent
        self.arrival = next(_arrival_counter) if arrival is None else arrival
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first schedule
        self.num_preemptions = 0
        self.logprobs: list[dict | None] | None = [] if params.logprobs is not None else None
        # vLLM's prompt_logprobs: one entry per prompt token after the first, filled as the chunks
        # of its prompt run (engine/prompt_logprobs.py); None when not asked (or, for a resumed
        # stream, already sent by the first worker).
        self.prompt_logprobs: list[dict] | None = [] if params.prompt_logprobs is not None else None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            import torch  # (here: parsing a request's parameters does not load torch)

            self.generator = torch.Generator().manual_seed(params.seed)
        self.finish_reason: str | None = None
        # Prefill role: keep the KV blocks after finishing until the connector's
        # `release_export` (they are read by the transfer to the decode worker).
        self.keep_kv = False
        # ... and its speculative head's prompt rows are asked with it (engine/spec_eagle.py): the
        # head computes them from each step's hidden states of its prompt.
        self.export_draft = False
        # Decode role: another worker writes its prompt KV; the scheduler reserves its blocks
        # (engine/remote_kv.py) and it waits in WAITING_FOR_REMOTE_KV until they are written.
        self.remote_kv = False
        # Its prefix was looked up in the second KV tier at its latest admission (engine/kv_tier.py):
        # one load per admission, then it computes whatever the pool still lacks.
        self.tier_tried = False
        # Its structured output's grammar (engine/structured_state.py; None: free text): the
        # scheduler admits it once the grammar's matcher exists (``grammar.ready``).
        self.grammar: RequestGrammar | None = None
        # Tokens proposed for its next positions, verified in the coming step (engine/spec_decode.py).
        self.spec_token_ids: list[int] = []
        # The draft's distribution at each proposal, one row each, when they were drawn from it
        # (``draft_sampling: probabilistic``); None: point-mass proposals.
        self.spec_draft_probs: torch.Tensor | None = None
        self.num_spec_draft_tokens = 0  # proposals verified for it, over its life
        self.num_spec_accepted_tokens = 0  # of which accepted
        self.lora_request: LoRARequest | None = None  # its LoRA adapter (engine/lora_slots.py); None: the base
        # Monotonic timestamps for latency breakdowns (queue wait, TTFT).
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.stop_reason: int | str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are asked and not all computed: every prompt position must run
        through the model here (no prefix-cache hit, no tier load, no KV from another worker)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")


@dataclass
class RequestTimes:
    """When a request moved through the engine (monotonic seconds), for latency breakdowns."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    num_preemptions: int = 0
    # Speculative decoding (engine/spec_decode.py): (tokens proposed for it, accepted); None when
    # its engine does not speculate.
    spec_tokens: tuple[int, int] | None = None


@dataclass
class RequestOutput:
    """The result of one request (what `LLM.generate` returns per prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict | None] | None = None
    num_cached_tokens: int = 0
    # prompt_logprobs asked: one entry per prompt token, the first without a logprob
    prompt_logprobs: list[dict] | None = None
    stop_reason: int | str | None = None
    times: RequestTimes | None = field(default=None, compare=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
