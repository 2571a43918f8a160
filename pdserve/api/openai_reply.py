"""OpenAI's response JSON, shaped from the chunks a pdserve worker streams.

`Reply` turns one request's ``(choice index, chunk)`` pairs into completion or
chat objects (whole, or one server-sent event per chunk): text with any echoed
prompt, logprobs in OpenAI's two shapes (legacy completions, chat), the
pdserve extensions (``token_ids``, the ``pdserve`` breakdown). With a shaper (api/tool_calls.py
`ChoiceShaper`), a chat choice's text is read into ``reasoning_content``, ``content`` and
``tool_calls`` (deltas when streaming). A chunk is
anything with ``token_ids``, ``text``, ``finish_reason``, ``logprobs`` (the
engine's ``{token_id, logprob, top_logprobs}`` entries), ``prompt_logprobs`` (vLLM's shape:
completions per choice, chat at the top level) and ``breakdown``.
The shapes are the models of `openai_types`; the schema tests hold them to it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from .openai_types import LOGPROB_FLOOR

if TYPE_CHECKING:
    from .tool_calls import ChoiceShaper

__all__ = ["Reply", "usage_of", "merge_choice"]


def _finite(lp: float | None) -> float:
    return LOGPROB_FLOOR if lp is None or lp != lp or lp < LOGPROB_FLOOR else lp


def prompt_logprobs_json(entries: list[dict], token_text: Callable[[int], str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token null (the first) or ``{token id: {logprob,
    rank, decoded_token}}`` for the prompt token and the N most likely ones."""
    out: list[dict | None] = []
    for e in entries:
        if e["logprob"] is None:
            out.append(None)
            continue
        tid = e["token_id"]
        d = {str(tid): {"logprob": _finite(e["logprob"]), "rank": e["rank"], "decoded_token": token_text(tid)}}
        tops = sorted((e.get("top_logprobs") or {}).items(), key=lambda kv: -kv[1])
        for rank, (t, v) in enumerate(tops, 1):
            d.setdefault(str(t), {"logprob": _finite(v), "rank": rank, "decoded_token": token_text(t)})
        out.append(d)
    return out


class Reply:
    """Shapes one request's (choice index, chunk) pairs as OpenAI's JSON; ``kind`` is
    "completion" or "chat", ``token_text`` gives a token id's text (logprobs)."""

    def __init__(self, kind: str, rid: str, model: str, token_text: Callable[[int], str],
                 logprobs: int | None, echo: list[str], shaper: Callable[[], "ChoiceShaper"] | None = None):
        self.kind, self.rid, self.model, self.token_text = kind, rid, model, token_text
        self.created = int(time.time())
        self.logprobs = logprobs  # None: not asked; else how many alternatives per token
        self.echo = echo  # per choice: text to prepend (completions' echo)
        self.sent_chars: dict[int, int] = {}  # per choice: text sent so far (logprobs' text_offset)
        self.shaper = shaper  # chat: makes each choice's reader of reasoning and tool calls (None: plain text)
        self.shapers: dict[int, ChoiceShaper] = {}

    def shaper_of(self, i: int) -> "ChoiceShaper | None":
        if self.shaper is None:
            return None
        if i not in self.shapers:
            self.shapers[i] = self.shaper()
        return self.shapers[i]

    def text_of(self, i: int, c) -> str:
        if i not in self.sent_chars:
            self.sent_chars[i] = 0
            if self.echo:
                return self.echo[i] + c.text
        return c.text

    def logprobs_of(self, i: int, c, text: str) -> dict | None:
        if self.logprobs is None:
            return None
        tt = self.token_text
        if self.kind == "chat":
            content = []
            for e in c.logprobs:
                tok = tt(e["token_id"])
                tops = sorted((e.get("top_logprobs") or {}).items(), key=lambda kv: -kv[1])[: self.logprobs]
                content.append({"token": tok, "logprob": _finite(e["logprob"]), "bytes": list(tok.encode()),
                                "top_logprobs": [{"token": tt(t), "logprob": _finite(v), "bytes": list(tt(t).encode())}
                                                 for t, v in tops]})
            return {"content": content}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.sent_chars[i] + len(text) - len(c.text)  # after any echoed prompt
        if self.echo and c.prompt_logprobs is not None:  # echo with logprobs: the prompt's tokens first
            at = 0
            for e in c.prompt_logprobs:
                tok = tt(e["token_id"])
                top: dict[str, float] | None = None
                if e["logprob"] is not None:
                    top = {tt(t): _finite(v) for t, v in (e.get("top_logprobs") or {}).items()}
                    top.setdefault(tok, _finite(e["logprob"]))
                out["tokens"].append(tok)
                out["token_logprobs"].append(None if e["logprob"] is None else _finite(e["logprob"]))
                out["top_logprobs"].append(top)
                out["text_offset"].append(at)
                at += len(tok)
        for e in c.logprobs:
            tok, lp = tt(e["token_id"]), _finite(e["logprob"])
            top = {tt(t): _finite(v) for t, v in (e.get("top_logprobs") or {}).items()}
            top.setdefault(tok, lp)  # vLLM's shape: the sampled token and the N most likely
            out["tokens"].append(tok)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(tok)
        return out

    def choice(self, i: int, c, stream: bool) -> dict:
        text = self.text_of(i, c)
        lp = self.logprobs_of(i, c, text)
        self.sent_chars[i] += len(text)
        body: dict[str, object]
        finish = c.finish_reason
        shaper = self.shaper_of(i) if self.kind == "chat" else None
        if shaper is not None and stream:
            body = {"delta": shaper.feed(text, final=finish is not None)}
            finish = shaper.finish_reason(finish)
        elif self.kind == "chat":
            body = {"delta": {"content": text}} if stream else {"message": {"role": "assistant", "content": text}}
        else:
            body = {"text": text}
        out = {"index": i, **body, "logprobs": lp, "finish_reason": finish, "token_ids": c.token_ids}
        if c.prompt_logprobs is not None:  # (a chat reply has them at its top level: `envelope`)
            out["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs, self.token_text)
        if c.breakdown is not None:
            out["pdserve"] = c.breakdown
        return out

    def shaped(self, choice: dict) -> dict:
        """A whole (merged) chat choice with its text read by its shaper: reasoning, content, calls."""
        shaper = self.shaper_of(choice["index"]) if self.kind == "chat" else None
        if shaper is None:
            return choice
        choice["message"] = shaper.message(choice["message"]["content"])
        choice["finish_reason"] = shaper.finish_reason(choice["finish_reason"])
        return choice

    def envelope(self, choices: list[dict], stream: bool) -> dict:
        obj = {"chat": ("chat.completion.chunk", "chat.completion"),
               "completion": ("text_completion", "text_completion")}[self.kind][0 if stream else 1]
        out = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.kind == "chat":  # vLLM's chat shape: the prompt's logprobs once, beside the choices
            lifted = [c.pop("prompt_logprobs") for c in choices if "prompt_logprobs" in c]
            if lifted:
                out["prompt_logprobs"] = lifted[0]
        return out


def usage_of(chunks: list[tuple[int, Any]], n: int) -> dict:
    """Prompt tokens once per prompt (not per sample), generated tokens of every choice."""
    prompt = sum((c.breakdown or {}).get("prompt_tokens", 0) for i, c in chunks if i % n == 0)
    completion = sum(len(c.token_ids) for _, c in chunks)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def merge_choice(parts: list[dict]) -> dict:
    """One choice from its per-chunk pieces (text, token ids, logprobs concatenated)."""
    out = dict(parts[-1])
    for key in ("text",):
        if key in out:
            out[key] = "".join(p[key] for p in parts)
    if "message" in out:
        out["message"] = {"role": "assistant", "content": "".join(p["message"]["content"] for p in parts)}
    out["token_ids"] = [t for p in parts for t in p["token_ids"]]
    prompt_lps = next((p["prompt_logprobs"] for p in parts if "prompt_logprobs" in p), None)
    if prompt_lps is not None:
        out["prompt_logprobs"] = prompt_lps
    if out["logprobs"] is not None:
        out["logprobs"] = {k: [x for p in parts for x in p["logprobs"][k]] for k in out["logprobs"]}
    return out
