"""What every tool-call parser shares (api/tool_parsers.py has the model families' formats):
the calls and content a parse gives (`ToolCall`, and `Delta`: one step's pieces in OpenAI's
stream shape), the parser's base (`StreamParser`: one call object at a time, its arguments held
until its name is known, a broken format turned into content), a JSON array of call objects
(`ObjectArray`), the two readers of a tool grammar's output (`NamedCall`: all of it is one
function's arguments; `RequiredCalls`: vLLM's ``[{"name", "parameters"}, ...]``), and
`parse_whole`. A call's ``arguments`` is the JSON text of its arguments exactly as the model wrote
it, so a stream's pieces joined by index are the whole parse.
"""

from __future__ import annotations

import abc

import json
import uuid
from dataclasses import dataclass, field
from typing import Callable

from .tool_json import WS, CallObject

__all__ = ["Delta", "ToolCall", "StreamParser", "ObjectArray", "NamedCall", "RequiredCalls", "parse_whole",
           "tool_call_id"]


def tool_call_id() -> str:
    """A tool call's id, vLLM's form: ``chatcmpl-tool-<32 hex digits>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One call as parsed so far."""

    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What one step of parsing adds: content text and, per call index, OpenAI's delta entry
    (the first of a call has id, type and function.name; every one has function.arguments)."""

    content: str = ""
    calls: dict[int, dict] = field(default_factory=dict)

    def start(self, index: int, call: ToolCall) -> None:
        self.calls[index] = {"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}

    def args(self, index: int, text: str) -> None:
        entry = self.calls.setdefault(index, {"index": index, "function": {"arguments": ""}})
        entry["function"]["arguments"] += text

    def merge(self, other: "Delta") -> "Delta":
        self.content += other.content
        for i, entry in other.calls.items():
            if i in self.calls:
                self.calls[i]["function"]["arguments"] += entry["function"]["arguments"]
            else:
                self.calls[i] = entry
        return self

    def tool_calls(self) -> list[dict]:
        return [self.calls[i] for i in sorted(self.calls)]


class StreamParser(abc.ABC):
    """The shared part of every parser: the calls and content so far, the `Delta` of the
    current step, and one call object at a time (its arguments held until its name is known).
    ``max_calls``: calls past it are read and dropped (``parallel_tool_calls: false``)."""

    new_id: Callable[[], str] = staticmethod(tool_call_id)

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self.content = ""
        self.failed = False  # the output broke the format somewhere
        self._delta = Delta()
        self._obj: CallObject | None = None
        self._held_args = ""  # arguments read before the name
        self._named = False  # the current object's call has started
        self._block = ""  # raw text of the current call's block, until its call starts

    # -- for subclasses ---------------------------------------------------------------------
    def _emit_content(self, text: str) -> None:
        if text:
            self.content += text
            self._delta.content += text

    def _new_object(self) -> None:
        self._obj = CallObject(self._on_name, self._on_args)
        self._held_args, self._named = "", False

    def _dropping(self) -> bool:
        return self.max_calls is not None and len(self.calls) >= self.max_calls and not self._named

    def _on_name(self, name: str) -> None:
        if self._dropping():
            return
        call = ToolCall(self.new_id(), name)
        self.calls.append(call)
        self._named, self._block = True, ""
        self._delta.start(len(self.calls) - 1, call)
        if self._held_args:
            self._on_args(self._held_args)
            self._held_args = ""

    def _on_args(self, text: str) -> None:
        if not text:
            return
        if not self._named:
            self._held_args += text
            return
        self.calls[-1].arguments += text
        self._delta.args(len(self.calls) - 1, text)

    def _scan_object(self, text: str, pos: int) -> int:
        """Feed the current call object; on its end, a call without arguments gets ``{}``."""
        obj = self._obj
        assert obj is not None
        start = pos
        pos = obj.feed(text, pos)
        if not self._named:
            self._block += text[start:pos]
        if obj.done and self._named and not obj.args_seen:
            self._on_args("{}")
        return pos

    def _break(self, rest: str) -> None:
        """The format broke: what was read of the block without a call, and the rest, are content."""
        self.failed = True
        self._emit_content(self._block + rest)
        self._block = ""

    def _take(self) -> Delta:
        out, self._delta = self._delta, Delta()
        return out

    # -- the interface ----------------------------------------------------------------------
    @abc.abstractmethod
    def feed(self, text: str) -> Delta:
        """The delta the next piece of model text makes."""

    @abc.abstractmethod
    def finish(self) -> Delta:
        """What the output's end releases."""


class ObjectArray:
    """``[`` call objects separated by ``,`` ``]`` for a parser (mistral, required)."""

    def __init__(self, parser: StreamParser):
        self.p = parser
        self.phase = "open"  # open; first (after "["); item (after ","); object; next (after an object)
        self.done = self.bad = False

    def feed(self, buf: str, pos: int) -> int:
        p = self.p
        while pos < len(buf) and not (self.done or self.bad):
            if self.phase == "object":
                pos = p._scan_object(buf, pos)
                obj = p._obj
                assert obj is not None
                if obj.bad:
                    self.bad = True
                elif obj.done:
                    self.phase = "next"
                continue
            c, ph = buf[pos], self.phase
            if c == "{" and ph in ("first", "item"):
                self.phase = "object"
                p._new_object()
                continue  # the object reads its own "{"
            if c == "[" and ph == "open":
                self.phase = "first"
            elif c == "]" and ph in ("first", "next"):
                self.done = True
            elif c == "," and ph == "next":
                self.phase = "item"
            elif c not in WS:
                self.bad = True
                return pos
            p._block += c
            pos += 1
        return pos


class NamedCall(StreamParser):
    """The output of a named function's grammar: all of it is that function's arguments."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Delta:
        if not self.calls:
            self._named = False
            self._on_name(self.name)
        self._on_args(text)
        return self._take()

    def finish(self) -> Delta:
        if not self.calls:
            self._on_name(self.name)
        return self._take()


class RequiredCalls(StreamParser):
    """The output of the ``required`` grammar: ``[{"name": ..., "parameters": {...}}, ...]``."""

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._array = ObjectArray(self)
        self._broken = False

    def feed(self, text: str) -> Delta:
        if self._broken:
            self._emit_content(text)
            return self._take()
        pos = self._array.feed(text, 0)
        if self._array.bad:
            self._broken = True
            self._break(text[pos:])
        elif self._array.done and pos < len(text):
            self._emit_content(text[pos:])
        return self._take()

    def finish(self) -> Delta:
        if not (self._array.done or self._broken):
            # Cut short (max_tokens): the calls started stay as they are; what never became one is content.
            self.failed = not self.calls
            self._emit_content(self._block)
            self._block = ""
        return self._take()


def parse_whole(parser: StreamParser, text: str, keep_partial: bool = False) -> tuple[str | None, list[ToolCall]]:
    """The content and calls of a whole output. A format broken anywhere, or a call cut short,
    makes all of the text content and no call (vLLM's rule); ``keep_partial`` (the grammar
    parsers) keeps the calls as the stream gave them instead."""
    parser.feed(text)
    parser.finish()
    calls = parser.calls
    if not keep_partial and (parser.failed or any(not _is_json(c.arguments) for c in calls)):
        return text, []
    content = parser.content
    if calls and not content.strip():
        return None, calls
    return content, calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
