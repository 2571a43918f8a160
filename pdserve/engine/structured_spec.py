"""Structured outputs: a request's ``structured_outputs`` checked and made canonical.

``SamplingParams.structured_outputs`` is vLLM's `StructuredOutputsParams` as a dict with exactly
one kind key (`KINDS`): a JSON schema, a regular expression, a list of choices, a grammar
(xgrammar's EBNF, or Lark), any JSON object, or an xgrammar structural tag, and the options
(`OPTIONS`). `parse_structured_outputs` checks its shape and sizes and gives a `GrammarSpec`,
the canonical spec (also the compile cache's key, engine/structured.py); every failure is an
`InvalidRequestError` naming ``structured_outputs.<key>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .request import InvalidRequestError, check_text

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
MAX_SPEC_CHARS = 1 << 17  # a schema (as canonical JSON), regex, grammar or tag: 128 KiB of text
MAX_CHOICES = 1024


@dataclass(frozen=True)
class GrammarSpec:
    """One request's grammar, canonical: ``source`` is the schema or structural tag as compact
    JSON (its keys in their order: the order of a schema's properties is the order they are
    generated in), the regex or grammar text, or the choices as a JSON list."""

    kind: str
    source: str
    any_whitespace: bool = True  # json, json_object: whitespace where JSON allows it (else none)
    strict: bool = True  # json: no properties or items beyond those the schema names

    @property
    def field(self) -> str:
        """The request field an error about this grammar names."""
        return f"structured_outputs.{self.kind}"

    @property
    def key(self) -> str:
        """The cache key: equal specs, however they were written, share one compiled grammar."""
        return json.dumps([self.kind, self.source, self.any_whitespace, self.strict])


def _bad(name: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(name, msg)


def _canonical_json(name: str, value, what: str) -> str:
    """``value`` (a dict, or a JSON string of one) as compact JSON, bounded."""
    if isinstance(value, str):
        if len(value) > MAX_SPEC_CHARS:
            raise _bad(name, f"has {len(value)} characters; at most {MAX_SPEC_CHARS} are allowed")
        check_text(name, value)
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise _bad(name, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _bad(name, f"must be {what} (an object, or a JSON string of one), got {type(value).__name__}")
    try:  # (key order kept: a schema's properties are generated in the order it lists them)
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise _bad(name, f"is not valid JSON: {exc}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise _bad(name, f"has {len(text)} characters as JSON; at most {MAX_SPEC_CHARS} are allowed")
    return text


def _text(name: str, value) -> str:
    if not isinstance(value, str) or not value:
        got = "an empty one" if isinstance(value, str) else type(value).__name__
        raise _bad(name, f"must be a non-empty string, got {got}")
    if len(value) > MAX_SPEC_CHARS:
        raise _bad(name, f"has {len(value)} characters; at most {MAX_SPEC_CHARS} are allowed")
    check_text(name, value)
    return value


def _choices(name: str, value) -> str:
    if not isinstance(value, list) or not value:
        raise _bad(name, "must be a non-empty list of strings")
    if len(value) > MAX_CHOICES:
        raise _bad(name, f"has {len(value)} choices; at most {MAX_CHOICES} are allowed")
    total = 0
    for c in value:
        if not isinstance(c, str):
            raise _bad(name, f"must be a list of strings, got an item of type {type(c).__name__}")
        check_text(name, c)
        total += len(c)
    if total > MAX_SPEC_CHARS:
        raise _bad(name, f"the choices have {total} characters; at most {MAX_SPEC_CHARS} are allowed")
    return json.dumps(value)


def parse_structured_outputs(so) -> GrammarSpec | None:
    """The `GrammarSpec` of a request's ``structured_outputs`` (None: free text), or
    `InvalidRequestError` naming the field. Keys whose value is None are absent (and so is
    ``json_object: false``); exactly one kind must remain."""
    if so is None:
        return None
    if not isinstance(so, dict):
        raise _bad("structured_outputs", f"must be an object, got {type(so).__name__}")
    for k in so:
        if k not in KINDS and k not in OPTIONS:
            raise _bad(f"structured_outputs.{k}" if isinstance(k, str) else "structured_outputs",
                       f"unknown key; use one of {', '.join(KINDS)} and the options {', '.join(OPTIONS)}")
    kinds = [k for k in KINDS if so.get(k) is not None and not (k == "json_object" and so[k] is False)]
    if len(kinds) != 1:
        got = f"has {' and '.join(kinds)}" if kinds else "names no kind"
        raise _bad("structured_outputs", f"{got}; give exactly one of {', '.join(KINDS)}")
    kind = kinds[0]
    name = f"structured_outputs.{kind}"
    opts = {}
    for opt in ("disable_any_whitespace", "disable_additional_properties"):
        v = so.get(opt)
        if v is not None and not isinstance(v, bool):
            raise _bad(f"structured_outputs.{opt}", f"must be a boolean, got {type(v).__name__}")
        opts[opt] = v
    if so.get("whitespace_pattern") is not None:
        raise _bad("structured_outputs.whitespace_pattern",
                   "is not supported by this server's grammar backend (xgrammar); use disable_any_whitespace")
    value = so[kind]
    if kind == "json":
        source = _canonical_json(name, value, "a JSON schema")
    elif kind == "json_object":
        if value is not True:
            raise _bad(name, f"must be true, got {value!r}")
        source = ""
    elif kind == "choice":
        source = _choices(name, value)
    elif kind == "structural_tag":
        source = _canonical_json(name, value, "a structural tag")
    else:  # regex, grammar
        source = _text(name, value)
    return GrammarSpec(kind, source, any_whitespace=not opts["disable_any_whitespace"],
                       strict=opts["disable_additional_properties"] is not False)
