"""The OpenAI HTTP API's structured-output fields and how they become the engine's
`SamplingParams.structured_outputs` (engine/structured.py compiles it).

Three spellings, so clients written for OpenAI or for vLLM work unchanged:

- OpenAI's ``response_format``: ``{"type": "text"}`` (free text, as without it),
  ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema":
  {"name", "description"?, "schema", "strict"?}}``. ``strict`` is the engine's
  ``disable_additional_properties``: true or unset (xgrammar's default, as in vLLM), no
  properties the schema does not list; false, others where the schema allows them;
- vLLM's ``structured_outputs`` object: exactly one of ``json`` (a schema, object or JSON text),
  ``regex``, ``choice``, ``grammar`` (EBNF / GBNF or Lark), ``json_object``, ``structural_tag``,
  with the options ``disable_any_whitespace`` and ``disable_additional_properties``
  (``disable_fallback`` is accepted and not used: one backend; ``whitespace_pattern``, which
  xgrammar does not implement, only as null);
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, with
  ``guided_decoding_backend`` (a known backend name is accepted and not used, its options
  ``disable-any-whitespace`` and ``no-additional-properties`` are honoured; an unknown name is
  a 400) and ``guided_whitespace_pattern`` (only null).

One request sets at most one of them (in `SOURCES` order, the second one set is named in the
400). The engine's errors name ``structured_outputs.<kind>``; `param_names` says how the
request spelled that field, so a 400 names what the client sent.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Annotated, Any, Literal, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdserve.engine.structured_spec import MAX_CHOICES, MAX_SPEC_CHARS

from .ingress import RequestError

__all__ = ["StructuredFields", "StructuredRequest", "structured_outputs_of", "param_names", "SOURCES", "AT_MOST_ONE",
           "KNOWN_BACKENDS", "CONSTRAINTS", "MAX_GRAMMAR_CHARS", "MAX_CHOICES", "MAX_CHOICE_CHARS"]

# The request fields that carry a constraint, in the order a conflict is reported.
SOURCES = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs' constraint keys (exactly one per request), as vLLM names them.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# guided_decoding_backend names vLLM knows (accepted, not used: pdserve compiles with xgrammar).
KNOWN_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
# A backend, optionally with vLLM's comma-separated options ("xgrammar:disable-any-whitespace").
BACKEND = re.compile(f"^({'|'.join(KNOWN_BACKENDS)})(:[A-Za-z0-9_,-]*)?$")
_BACKEND_OPTIONS = {"disable-any-whitespace": "disable_any_whitespace",
                    "no-additional-properties": "disable_additional_properties"}

# Sizes, the engine's (engine/structured_spec.py): a regex, grammar, structural tag or JSON schema
# (as compact JSON) at most MAX_GRAMMAR_CHARS characters; at most MAX_CHOICES choices, whose
# characters together are at most MAX_GRAMMAR_CHARS (so each choice at most MAX_CHOICE_CHARS here).
MAX_GRAMMAR_CHARS = MAX_SPEC_CHARS
MAX_CHOICE_CHARS = MAX_SPEC_CHARS // MAX_CHOICES


def _is_set(name: str) -> dict:
    """JSON Schema: the request sets constraint field ``name`` (not null; response_format not text)."""
    value: dict = {"not": {"type": "null"}}
    if name == "response_format":
        value = {"type": "object", "not": {"properties": {"type": {"const": "text"}}}}
    return {"required": [name], "properties": {name: value}}


# JSON Schema of the request models (their allOf): at most one of SOURCES is set.
AT_MOST_ONE = {"not": {"anyOf": [{"allOf": [_is_set(a), _is_set(b)]} for a, b in itertools.combinations(SOURCES, 2)]}}


def _null_only(v: Any) -> None:
    if v is not None:
        raise PydanticCustomError("unsupported", "is not supported by this server's grammar backend (xgrammar); "
                                                 "leave it out (or null) and use disable_any_whitespace")
    return v


def _constraint_set(key: str) -> dict:
    value = {"const": True} if key == "json_object" else {"not": {"type": "null"}}
    return {"required": [key], "properties": {key: value}}


class JsonSchemaFields(Protocol):
    name: str
    description: str | None
    schema_: dict[str, Any]
    strict: bool | None


class ResponseFormatFields(Protocol):
    type: str
    json_schema: JsonSchemaFields | None


class StructuredOutputsFields(Protocol):
    json_: dict[str, Any] | str | None
    regex: str | None
    choice: list[str] | None
    grammar: str | None
    json_object: bool | None
    structural_tag: str | None
    disable_any_whitespace: bool
    disable_additional_properties: bool | None


class StructuredFields(Protocol):
    """The structured-output fields of a request (`structured_base`'s)."""

    response_format: ResponseFormatFields | None
    structured_outputs: StructuredOutputsFields | None
    guided_json: dict[str, Any] | str | None
    guided_regex: str | None
    guided_choice: list[str] | None
    guided_grammar: str | None
    guided_decoding_backend: str | None


def _schema_text_size(limit: int):
    """A JSON schema (an object) at most ``limit`` characters as JSON text."""

    def check(v: dict[str, Any]) -> dict[str, Any]:
        try:
            size = len(json.dumps(v, separators=(",", ":"), allow_nan=False))
        except (ValueError, RecursionError):
            raise PydanticCustomError("json_schema", "is not a JSON schema (NaN, Infinity or too deeply nested)")
        if size > limit:
            raise PydanticCustomError("too_long", f"has {size} characters as JSON; at most {limit} are allowed")
        return v

    return AfterValidator(check)


Grammar = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Schema = Annotated[dict[str, Any], _schema_text_size(MAX_GRAMMAR_CHARS)]
Choices = Annotated[list[Annotated[str, Field(max_length=MAX_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=MAX_CHOICES)]


class JsonSchema(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: Annotated[str, Field(min_length=1, max_length=64)] = Field(description="the schema's name")
    description: str | None = Field(None, description="accepted and not used")
    schema_: Schema = Field(alias="schema", description="the JSON schema the output follows")
    strict: bool | None = Field(None, description="true or unset: no properties the schema does not list; "
                                                   "false: others where the schema allows them")


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = Field(None, description="required with type json_schema (not used otherwise)")

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("json_schema", "json_schema is required with type json_schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object, structural_tag, and options."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={
        "oneOf": [_constraint_set(k) for k in CONSTRAINTS]})
    json_: Schema | Grammar | None = Field(None, alias="json",
                                           description="a JSON schema (an object, or its JSON text)")
    regex: Grammar | None = Field(None, description="a regular expression the whole output matches")
    choice: Choices | None = Field(None, description="the output is exactly one of these strings")
    grammar: Grammar | None = Field(None, description="a grammar: EBNF / GBNF (xgrammar's syntax) or Lark")
    json_object: bool | None = Field(None, description="true: any JSON object")
    structural_tag: Grammar | None = Field(None, description="xgrammar's structural tag, as JSON text")
    disable_any_whitespace: bool = Field(False, description="JSON without whitespace between tokens")
    disable_additional_properties: bool | None = Field(
        None, description="true (the default): JSON objects have only the properties the schema lists; false: "
                          "others where the schema allows them")
    whitespace_pattern: None = Field(None, description="not supported by xgrammar: only null (use "
                                                       "disable_any_whitespace)")
    disable_fallback: bool = Field(False, description="accepted and not used (one backend)")

    @field_validator("whitespace_pattern", mode="before")
    @classmethod
    def _no_whitespace_pattern(cls, v):
        return _null_only(v)


class StructuredRequest(BaseModel):
    """The structured-output fields both request kinds have (the base of their models);
    `structured_outputs_of` reads them."""

    response_format: ResponseFormat | None = Field(
        None, description="OpenAI: text, json_object or json_schema (constrained decoding)")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM: the output follows exactly one constraint (docs/api.md)")
    guided_json: Schema | Grammar | None = Field(None, description="vLLM (older name): structured_outputs.json")
    guided_regex: Grammar | None = Field(None, description="vLLM (older name): structured_outputs.regex")
    guided_choice: Choices | None = Field(None, description="vLLM (older name): structured_outputs.choice")
    guided_grammar: Grammar | None = Field(None, description="vLLM (older name): structured_outputs.grammar")
    guided_whitespace_pattern: None = Field(
        None, description="vLLM (older name): not supported by xgrammar, only null (use "
                          "guided_decoding_backend xgrammar:disable-any-whitespace)")
    guided_decoding_backend: Annotated[str, Field(max_length=256, json_schema_extra={"pattern": BACKEND.pattern})] \
        | None = Field(None, description=f"vLLM: one of {', '.join(KNOWN_BACKENDS)}, optionally with :options; "
                                         "accepted and not used (anything else is a 400)")

    @field_validator("guided_whitespace_pattern", mode="before")
    @classmethod
    def _no_whitespace_pattern(cls, v):
        return _null_only(v)


def _sources(body: StructuredFields) -> list[str]:
    """The constraint fields a request set ({"type": "text"} is no constraint)."""
    out = []
    for name in SOURCES:
        v = getattr(body, name)
        if v is not None and not (name == "response_format" and v.type == "text"):
            out.append(name)
    return out


def _schema(value: dict[str, Any] | str, name: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text, as an object."""
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise RequestError("invalid_argument", f"{name}: is not valid JSON ({exc})", name) from None
    if not isinstance(schema, dict):
        raise RequestError("invalid_argument", f"{name}: a JSON schema must be a JSON object, "
                           f"got {type(schema).__name__}", name)
    return schema


def _backend_options(body: StructuredFields) -> dict[str, bool]:
    backend = body.guided_decoding_backend
    if backend is None:
        return {}
    name, _, options = backend.partition(":")
    if not BACKEND.match(backend):
        raise RequestError("invalid_argument", f"guided_decoding_backend: unknown backend {name!r}; use one of "
                           f"{', '.join(KNOWN_BACKENDS)}, optionally with :options (pdserve compiles every "
                           "constraint with xgrammar)", "guided_decoding_backend")
    return {_BACKEND_OPTIONS[o.strip()]: True for o in options.split(",") if o.strip() in _BACKEND_OPTIONS}


def structured_outputs_of(body: StructuredFields) -> dict | None:
    """The engine's ``structured_outputs`` for a request (None: free text), or a
    `RequestError` naming the field: two constraint fields at once, a
    ``structured_outputs`` with none or two constraints, an unknown backend."""
    options = _backend_options(body)
    sources = _sources(body)
    if not sources:
        return None
    if len(sources) > 1:
        second = sources[1]
        raise RequestError("invalid_argument", f"{second}: not with {sources[0]}; a request takes one "
                           f"structured-output constraint", second)
    source = sources[0]
    out: dict[str, Any]
    if source == "response_format":
        rf = body.response_format
        assert rf is not None
        if rf.type == "json_object":
            out = {"json_object": True}
        else:
            assert rf.json_schema is not None
            out = {"json": rf.json_schema.schema_}
            if rf.json_schema.strict is not None:
                out["disable_additional_properties"] = rf.json_schema.strict
    elif source == "structured_outputs":
        out = _from_structured_outputs(body.structured_outputs)
    elif source == "guided_json":
        assert body.guided_json is not None
        out = {"json": _schema(body.guided_json, "guided_json")}
    else:
        out = {source.removeprefix("guided_"): getattr(body, source)}
    for key, value in options.items():
        out.setdefault(key, value)
    return out


def _from_structured_outputs(so: StructuredOutputsFields | None) -> dict[str, Any]:
    assert so is not None
    values = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
              "json_object": so.json_object or None, "structural_tag": so.structural_tag}
    kinds = [k for k in CONSTRAINTS if values[k] is not None]
    if not kinds:
        raise RequestError("invalid_argument", f"structured_outputs: set one of {', '.join(CONSTRAINTS)}",
                           "structured_outputs")
    if len(kinds) > 1:
        field = f"structured_outputs.{kinds[1]}"
        raise RequestError("invalid_argument", f"{field}: not with structured_outputs.{kinds[0]}; set exactly "
                           "one constraint", field)
    kind = kinds[0]
    out: dict[str, Any] = {kind: values[kind]}
    if so.json_ is not None:
        out["json"] = _schema(so.json_, "structured_outputs.json")
    if so.disable_any_whitespace:
        out["disable_any_whitespace"] = True
    if so.disable_additional_properties is not None:
        out["disable_additional_properties"] = so.disable_additional_properties
    return out


def param_names(body: StructuredFields) -> dict[str, str]:
    """How this request spelled the engine's ``structured_outputs.<key>`` fields (for
    `RequestError.renamed`): the engine names what it compiled, the client sees what it sent."""
    sources = _sources(body)
    if not sources or sources[0] == "structured_outputs":
        return {}
    source = sources[0]
    ws = "guided_whitespace_pattern"
    if source == "response_format":
        rf = body.response_format
        whole = "response_format.json_schema.schema" if rf is not None and rf.type == "json_schema" \
            else "response_format"
        return {"structured_outputs": whole, "structured_outputs.json": whole,
                "structured_outputs.json_object": "response_format",
                "structured_outputs.disable_additional_properties": "response_format.json_schema.strict",
                "structured_outputs.whitespace_pattern": ws}
    kind = source.removeprefix("guided_")
    backend = "guided_decoding_backend"
    return {"structured_outputs": source, f"structured_outputs.{kind}": source,
            "structured_outputs.whitespace_pattern": ws,
            "structured_outputs.disable_any_whitespace": backend,
            "structured_outputs.disable_additional_properties": backend}
