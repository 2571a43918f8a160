"""The OpenAI HTTP API's tool-calling request models: ``tools``, ``tool_choice``, and the
``tool_calls`` of an assistant message in the history (pydantic, strict; api/tool_calls.py turns
them into a grammar and a parser).

A tool is ``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}``:
its name 1-64 characters of ``A-Z a-z 0-9 _ -`` (OpenAI's rule), its parameters a JSON schema
object (checked against the JSON Schema meta-schema, so a 400 names
``tools[i].function.parameters`` before any grammar is compiled). ``tool_choice`` is ``"none"``,
``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

__all__ = ["Tool", "FunctionDefinition", "NamedToolChoice", "MessageToolCall", "ToolFields", "ToolFieldsOfMessage",
           "MAX_TOOLS", "MAX_TOOL_CALLS", "TOOL_NAME_PATTERN"]

MAX_TOOLS = 128  # tools in one request (OpenAI's bound)
MAX_TOOL_CALLS = 128  # tool calls in one assistant message of the history
MAX_SCHEMA_CHARS = 1 << 16  # a tool's parameters as JSON text
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters must be a JSON schema (draft 2020-12's meta-schema), of bounded size."""
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError, RecursionError) as exc:
        raise PydanticCustomError("json_schema", "is not a JSON schema ({error})", {"error": str(exc)}) from None
    if size > MAX_SCHEMA_CHARS:
        raise PydanticCustomError("json_schema", "is {size} characters as JSON; at most {limit}",
                                  {"size": size, "limit": MAX_SCHEMA_CHARS})
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise PydanticCustomError("json_schema", "is not a JSON schema: {error}", {"error": exc.message}) from None
    return schema


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)] = Field(
        description="1-64 characters of A-Z a-z 0-9 _ -, unique among the request's tools")
    description: str | None = Field(None, description="shown to the model by the chat template")
    parameters: Annotated[dict[str, Any], AfterValidator(_json_schema)] | None = Field(
        None, description="a JSON schema object: the arguments' shape (absent: no arguments, `{}`)")
    strict: bool | None = Field(None, description="accepted: with tool_choice required or a named function the "
                                                  "arguments always follow the schema")


class Tool(BaseModel):
    """One function the model may call."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function the model must call."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: NamedFunction


class MessageFunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: Annotated[str, Field(min_length=1, max_length=256)]
    # JSON text no JSON schema can check: contentSchema is an annotation (the handler parses it)
    arguments: str = Field(description="the arguments as JSON text (a JSON object)", json_schema_extra={
        "contentMediaType": "application/json", "contentSchema": {"type": "object"}})


class MessageToolCall(BaseModel):
    """A call an assistant message of the history made (its result comes back in a ``tool`` message)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: MessageFunctionCall


# What the HTTP app reads (the request classes are built at run time: openai_types.py).
class FunctionFields(Protocol):
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class ToolSpecFields(Protocol):
    type: str
    function: FunctionFields

    def model_dump(self, *, exclude_none: bool = ...) -> dict[str, Any]: ...


class NamedChoiceFields(Protocol):
    type: str
    function: NamedFunction


class ToolFields(Protocol):
    """A chat request's tool fields."""

    tools: Sequence[ToolSpecFields] | None
    tool_choice: str | NamedChoiceFields | None
    parallel_tool_calls: bool | None


class MessageCallFields(Protocol):
    id: str
    type: str
    function: MessageFunctionCall


class ToolFieldsOfMessage(Protocol):
    """A message's tool fields: an assistant's calls, a tool result's call id."""

    tool_calls: Sequence[MessageCallFields] | None
    tool_call_id: str | None
