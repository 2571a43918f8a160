"""The OpenAI-compatible HTTP API's request models (pydantic; responses: openai_responses.py).

Requests are strict: a value of the wrong JSON type is refused, never coerced
(``"max_tokens": "7"``, ``true`` or ``7.5``), and NaN / Infinity are refused by
name. The bounds that depend on the model and on the worker's limits (context
length, vocabulary, list sizes) come from `Bounds`: `request_models` builds the
request classes for one worker, so its OpenAPI document states exactly what it
accepts. Fields OpenAI defines that pdserve does not implement (``suffix``,
``best_of``, ...) are declared with the only values that mean "not used", so a
client that relies on one gets a 400 naming it instead of silently different
output. Unknown fields are ignored, as vLLM does.

Both request kinds take the sampling controls vLLM users pass (``logit_bias`` as
OpenAI defines it, ``min_p``, ``min_tokens``, ``allowed_token_ids``, ``bad_words``,
``prompt_logprobs``) and structured outputs (``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` names: openai_structured.py).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from .openai_structured import AT_MOST_ONE, StructuredFields, StructuredRequest
from .openai_tools import MAX_TOOL_CALLS, MAX_TOOLS, MessageToolCall, NamedToolChoice, Tool, ToolFields, \
    ToolFieldsOfMessage

__all__ = ["Bounds", "RequestModels", "request_models", "MAX_LOGPROBS", "LOGPROB_FLOOR", "CompletionFields",
           "ChatFields", "SamplingFields"]

MAX_LOGPROBS = 20  # OpenAI's bound on logprobs / top_logprobs
LOGPROB_FLOOR = -9999.0  # what a -inf logprob is sent as (JSON has no infinity; vLLM's value)


@dataclass(frozen=True)
class Bounds:
    """What one worker accepts that depends on its model, engine and limits.

    ``max_model_len``: prompt plus generated tokens; ``vocab_size``: token ids are
    below it; the rest are the worker's `ServingLimits` and the engine's ranges.
    """

    max_model_len: int
    vocab_size: int
    max_prompt_chars: int
    max_request_id_chars: int = 256
    max_messages: int = 1024
    max_stop_strings: int = 32
    max_stop_chars: int = 256
    max_stop_token_ids: int = 256
    max_n: int = 128
    max_prompts: int = 64
    max_temperature: float = 1e4
    max_repetition_penalty: float = 1e4
    seed_min: int = -(2**63)
    seed_max: int = 2**64 - 1
    int64_max: int = 2**63 - 1
    max_logit_bias: int = 1024  # entries of logit_bias (the engine's RequestLimits)
    max_bad_words: int = 128
    max_allowed_token_ids: int = 1 << 20


def _integral(value: Any) -> Any:
    """JSON Schema's integer includes 5.0 (a JSON number is a number): take an integral
    float as that integer. Strings, booleans and 7.5 are still refused, not coerced."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# An integer field is ``Annotated[int, Field(<bounds>), INTEGRAL]``: strict, except that an
# integral JSON number (5.0) is the integer it equals. (The bounds sit on the int itself, so the
# JSON schema has them.)
INTEGRAL = BeforeValidator(_integral)


def ids_below(n: int) -> str:
    """A regex of the decimal numbers 0 .. n - 1 without leading zeros (``n`` >= 1): the token
    ids of a vocabulary of ``n``, as logit_bias' JSON keys spell them."""
    top = str(n - 1)

    def digits(lo: int, hi: int) -> str:
        return str(lo) if lo == hi else f"[{lo}-{hi}]"

    def any_digits(k: int) -> str:
        return "" if k == 0 else "[0-9]" if k == 1 else f"[0-9]{{{k}}}"

    alts = []
    if len(top) > 1:  # the shorter numbers
        alts += ["0", "[1-9]" + (f"[0-9]{{0,{len(top) - 2}}}" if len(top) > 2 else "")]
    for i, d in enumerate(top):  # as long as n - 1: a smaller digit at position i, anything after
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(d) > low:
            alts.append(top[:i] + digits(low, int(d) - 1) + any_digits(len(top) - i - 1))
    alts.append(top)
    return "^(" + "|".join(alts) + ")$"


def _only(value: Any, *allowed: Any) -> Any:
    """A field pdserve does not implement: only the values that mean "not used" pass."""
    value = _integral(value)
    if any(type(value) is type(a) and value == a for a in allowed):
        return value
    raise PydanticCustomError("unsupported", "is not supported by this server; leave it out (or null)")


@dataclass(frozen=True)
class RequestModels:
    """The request classes of one worker (see `request_models`)."""

    completion: type[BaseModel]
    chat: type[BaseModel]


# What the HTTP app reads of a parsed request. The classes `request_models` builds are made at
# run time (their bounds are one worker's), so the checker cannot see their fields; these
# Protocols state them, as the models declare them below.
class StreamOptionsFields(Protocol):
    include_usage: bool | None


class SamplingFields(StructuredFields, Protocol):
    """The fields both request kinds share (`_Sampling`, with `structured_base`'s)."""

    model: str | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool
    n: int
    stream: bool
    stream_options: StreamOptionsFields | None
    priority: str
    ttft_slo_ms: float | None
    route: str
    request_id: str | None
    min_p: float | None
    min_tokens: int | None
    logit_bias: dict[int, float] | None
    allowed_token_ids: list[int] | None
    bad_words: list[str] | None
    prompt_logprobs: int | None


class CompletionFields(SamplingFields, Protocol):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None
    echo: bool


class TextPartFields(Protocol):
    text: str


class ChatMessageFields(ToolFieldsOfMessage, Protocol):
    role: str
    content: str | Sequence[TextPartFields] | None
    name: str | None


class ChatFields(SamplingFields, ToolFields, Protocol):
    messages: Sequence[ChatMessageFields]
    max_completion_tokens: int | None
    logprobs: bool
    top_logprobs: int | None


# The rules on one chat message that api/tool_calls.py `template_messages` enforces (each refusal a
# 400 naming the field), stated in the message's JSON schema too, so that the OpenAPI document
# describes exactly the messages the server takes.
MESSAGE_RULES: dict[str, Any] = {"allOf": [
    # a tool message names the call it answers
    {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
     "then": {"properties": {"tool_call_id": {"type": "string"}}, "required": ["tool_call_id"]}},
    # only an assistant message makes calls
    {"if": {"properties": {"role": {"not": {"const": "assistant"}}}, "required": ["role"]},
     "then": {"properties": {"tool_calls": {"type": "null"}}}},
    # content is required: null (or left out) only on an assistant message with calls
    {"anyOf": [{"properties": {"content": {"not": {"type": "null"}}}, "required": ["content"]},
               {"properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
                "required": ["role", "tool_calls"]}]},
]}


def request_models(b: Bounds) -> RequestModels:
    """Request classes whose constraints are this worker's: the OpenAPI document and
    the validation come from the same declarations."""
    max_out = b.max_model_len - 1  # at least one prompt token
    Text = Annotated[str, Field(min_length=1, max_length=b.max_prompt_chars)]
    TokenId = Annotated[int, Field(ge=0, le=b.vocab_size - 1), INTEGRAL]
    TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=b.max_model_len - 1)]
    StopText = Annotated[str, Field(min_length=1, max_length=b.max_stop_chars)]
    BadWord = Annotated[str, Field(min_length=1, max_length=b.max_stop_chars, pattern=r"\S")]
    MaxTokens = Annotated[int, Field(ge=1, le=max_out), INTEGRAL]

    class StreamOptions(BaseModel):
        """Options of a streamed response (only with ``stream: true``)."""

        model_config = ConfigDict(extra="ignore", strict=True)
        include_usage: bool | None = Field(
            None, description="send a last chunk with empty `choices` and the request's `usage`; "
                              "every other chunk then has `usage: null`")

    token_key = ids_below(b.vocab_size)
    token_key_re = re.compile(token_key)

    def token_bias(bias: dict[str, float]) -> dict[int, float]:
        """OpenAI's logit_bias keys are token ids as JSON strings: each must be one of this model's."""
        for k in bias:
            if not token_key_re.match(k):
                raise PydanticCustomError("token_id", "'{key}' is not a token id of this model (vocab size {size})",
                                          {"key": k, "size": b.vocab_size})
        return {int(k): v for k, v in bias.items()}

    class _Sampling(StructuredRequest):
        model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

        model: str | None = Field(None, description="must name the served model if set (404 otherwise)")
        max_tokens: MaxTokens | None = Field(
            None, description="most tokens to generate (default 16 for completions; for chat the room left in "
                              "the context); prompt + max_tokens must fit max_model_len (400 otherwise)")
        temperature: Annotated[float, Field(ge=0, le=b.max_temperature)] | None = Field(
            None, description="default 1.0; 0 (or below 1e-5) is greedy")
        top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="default 1.0")
        top_k: Annotated[int, Field(ge=-1, le=b.int64_max), INTEGRAL] | None = Field(
            None, description="vLLM extension; 0 or -1 disables")
        seed: Annotated[int, Field(ge=b.seed_min, le=b.seed_max), INTEGRAL] | None = Field(
            None, description="makes sampling reproducible; with n > 1, choice j of a prompt uses seed + j")
        presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
        frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
        repetition_penalty: Annotated[float, Field(gt=0, le=b.max_repetition_penalty)] | None = Field(
            None, description="vLLM extension; 1.0 disables")
        stop: StopText | Annotated[list[StopText], Field(max_length=b.max_stop_strings)] | None = Field(
            None, description="text that ends a choice (not included in it)")
        stop_token_ids: Annotated[list[TokenId], Field(max_length=b.max_stop_token_ids)] | None = Field(
            None, description="vLLM extension: token ids that end a choice")
        ignore_eos: bool = Field(False, description="vLLM extension: keep generating past end-of-sequence")
        n: Annotated[int, Field(ge=1, le=b.max_n), INTEGRAL] = Field(
            1, description="choices per prompt (parallel sampling: the siblings share the prompt's KV blocks)")
        stream: bool = Field(False, description="answer with server-sent events, ending with `data: [DONE]`")
        stream_options: StreamOptions | None = Field(None, description="only with `stream: true`")
        user: str | None = Field(None, description="accepted and not used")
        logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                              Field(max_length=b.max_logit_bias, json_schema_extra={
                                  "propertyNames": {"pattern": token_key}}), AfterValidator(token_bias)] | None = Field(
            None, description="token id (a JSON string) -> added to its logit before sampling, in [-100, 100]; "
                              "-100 in effect bans a token, 100 makes it all but certain")
        # vLLM's sampling controls
        min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(
            None, description="vLLM extension: drop tokens less likely than min_p x the most likely one's "
                              "probability; default 0 (off)")
        min_tokens: Annotated[int, Field(ge=0, le=max_out), INTEGRAL] | None = Field(
            None, description="vLLM extension: end-of-sequence, stop_token_ids and stop strings cannot end a "
                              "choice before this many tokens; at most max_tokens")
        allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=b.max_allowed_token_ids)] \
            | None = Field(None, description="vLLM extension: only these token ids may be generated")
        bad_words: Annotated[list[BadWord], Field(max_length=b.max_bad_words)] | None = Field(
            None, description="vLLM extension: words never generated (a word's last token is banned after "
                              "its other tokens)")
        prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = Field(
            None, description="vLLM extension: the logprob and rank of each prompt token and of the N most likely "
                              "tokens at its position (the prompt is then prefilled on the worker that answers, "
                              "every position: no cached prefix)")
        # pdserve extensions
        priority: Literal["high", "normal", "low"] = Field("normal", description="pdserve: QoS class")
        ttft_slo_ms: Annotated[float, Field(gt=0)] | None = Field(
            None, description="pdserve: time-to-first-token objective for admission and routing")
        route: Literal["auto", "local", "remote"] = Field(
            "auto", description="pdserve: force local or remote prefill (tests, debugging)")
        request_id: Annotated[str, Field(min_length=1, max_length=b.max_request_id_chars,
                                         pattern=r"^[A-Za-z0-9._:@/+=-]+$")] | None = Field(
            None, description="the response's id (with n > 1 or several prompts, sequence i runs as "
                              "`<id>-<i>`); must not be in flight for the same API key (else 409)")

    _stream_options_need_stream = {
        "if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
        "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
    }

    class CompletionRequest(_Sampling):
        """POST /v1/completions."""

        model_config = ConfigDict(json_schema_extra={"allOf": [
            _stream_options_need_stream, AT_MOST_ONE,
        ]})

        prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=b.max_prompts)] \
            | Annotated[list[TokenIds], Field(min_length=1, max_length=b.max_prompts)] = Field(
                description="text, token ids, or a list of either (one choice per prompt and n)")
        logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = Field(
            None, description="log-probabilities of each generated token and of the N most likely ones")
        echo: bool = Field(False, description="prepend the prompt to each choice's text (with logprobs: the "
                                              "prompt tokens' logprobs too, the first one null)")
        suffix: None = Field(None, description="not supported: only null")
        best_of: Annotated[int, Field(ge=1, le=1), INTEGRAL] | None = Field(None, description="not supported: only 1")

        @field_validator("suffix", mode="before")
        @classmethod
        def _no_suffix(cls, v):
            return _only(v, None)

        @field_validator("best_of", mode="before")
        @classmethod
        def _no_best_of(cls, v):
            return _only(v, None, 1)

    class TextPart(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)
        type: Literal["text"]
        text: Annotated[str, Field(max_length=b.max_prompt_chars)]

    class ChatMessage(BaseModel):
        """One message; ``developer`` is OpenAI's newer name for ``system`` and is sent to the
        template as ``system``. Content parts must be text (joined with newlines). A ``tool``
        message is a call's result (``tool_call_id`` names the call); an ``assistant`` message may
        carry the ``tool_calls`` it made, its content then null."""

        model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=copy.deepcopy(MESSAGE_RULES))
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: Annotated[str, Field(max_length=b.max_prompt_chars)] | Annotated[
            list[TextPart], Field(min_length=1, max_length=b.max_messages)] | None = Field(
                None, description="required, except on an assistant message with tool_calls")
        name: str | None = Field(None, description="accepted and not used")
        tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = Field(
            None, description="assistant only: the calls it made (each `arguments` a JSON object as text)")
        tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
            None, description="tool only, and required there: the call this message answers")

    class ChatRequest(_Sampling):
        """POST /v1/chat/completions."""

        model_config = ConfigDict(json_schema_extra={"allOf": [
            _stream_options_need_stream, AT_MOST_ONE,
            {"if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
             "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}},
        ]})

        messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=b.max_messages)]
        max_completion_tokens: MaxTokens | None = Field(
            None, description="OpenAI's current name for max_tokens; wins over it when both are set")
        logprobs: bool = Field(False, description="return the log-probability of each generated token")
        top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = Field(
            None, description="with logprobs: also the N most likely tokens at each position")
        tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
            None, description="functions the model may call (names unique); docs/api.md, Tool calling")
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
            None, description="none; auto (the default with tools: needs the worker's --enable-auto-tool-choice); "
                              "required (at least one call); or a named function: calls follow their schemas")
        parallel_tool_calls: bool | None = Field(
            None, description="false: at most one call (default true)")
        functions: Annotated[list[Any], Field(max_length=0)] | None = Field(
            None, description="legacy, not supported: use tools")
        function_call: Literal["none"] | None = Field(None, description="legacy, not supported: use tool_choice")

        @field_validator("functions", mode="before")
        @classmethod
        def _no_functions(cls, v):
            return _only(v, None, [])

    return RequestModels(CompletionRequest, ChatRequest)
