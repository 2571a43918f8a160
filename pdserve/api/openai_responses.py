"""The OpenAI-compatible HTTP API's response models (pydantic).

They describe the JSON the server sends (and document it in its OpenAPI
document): the server builds plain dicts for speed (openai_reply.py); the schema
tests check those against these models. Requests: openai_types.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ErrorResponse", "ErrorBody", "Usage", "Breakdown",
    "PromptLogprob", "CompletionLogprobs", "CompletionChoice", "Completion", "CompletionChunk",
    "ChatTopLogprob", "ChatTokenLogprob", "ChatLogprobs", "AssistantMessage", "ChatChoice", "ChatCompletion",
    "FunctionCall", "ToolCall", "FunctionCallDelta", "ToolCallDelta", "ChatDelta", "ChatChunkChoice", "ChatCompletionChunk", "ModelCard", "ModelList", "Health",
]

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(_Out):
    message: str = Field(description="what was wrong and what to change")
    type: str = Field(description="invalid_request_error, rate_limit_error, unavailable or server_error")
    param: str | None = Field(description="the request field at fault, when one is")
    code: int | str = Field(description="the HTTP status (vLLM's habit), or OpenAI's code `model_not_found` for a "
                            "model or LoRA adapter not served")


class ErrorResponse(_Out):
    """Every error, whatever its status (OpenAI's shape)."""

    error: ErrorBody


class Usage(_Out):
    prompt_tokens: int = Field(description="prompt tokens, counted once per prompt whatever n is")
    completion_tokens: int
    total_tokens: int


class Breakdown(BaseModel):
    """pdserve extension: where one sequence's time went (on its final message)."""

    model_config = ConfigDict(extra="allow")
    route: str | None = Field(None, description="local | remote")
    reason: str | None = Field(None, description="the router's reason code and text")
    score: float | None = None
    predicted_ttft_local_ms: float | None = None
    predicted_ttft_remote_ms: float | None = None
    queue_wait_ms: float | None = None
    prefill_ms: float | None = None
    transfer_ms: float | None = None
    transfer_bytes: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = Field(None, description="prompt tokens served by the prefix cache")
    prefill_worker: str | None = None
    attempts: int | None = None
    fell_back_to_local: bool | None = None
    worker_id: str | None = None
    spec_draft_tokens: int | None = Field(None, description="speculative decoding: tokens proposed and verified")
    spec_accepted_tokens: int | None = Field(None, description="speculative decoding: proposed tokens accepted")


class CompletionLogprobs(_Out):
    """OpenAI's legacy logprobs: one entry per token of the choice (of this chunk when streaming)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] = Field(
        description="the sampled token and the N most likely ones, by token text")
    text_offset: list[int] = Field(description="each token's character offset in the choice's text")


class PromptLogprob(_Out):
    """vLLM's prompt logprob of one token (a value of a `prompt_logprobs` entry, keyed by token id)."""

    logprob: float
    rank: int | None = Field(description="1: the most likely token at that position")
    decoded_token: str | None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
PROMPT_LOGPROBS_DOC = ("vLLM extension, with prompt_logprobs: per prompt token (null for the first) the "
                       "prompt token's logprob and rank and the N most likely tokens', keyed by token id")


class CompletionChoice(_Out):
    index: int = Field(description="prompt index x n + sample index")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] = Field(description="pdserve extension: the generated token ids")
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS_DOC + " (when streaming: on "
                                                                  "the choice's first chunk)")
    pdserve: Breakdown | None = Field(None, description="pdserve extension, on the choice's final message")


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Out):
    """One server-sent event of a streamed completion (``data: <json>``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null, then set on the "
                                                  "last chunk (whose choices are empty)")


class ChatTopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes")


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(description="the top_logprobs most likely tokens")


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob] | None


class FunctionCall(_Out):
    name: str
    arguments: str = Field(description="the arguments as JSON text, as the model wrote them")


class ToolCall(_Out):
    id: str = Field(description="chatcmpl-tool-<32 hex digits> (vLLM's form; 9 letters and digits with the "
                                "mistral parser)")
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the message is only tool calls or reasoning")
    reasoning_content: str | None = Field(None, description="with a reasoning parser: the text inside "
                                                            "<think>...</think>")
    tool_calls: list[ToolCall] | None = Field(None, description="the calls the model made (finish_reason "
                                                                "tool_calls)")


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] = Field(description="pdserve extension: the generated token ids")
    pdserve: Breakdown | None = None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS_DOC)


class FunctionCallDelta(_Out):
    name: str | None = Field(None, description="on a call's first delta")
    arguments: str = Field(description="the next piece of the arguments' JSON text")


class ToolCallDelta(_Out):
    index: int = Field(description="which call of the choice; its pieces joined by index make the call")
    id: str | None = Field(None, description="on a call's first delta")
    type: Literal["function"] | None = Field(None, description="on a call's first delta")
    function: FunctionCallDelta


class ChatDelta(_Out):
    role: Literal["assistant"] | None = Field(None, description="on each choice's first chunk only")
    content: str | None = None
    reasoning_content: str | None = Field(None, description="with a reasoning parser")
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] = Field(default_factory=list, description="pdserve extension")
    pdserve: Breakdown | None = None


class ChatCompletionChunk(_Out):
    """One server-sent event of a streamed chat completion (``data: <json>``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS_DOC + " (on the first "
                                                                  "chunk with a token)")


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(description="vLLM extension: prompt plus generated tokens")
    root: str | None = Field(None, description="vLLM: the model's path; a LoRA adapter's directory")
    parent: str | None = Field(None, description="vLLM: a LoRA adapter's base model id (None: a base model)")


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    status: Literal["ok"]
    worker_id: str
