"""The JSON of one tool call, read a character at a time: `CallObject` scans an object
``{"name": "...", "arguments" | "parameters": <value>, ...}`` as a model writes it, reporting the
name once it is whole and passing the arguments' text on as it comes (api/tool_stream.py,
api/tool_parsers.py). It never raises on model output: what is not such an object sets ``bad``.
"""

from __future__ import annotations

import json
from typing import Callable

__all__ = ["CallObject", "WS"]

WS = " \t\r\n"


class CallObject:
    """One JSON object that holds a call, scanned a character at a time: its ``name`` (a string)
    and its arguments (the value of ``arguments`` or ``parameters``: its text is passed on as it
    comes). Other keys are read past. ``bad``: not such an object."""

    ARG_KEYS = ("arguments", "parameters")

    def __init__(self, on_name: Callable[[str], None], on_args: Callable[[str], None]):
        self.on_name, self.on_args = on_name, on_args
        self.depth = 0  # brackets open (the call object itself is depth 1)
        self.phase = "start"  # start, key, colon, value, after (at depth 1); in_value below
        self.in_str = self.esc = False
        self.raw: list[str] = []  # the key, or the name's string, being read
        self.key: str | None = None
        self.kind = ""  # the current value's: container, string, literal
        self.args_seen = self.name_seen = False
        self.done = self.bad = False

    def feed(self, text: str, pos: int) -> int:
        """Scan from ``pos``; return where it stopped (the object's end, the text's end, or the
        character that made it bad)."""
        n = len(text)
        while pos < n and not (self.done or self.bad):
            self._char(text[pos])
            if self.bad:
                return pos
            pos += 1
        return pos

    def _char(self, c: str) -> None:
        ph = self.phase
        if ph == "in_value":
            self._value_char(c)
        elif ph == "start":
            if c == "{":
                self.depth, self.phase = 1, "key"
            elif c not in WS:
                self.bad = True
        elif ph == "key":
            if self.in_str:
                self._string_char(c, self.raw)
                if not self.in_str:
                    self.key = _decode_string(self.raw)
                    self.phase, self.bad = "colon", self.key is None
            elif c == '"':
                self.in_str, self.raw = True, []
            elif c == "}" and self.key is None:
                self._end()
            elif c not in WS:
                self.bad = True
        elif ph == "colon":
            if c == ":":
                self.phase = "value"
            elif c not in WS:
                self.bad = True
        elif ph == "value":
            if c not in WS:
                self._value_start(c)
        elif ph == "after":
            if c == ",":
                self.phase, self.key = "key", ""
            elif c == "}":
                self._end()
            elif c not in WS:
                self.bad = True

    def _arg_value(self) -> bool:
        return self.key in self.ARG_KEYS and not self.args_seen

    def _value_start(self, c: str) -> None:
        self.phase, self.raw = "in_value", []
        if self.key == "name" and c != '"':
            self.bad = True
            return
        if c in "{[":
            self.kind, self.depth = "container", 2
        elif c == '"':
            self.kind, self.in_str = "string", True
        elif c in "-0123456789tfn":
            self.kind = "literal"
        else:
            self.bad = True
            return
        if self._arg_value():
            self.on_args(c)

    def _value_char(self, c: str) -> None:
        if self.kind == "literal" and (c in WS or c in ",}"):
            self._value_end()
            self.phase = "after"
            self._char(c)
            return
        if self._arg_value():
            self.on_args(c)
        if self.kind == "literal":
            if c not in "+-.0123456789eEtrufalsn":
                self.bad = True
            return
        if self.in_str:
            self._string_char(c, self.raw)
            if not self.in_str and self.kind == "string":
                self._value_end()
            return
        if c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._value_end()

    def _value_end(self) -> None:
        self.phase = "after"
        if self.key == "name" and not self.name_seen:
            name = _decode_string(self.raw)
            if name is None or not name:
                self.bad = True
                return
            self.name_seen = True
            self.on_name(name)
        elif self._arg_value():
            self.args_seen = True

    def _string_char(self, c: str, raw: list[str]) -> None:
        if self.esc:
            self.esc = False
        elif c == "\\":
            self.esc = True
        elif c == '"':
            self.in_str = False
            return
        raw.append(c)

    def _end(self) -> None:
        self.depth, self.done = 0, True
        if not self.name_seen:
            self.bad = True


def _decode_string(raw: list[str]) -> str | None:
    try:
        out = json.loads('"' + "".join(raw) + '"')
    except ValueError:
        return None
    return out if isinstance(out, str) else None
