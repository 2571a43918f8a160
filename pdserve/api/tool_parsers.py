"""Tool-call parsers of chat output, one per model family, named as vLLM's
``--tool-call-parser`` names them (`PARSERS`): ``hermes`` (Hermes and Qwen: ``<tool_call>{"name":
..., "arguments": {...}}</tool_call>`` blocks in free text), ``llama3_json`` (Llama 3.x: the whole
output is ``{"name": ..., "parameters": {...}}`` objects separated by ``;``) and ``mistral``
(``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text). The readers of a tool
grammar's output, and what all parsers share, are api/tool_stream.py.

Every parser is a character-level state machine over the text so far: `feed` returns a `Delta`
(content, and the calls' first and following pieces in OpenAI's shape), `finish` what was held
back. The concatenated streamed pieces equal the whole parse (`parse_whole`). Output that breaks
the format is content: the whole parse then returns all of it as content and no call (vLLM's
behaviour); a stream goes on with it as content from where it broke. Nothing here raises on
model output.
"""

from __future__ import annotations

import abc

import secrets
import string
from typing import Callable

from .tool_json import WS
from .tool_stream import Delta, ObjectArray, StreamParser

__all__ = ["HermesParser", "Llama3JsonParser", "MistralParser", "PARSERS"]


def _mistral_id() -> str:
    """Mistral's templates take 9 letters and digits (vLLM's mistral parser makes these)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class _TaggedParser(StreamParser):
    """Content, then a start tag, then the calls' JSON (`_after_tag`), then content again.
    Text that may be the start of the tag is held back."""

    TAG = ""

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.state = "text"
        self._pending = ""  # text in the "text" state not yet passed on
        self._broken = False

    def feed(self, text: str) -> Delta:
        if self._broken:
            self._emit_content(text)
            return self._take()
        buf = self._pending + text
        self._pending = ""
        pos = 0
        while pos < len(buf) and not self._broken:
            if self.state == "text":
                at = buf.find(self.TAG, pos)
                if at < 0:
                    keep = _partial_suffix(buf, self.TAG, pos)
                    self._emit_content(buf[pos:len(buf) - keep])
                    self._pending = buf[len(buf) - keep:]
                    return self._take()
                self._emit_content(buf[pos:at])
                pos = at + len(self.TAG)
                self._block = self.TAG
                self._enter()
            else:
                pos = self._after_tag(buf, pos)
        return self._take()

    def finish(self) -> Delta:
        if self._broken:
            return self._take()
        if self.state == "text":
            self._emit_content(self._pending)
            self._pending = ""
        elif not self._complete_at_end():
            self._break(self._pending)
        return self._take()

    def _fail(self, buf: str, pos: int) -> int:
        self._broken = True
        self._break(buf[pos:])
        return len(buf)

    @abc.abstractmethod
    def _enter(self) -> None:
        """The family's opening tag was seen."""

    @abc.abstractmethod
    def _after_tag(self, buf: str, pos: int) -> int:
        """Parse on from ``pos`` after the tag; where parsing stopped."""

    @abc.abstractmethod
    def _complete_at_end(self) -> bool:
        """Whether what was read so far is a whole call list when the output ends."""


def _partial_suffix(buf: str, tag: str, start: int) -> int:
    """Length of the longest tail of ``buf[start:]`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(buf) - start), 0, -1):
        if tag.startswith(buf[len(buf) - k:]):
            return k
    return 0


class HermesParser(_TaggedParser):
    """``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3): ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` blocks anywhere in the text; text around them is content. A last block may
    lack its closing tag (the output ended there)."""

    TAG = "<tool_call>"
    END = "</tool_call>"

    def _enter(self) -> None:
        self.state = "object"
        self._new_object()
        self._closing = ""

    def _after_tag(self, buf: str, pos: int) -> int:
        if self.state == "object":
            pos = self._scan_object(buf, pos)
            obj = self._obj
            assert obj is not None
            if obj.bad:
                return self._fail(buf, pos)
            if obj.done:
                self.state = "close"
            return pos
        # "close": white space, then the end tag
        while pos < len(buf):
            c = buf[pos]
            if not self._closing and c in WS:
                pos += 1
                continue
            self._closing += c
            pos += 1
            if not self.END.startswith(self._closing):
                return self._fail(buf, pos)
            if self._closing == self.END:
                self.state = "text"
                return pos
        return pos

    def _complete_at_end(self) -> bool:
        return self.state == "close" and self.END.startswith(self._closing)


class MistralParser(_TaggedParser):
    """``mistral``: text, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``
    objects; text after the array is content. Call ids are 9 letters and digits (Mistral's
    templates take no other; vLLM's mistral parser makes the same)."""

    TAG = "[TOOL_CALLS]"
    new_id = staticmethod(_mistral_id)

    def _enter(self) -> None:
        self.state = "array"
        self._array = ObjectArray(self)

    def _after_tag(self, buf: str, pos: int) -> int:
        pos = self._array.feed(buf, pos)
        if self._array.bad:
            return self._fail(buf, pos)
        if self._array.done:
            self.state = "text"
        return pos

    def _complete_at_end(self) -> bool:
        return self._array.done


class Llama3JsonParser(StreamParser):
    """``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole output is call objects
    (``{"name": ..., "parameters": {...}}``), separated by ``;``, optionally after
    ``<|python_tag|>``. Output that starts otherwise is content."""

    TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.state = "lead"  # lead (deciding), object, between, text (all content)
        self._lead = ""

    def feed(self, text: str) -> Delta:
        if self.state == "text":
            self._emit_content(text)
            return self._take()
        pos = 0
        if self.state == "lead":
            self._lead += text
            head = self._lead.lstrip(WS)
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip(WS)
            elif self.TAG.startswith(head) and head:
                return self._take()
            if not head:
                return self._take()
            if head[0] != "{":
                self.state = "text"
                self._emit_content(self._lead)
                return self._take()
            self.state, self._block = "object", self._lead[:len(self._lead) - len(head)]
            self._new_object()
            text, self._lead = head, ""
        while pos < len(text) and self.state != "text":
            if self.state == "object":
                pos = self._scan_object(text, pos)
                obj = self._obj
                assert obj is not None
                if obj.bad:
                    self.state = "text"
                    self._break(text[pos:])
                    return self._take()
                if obj.done:
                    self.state = "between"
                continue
            c = text[pos]
            pos += 1
            if c == ";":
                self.state = "next"
            elif c == "{" and self.state == "next":
                self.state = "object"
                self._new_object()
                pos -= 1
            elif c not in WS:
                self.state = "text"
                self._break(text[pos - 1:])
        return self._take()

    def finish(self) -> Delta:
        if self.state == "lead":
            self._emit_content(self._lead)
        elif self.state in ("object", "next"):
            self._break("")
        return self._take()


PARSERS: dict[str, Callable[..., StreamParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
}
