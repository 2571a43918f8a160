"""Renders the generated parts of docs/api.md: the HTTP request fields (from the
pydantic models, so from the same declarations the server validates with) and the
gRPC proto (verbatim, with its comments).

``python -m pdserve.api.reference docs/api.md`` rewrites those parts in place;
tests/decode/test_api_docs.py fails when the page and the code disagree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .openai_types import Bounds, request_models

# The worker the tables describe: a 4096-token model with a 32000-token vocabulary
# and the default limits (each bound below scales with the worker's own).
REFERENCE = Bounds(max_model_len=4096, vocab_size=32000, max_prompt_chars=4096 * 16)
PROTO = Path(__file__).resolve().parent / "proto" / "pdserve" / "api" / "v1" / "inference.proto"
BLOCK = re.compile(r"(<!-- generated: (\S+) -->\n).*?(<!-- end generated -->)", re.S)


def _type(s: dict, defs: dict) -> str:
    if "$ref" in s:
        return s["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in s:
        return " \\| ".join(_type(x, defs) for x in s["anyOf"])
    if "const" in s:
        return f"`{s['const']!r}`"
    if "enum" in s:
        return " \\| ".join(f"`{v}`" for v in s["enum"])
    t = s.get("type", "any")
    if t == "array":
        return f"array of {_type(s.get('items', {}), defs)}"
    return t


def _bounds(s: dict) -> str:
    members = s.get("anyOf", [s])
    if len(members) > 1:  # per member of a union: "string: length >= 1; array of integer: ..."
        return "; ".join(f"{_type(m, {})}: {b}" for m in members if (b := _bounds(m)))
    x, parts = members[0], []
    for key, label in (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"),
                       ("minLength", "length >= {}"), ("maxLength", "length <= {}"),
                       ("minItems", "items >= {}"), ("maxItems", "items <= {}"),
                       ("maxProperties", "entries <= {}"), ("pattern", "pattern `{}`")):
        if key in x:
            parts.append(label.format(x[key]))
    if x.get("type") == "array" and (inner := _bounds(x.get("items", {}))):
        parts.append(f"each {inner}")
    return ", ".join(parts)


def fields_table(schema: dict) -> str:
    """A markdown table of one object schema's fields."""
    required = set(schema.get("required", []))
    rows = ["| field | type | bounds | default | notes |", "|---|---|---|---|---|"]
    for name, s in schema["properties"].items():
        default = "required" if name in required else f"`{json.dumps(s['default'])}`" if "default" in s else ""
        rows.append(f"| `{name}` | {_type(s, {})} | {_bounds(s)} | {default} | {s.get('description', '')} |")
    return "\n".join(rows)


def render(name: str) -> str:
    models = request_models(REFERENCE)
    chat = models.chat.model_json_schema()
    if name == "completions-fields":
        return fields_table(models.completion.model_json_schema())
    if name == "chat-fields":
        return fields_table(chat)
    if name == "chat-message-fields":
        return fields_table(chat["$defs"]["ChatMessage"])
    if name == "proto":
        return f"```proto\n{PROTO.read_text().rstrip()}\n```"
    raise KeyError(f"unknown generated block {name!r}")


def regenerate(page: str) -> str:
    """The page with every generated block rendered anew."""
    return BLOCK.sub(lambda m: f"{m.group(1)}{render(m.group(2))}\n{m.group(3)}", page)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pdserve.api.reference",
                                     description="Rewrite the generated parts of an API reference page in place "
                                     "(between '<!-- generated: NAME -->' and '<!-- end generated -->'): the HTTP "
                                     "request fields from the pydantic models and the gRPC proto.")
    parser.add_argument("page", nargs="?", default="docs/api.md", help="the page to rewrite (default: %(default)s)")
    path = Path(parser.parse_args().page)
    path.write_text(regenerate(path.read_text()))
