"""The request vocabulary every serving surface shares: the gRPC and HTTP APIs (api/grpc_service.py,
api/http_app.py), the `Surface` they serve (api/surface.py), and behind it a decode worker's
frontend or a gateway's.

`GenerateInput` is a request as either API parsed it; `Chunk` is what streams back;
`RequestError` is every refusal, with the status code the API layer maps to gRPC / HTTP;
`ServingLimits` bounds what a client may send; the metadata headers a gateway and a decode
worker exchange (`KV_WAIT_HEADER`, `ERROR_SCOPE_HEADER`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from pdserve.common import Priority
from pdserve.cluster.security import ApiKey
from pdserve.engine import RequestLimits, SamplingParams
from pdserve.engine.request import INT64_MIN, UINT64_MAX


class RequestError(Exception):
    """A request that cannot be served, with the status the client should see.

    ``code`` is one of: invalid_argument, not_found (an unknown model), already_exists (a
    request_id still in flight), permission_denied (a privilege the caller's API key lacks),
    resource_exhausted, unavailable, internal. ``field`` names the request field at fault, as `GenerateInput`
    names it ("prompt" for text and token ids alike); each API renames it to its own
    field names (`renamed`). ``scope`` ``"request"``: the failure is this request's own and
    the worker that raised it is fine (gRPC sends it as ERROR_SCOPE_HEADER; a gateway then
    returns the error instead of retrying the request on, and avoiding, other workers);
    None: not known to be the request's own (the worker may be at fault).
    """

    def __init__(self, code: str, message: str, field_name: str | None = None,
                 predicted_ttft_ms: float | None = None, retry_after_ms: int | None = None,
                 scope: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field_name
        self.predicted_ttft_ms = predicted_ttft_ms
        self.retry_after_ms = retry_after_ms
        self.scope = scope

    def renamed(self, names: dict[str, str]) -> "RequestError":
        """The same error naming the field as the client's API spells it."""
        new = names.get(self.field or "")
        if new is None:
            return self
        message = str(self)
        if self.field is not None and message.startswith(f"{self.field}:"):
            message = new + message[len(self.field):]
        return RequestError(self.code, message, new, self.predicted_ttft_ms, self.retry_after_ms, self.scope)


REQUEST_ID_CHARS = re.compile(r"[A-Za-z0-9._:@/+=-]+")


@dataclass(frozen=True)
class ServingLimits:
    """What one request may ask for, checked before any work is done for it.

    ``max_prompt_chars`` None: ``max_model_len`` x the longest vocabulary entry,
    a bound no prompt that fits the model can exceed, so it refuses a huge
    prompt without tokenizing it. The stop limits bound the detokenizer's
    per-token work; the body limit bounds JSON parsing (HTTP).
    """

    max_body_bytes: int = 8 << 20
    max_prompt_chars: int | None = None
    max_request_id_chars: int = 256
    max_messages: int = 1024
    max_stop_strings: int = 32
    max_stop_chars: int = 256
    max_stop_token_ids: int = 256
    max_n: int = 128  # choices per prompt (HTTP n; OpenAI's bound)
    max_prompts: int = 64  # prompts in one batched /v1/completions request
    # prompts x n: the sequences one request starts (each bounded by max_model_len), checked
    # before any is admitted; 64 prompts x n=128 would otherwise hold a worker for minutes
    max_sequences_per_request: int = 128
    # sequences one API key may have in flight on this worker (all its calls together), checked
    # before any is admitted; the engine also shares its sequence slots fairly among keys. With
    # keys off, each client address is a tenant of its own (api/security.py `client_address`).
    max_sequences_per_key: int = 256
    tokenizer_threads: int = 2  # tokenization runs here, never on the event loop

    @classmethod
    def from_dict(cls, d: dict | None) -> "ServingLimits":
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"limits: unknown key {unknown[0]!r}; known: {sorted(cls.__dataclass_fields__)}")
        for k, v in d.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"limits.{k}: must be an integer >= 1, got {v!r}")
        return cls(**d)

    @property
    def request(self) -> RequestLimits:
        return RequestLimits(self.max_stop_strings, self.max_stop_chars, self.max_stop_token_ids)


@dataclass
class GenerateInput:
    """One request as the APIs parsed it (``messages`` instead of ``prompt`` for chat)."""

    prompt: str | list[int] | None
    params: SamplingParams
    messages: list[dict] | None = None
    # Chat: the tools the template shows the model (OpenAI's tool objects; api/tool_calls.py)
    tools: list[dict] | None = None
    request_id: str | None = None
    model: str | None = None
    priority: Priority | str = Priority.NORMAL  # a name is parsed (and refused) by validate
    ttft_slo_ms: float | None = None
    route: str = "auto"
    # max_tokens not given by the client: generate up to the context's end (vLLM's chat default)
    fill_context: bool = False
    # The API key it came with (api/security.py); None: API keys are off, nothing is checked.
    caller: ApiKey | None = None
    # Tokens it already generated on a worker that failed (a migrated stream, gateway/): the
    # engine continues after them (`LLMEngine.make_request`); None: a new request.
    resume_ids: list[int] | None = None
    # At most this long held for KV room before a kv_pool_full refusal (gRPC metadata
    # KV_WAIT_HEADER; the policy's qos.kv_full_wait_ms caps it). A gateway that has another
    # worker to ask sends 0: a fast refusal lets it go there. None: the policy's.
    kv_full_wait_ms: float | None = None
    # The W3C trace context its caller sent (``traceparent``, ``tracestate``: gRPC metadata or
    # HTTP headers, common/tracing.py carrier_of); None: none, a traced request starts a trace.
    trace: dict[str, str] | None = None


KV_WAIT_HEADER = "x-pdserve-kv-full-wait-ms"
# Trailing metadata of a failed Generate: "request" when the failure is the request's own and
# the worker is fine (`RequestError.scope`). An INTERNAL without it may be the worker's (a bug,
# a dying engine, an older worker that does not send it): a gateway then retries the request
# once elsewhere; with it, the gateway returns the error and keeps the worker in rotation.
ERROR_SCOPE_HEADER = "x-pdserve-error-scope"
REQUEST_SCOPE = "request"


def kv_wait_of_metadata(metadata) -> float | None:
    """The KV_WAIT_HEADER a caller sent (ms, >= 0); None when absent or not a number."""
    for key, value in metadata or ():
        if key == KV_WAIT_HEADER:
            try:
                ms = float(value)
            except (TypeError, ValueError):
                return None
            return ms if ms >= 0 else None
    return None


@dataclass
class Chunk:
    """One streamed piece of a completion; the last one has finish_reason and breakdown."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    breakdown: dict | None = None
    # with the first token when prompt_logprobs was asked: an entry per prompt token, the first
    # with logprob and rank None ({token_id, logprob, rank, top_logprobs}: engine/prompt_logprobs.py)
    prompt_logprobs: list[dict] | None = None


def sample_input(inp: GenerateInput, j: int, request_id: str) -> GenerateInput:
    """Sample ``j`` of a prompt as its own request (seed + j, wrapped into the seed range)."""
    params = inp.params
    if params.seed is not None and j:
        span = UINT64_MAX - INT64_MIN + 1
        params = dataclasses.replace(params, seed=(params.seed + j - INT64_MIN) % span + INT64_MIN)
    return dataclasses.replace(inp, params=params, request_id=request_id)
