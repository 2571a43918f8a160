"""Tool calling and reasoning on /v1/chat/completions, as vLLM serves them.

Request side (`plan_tools`): which calls a request allows and how they are made.

- ``tool_choice: "none"`` (the default without tools): free text; the tools are still shown to
  the template (vLLM's default).
- a named function, or ``"required"``: enforced by a grammar (engine/structured.py), as vLLM
  does: the named function's parameters schema (the output is its arguments), or an array of
  ``{"name": <one tool's name>, "parameters": <that tool's schema>}`` objects (at least one; at
  most one with ``parallel_tool_calls: false``). The JSON is written without free white space
  (``disable_any_whitespace``: ``", "`` and ``": "`` separate), so a call always ends within its
  schema's bounds; every returned call's arguments follow its tool's schema.
- ``"auto"`` (the default with tools): free text read by the worker's ``--tool-call-parser``
  (api/tool_parsers.py); it needs ``--enable-auto-tool-choice`` (else a 400, vLLM's message).

Reply side (`ChoiceShaper`): one choice's text becomes ``reasoning_content`` (with
``--reasoning-parser``, api/reasoning.py), ``content`` and ``tool_calls``, whole or as OpenAI's
stream deltas; ``finish_reason`` is ``tool_calls`` when calls were returned and the output ended
by itself.

History (`template_messages`): ``tool`` messages and assistant messages with ``tool_calls``
render through the chat template with HF's semantics (each call's arguments as an object).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable

from .ingress import GenerateInput, RequestError
from .openai_structured import SOURCES, StructuredFields
from .openai_tools import ToolFields
from .reasoning import PARSERS as REASONING_PARSERS
from .reasoning import ReasoningParser
from .tool_parsers import PARSERS as TOOL_PARSERS
from .tool_stream import NamedCall, RequiredCalls, StreamParser, parse_whole

__all__ = ["ChatOptions", "ToolPlan", "plan_tools", "template_messages", "ChoiceShaper", "AUTO_NEEDS_FLAGS",
           "TOOL_PARSERS", "REASONING_PARSERS", "add_chat_flags"]

# vLLM's 400 for "auto" on a server started without auto tool choice, word for word.
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ChatOptions:
    """How a worker reads chat output (vLLM's server flags of the same names):
    ``enable_auto_tool_choice`` (``--enable-auto-tool-choice``, needs a ``tool_call_parser``),
    ``tool_call_parser`` (one of `TOOL_PARSERS`), ``reasoning_parser`` (one of
    `REASONING_PARSERS`). ValueError naming the setting for a bad one."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: {self.tool_call_parser!r} is not a tool-call parser; use one of "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: {self.reasoning_parser!r} is not a reasoning parser; use one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs tool_call_parser (--tool-call-parser) too")


def add_chat_flags(group, auto_default: bool | None = False) -> None:
    """The flags of `ChatOptions` on an argparse group (a decode worker's and a gateway's):
    ``auto_default`` None lets a caller tell "not given" from False (the gateway's defaults
    come from the topology)."""
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=auto_default,
                       help='serve tool_choice "auto" (the default when a request has tools): the model\'s output '
                            "is read for calls by --tool-call-parser")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how calls are written in the model's free output (hermes also reads Qwen's)")
    group.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                       help="put the text inside <think>...</think> into reasoning_content")


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request allows: ``mode`` none | auto | named | required; ``tools`` as the
    template gets them (None: the request has none); ``name`` the named function's."""

    mode: str = "none"
    tools: list[dict] | None = None
    name: str | None = None
    parallel: bool = True
    structured_outputs: dict | None = None
    # the engine's names of a grammar's errors -> the request field they come from
    renames: dict[str, str] | None = None

    def apply(self, inp: GenerateInput, body: StructuredFields) -> None:
        """Give one prompt of the request its tools (the template shows them) and, for required or
        a named function, the calls' grammar: a 400 naming the structured-output field the
        request also set (two constraints cannot both hold)."""
        inp.tools = self.tools
        if self.structured_outputs is None:
            return
        if inp.params.structured_outputs is not None:
            field = next((f for f in SOURCES if getattr(body, f) is not None
                          and not (f == "response_format" and getattr(body, f).type == "text")), "structured_outputs")
            raise RequestError("invalid_argument", f"{field}: not with tool_choice {self.mode} (its calls are "
                               "already constrained by the tools' schemas); drop one of them", field)
        inp.params = dataclasses.replace(inp.params, structured_outputs=self.structured_outputs)

    def shaper(self, options: ChatOptions) -> Callable[[], "ChoiceShaper"] | None:
        """A factory of per-choice shapers, or None when the reply is plain text."""
        if self.mode == "none" and options.reasoning_parser is None:
            return None
        max_calls = None if self.parallel else 1

        def tools() -> StreamParser | None:
            if self.mode == "named":
                assert self.name is not None
                return NamedCall(self.name)
            if self.mode == "required":
                return RequiredCalls(max_calls)
            if self.mode == "auto":
                assert options.tool_call_parser is not None
                return TOOL_PARSERS[options.tool_call_parser](max_calls)
            return None

        # A grammar's output is the calls from its first character: no reasoning is read out of it.
        reasoning = options.reasoning_parser if self.mode in ("none", "auto") else None
        return lambda: ChoiceShaper(ReasoningParser(reasoning) if reasoning else None, tools(),
                                    keep_partial=self.mode in ("named", "required"))


def plan_tools(body: ToolFields, options: ChatOptions) -> ToolPlan:
    """The request's `ToolPlan`, or a RequestError naming the field (vLLM's checks)."""
    tools = list(body.tools or [])
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    seen: dict[str, int] = {}
    for i, t in enumerate(tools):
        name = t.function.name
        if name in seen:
            raise RequestError("invalid_argument", f"tools[{i}].function.name: {name!r} is also tools[{seen[name]}]'s; "
                               "tool names must be unique", f"tools[{i}].function.name")
        seen[name] = i
    implicit = choice is None
    if choice is None:
        choice = "auto" if tools else "none"  # vLLM's default
    if choice == "none":
        return ToolPlan("none", [t.model_dump(exclude_none=True) for t in tools] or None, parallel=parallel)
    if not tools:
        if body.tools is not None and choice == "required":
            return ToolPlan("none", parallel=parallel)  # vLLM: required over no tools is none
        raise RequestError("invalid_argument", "tool_choice: needs tools (when using tool_choice, tools must be set)",
                           "tool_choice")
    specs = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_call_parser):
            field = "tools" if implicit else "tool_choice"
            hint = " (tool_choice defaults to auto when tools are given; send tool_choice none, required or a " \
                   "named function, or start the worker with those flags)" if implicit else ""
            raise RequestError("invalid_argument", f"{field}: {AUTO_NEEDS_FLAGS}{hint}", field)
        return ToolPlan("auto", specs, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", specs, parallel=parallel, structured_outputs=_required_grammar(tools, parallel),
                        renames={"structured_outputs": "tools", "structured_outputs.json": "tools"})
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in seen:
        raise RequestError("invalid_argument", f"tool_choice: function {name!r} is not one of the tools "
                           f"({', '.join(seen)})", "tool_choice")
    params = tools[seen[name]].function.parameters
    field = f"tools[{seen[name]}].function.parameters"
    return ToolPlan("named", specs, name, parallel, {"json": params or _NO_ARGUMENTS, "disable_any_whitespace": True},
                    {"structured_outputs": field, "structured_outputs.json": field})


def _required_grammar(tools, parallel: bool) -> dict:
    """vLLM's ``required`` schema: an array of {"name": one tool's, "parameters": its schema}
    (each tool's ``$defs`` lifted to the top, where its references point)."""
    defs: dict[str, Any] = {}
    options = []
    for i, t in enumerate(tools):
        params = dict(t.function.parameters or _NO_ARGUMENTS)
        for key in ("$defs", "definitions"):
            for def_name, d in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(def_name, d) != d:
                    field = f"tools[{i}].function.parameters"
                    raise RequestError("invalid_argument", f"{field}: {key}.{def_name} differs from another tool's "
                                       "of the same name; rename one (tool_choice required puts them together)",
                                       field)
        options.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return {"json": schema, "disable_any_whitespace": True}


def template_messages(messages) -> list[dict]:
    """Chat messages as the template gets them (HF semantics): ``developer`` read as ``system``,
    text parts joined with newlines, an assistant's ``tool_calls`` with each call's arguments as
    an object, a ``tool`` message with its ``tool_call_id``. RequestError naming the field for a
    message that breaks OpenAI's rules."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(x.text for x in m.content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls is not None and m.role != "assistant":
            raise RequestError("invalid_argument", f"{where}.tool_calls: only an assistant message makes calls",
                               f"{where}.tool_calls")
        if m.role == "tool":
            if m.tool_call_id is None:
                raise RequestError("invalid_argument", f"{where}.tool_call_id: a tool message needs the id of the call "
                                   "it answers", f"{where}.tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_call_of(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
            msg["content"] = content or ""  # templates concatenate it
        elif content is None:
            raise RequestError("invalid_argument", f"{where}.content: is required (null only on an assistant "
                               "message with tool_calls)", f"{where}.content")
        out.append(msg)
    return out


def _call_of(call, where: str) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise RequestError("invalid_argument", f"{where}.function.arguments: must be a JSON object as text",
                           f"{where}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class ChoiceShaper:
    """One choice's text as OpenAI's message or deltas: reasoning (if a parser is set) first,
    then the tool-call parser over the rest. ``keep_partial``: the calls of a grammar stay as
    generated when the output is cut short (the auto parsers make such output content)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: StreamParser | None, keep_partial: bool = False):
        self.reasoning, self.tools, self.keep_partial = reasoning, tools, keep_partial
        self.called = False

    def feed(self, text: str, final: bool = False) -> dict:
        """The delta of a streamed chunk's text (``final``: its last, held-back text included)."""
        thought, answer = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            more = self.reasoning.finish()
            thought, answer = thought + more[0], answer + more[1]
        delta: dict[str, Any] = {}
        if thought:
            delta["reasoning_content"] = thought
        if self.tools is None:
            if answer:
                delta["content"] = answer
            return delta
        d = self.tools.feed(answer)
        if final:
            d.merge(self.tools.finish())
        if d.content:
            delta["content"] = d.content
        if d.calls:
            self.called = True
            delta["tool_calls"] = d.tool_calls()
        return delta

    def message(self, text: str) -> dict:
        """The whole choice's message."""
        msg: dict[str, Any] = {"role": "assistant"}
        if self.reasoning:
            thought, answer = self.reasoning.whole(text)
            msg["reasoning_content"] = thought
            text = answer or ""
        content: str | None = text
        if self.tools is not None:
            content, calls = parse_whole(self.tools, text, self.keep_partial)
            if calls:
                self.called = True
                msg["tool_calls"] = [c.as_openai() for c in calls]
        msg["content"] = content if content or not (self.called or msg.get("reasoning_content")) else None
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` for an output with calls that ended by itself (vLLM's and OpenAI's)."""
        return "tool_calls" if reason == "stop" and self.called else reason
