"""Reasoning parsers of chat output: the text inside ``<think>...</think>`` goes to
``reasoning_content``, the rest to ``content`` (vLLM's ``--reasoning-parser``; `PARSERS`).

``deepseek_r1``: the output is reasoning until ``</think>`` (the model's template opens the
``<think>`` in the prompt, so the output may or may not repeat it); without ``</think>`` all of
it is reasoning (vLLM's rule). ``qwen3``: an output that starts with ``<think>`` is reasoning
until ``</think>`` (or its end, when it was cut short: vLLM calls all of that content); any other
output is content. Streaming and whole parsing agree: the whole parse is the stream's pieces
joined. Text that may be the start of a tag is held back until it is known not to be.
"""

from __future__ import annotations

__all__ = ["ReasoningParser", "PARSERS", "START", "END"]

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


class ReasoningParser:
    """One choice's reasoning split; ``name`` is one of `PARSERS`."""

    def __init__(self, name: str):
        if name not in PARSERS:
            raise ValueError(f"reasoning parser {name!r}; use one of {', '.join(PARSERS)}")
        self.name = name
        # lead: before the output's first characters are known; thinking; answer
        self.state = "lead"
        self._held = ""
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Add text; return the (reasoning, content) it makes final."""
        buf, self._held = self._held + text, ""
        reasoning = content = ""
        if self.state == "lead":
            head = buf.lstrip() if self.name == "qwen3" else buf
            if START.startswith(head) and len(head) < len(START):
                self._held = buf  # could still be "<think>"
                return "", ""
            if head.startswith(START):
                buf = head[len(START):]
                self.state = "thinking"
            elif self.name == "qwen3":
                self.state = "answer"
            else:
                self.state = "thinking"
        if self.state == "thinking":
            at = buf.find(END)
            if at < 0:
                keep = _partial_tail(buf, END)
                reasoning, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
                buf = ""
            else:
                reasoning, buf = buf[:at], buf[at + len(END):]
                self.state = "answer"
        if self.state == "answer":
            content = buf
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held-back text at the end of the output."""
        held, self._held = self._held, ""
        if self.state == "thinking" or (self.state == "lead" and self.name == "deepseek_r1"):
            self.reasoning += held
            return held, ""
        self.content += held
        return "", held

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is empty."""
        self.feed(text)
        self.finish()
        return self.reasoning or None, self.content or None


def _partial_tail(buf: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[len(buf) - k:]):
            return k
    return 0
