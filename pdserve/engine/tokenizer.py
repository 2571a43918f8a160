"""Tokenizer (HF `tokenizer.json`) and incremental detokenization."""

from __future__ import annotations

import functools
import json
import logging
import os

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from .config_error import ConfigError
from .stops import StopAutomaton, automaton_for

log = logging.getLogger(__name__)

# Prompt tokens given to a new decode stream as context, so that the first
# generated token keeps its leading space ("Hello" -> " world").
_STREAM_CONTEXT_TOKENS = 6


class Tokenizer:
    """A model directory's tokenizer: encode, decode, special ids, chat template."""

    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(
                f"model={model_dir!r}: tokenizer.json is missing; pass token ids instead of text, "
                "or add the tokenizer files to the directory"
            )
        self._tk = _HFTokenizer.from_file(path)
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        cfg = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        self.chat_template: str | None = cfg.get("chat_template")
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                self.chat_template = f.read()
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_token_id = self._tk.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tk.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters: a bound on the text one token
        covers, so ``max_model_len * max_token_chars`` characters can be refused
        without tokenizing them."""
        return max((len(t) for t in self._tk.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's Jinja chat template, as HF `transformers` does:
        the template gets ``messages``, ``tools`` (None without), ``add_generation_prompt``,
        ``bos_token`` and ``eos_token``; it runs sandboxed, with HF's ``tojson`` (no HTML
        escaping), ``raise_exception`` and ``strftime_now``, and a missing key reads as undefined
        (templates test ``message.tool_calls`` on messages without it). ValueError ("messages: ...")
        when the template refuses the messages or fails on them."""
        import jinja2

        template = self._compiled_template
        try:
            return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as exc:
            raise ValueError(f"messages: the chat template failed on them: {exc}") from None

    @functools.cached_property
    def _compiled_template(self):
        if not self.chat_template:
            raise ConfigError("this model's tokenizer has no chat_template; use the completions API")
        import datetime

        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise ValueError(f"messages: {msg}")

        def tojson(value, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def stream(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


_OFFSET_WINDOW = 5  # ids decoded ahead of the new ones, for their spacing and merges
_MAX_HELD = 8  # ids held back at most for an incomplete character (a UTF-8 character has <= 4 bytes)


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):  # {"content": "<s>", ...} in older configs
        return tok.get("content")
    return tok


class IncrementalDetokenizer:
    """Turns generated ids into text deltas and applies stop strings.

    ``push(token_id)`` returns the text that became final with this token
    (possibly empty while a multi-byte character is incomplete). With stop
    strings, text that could still be the start of a stop string is held
    back, so a stop string never reaches a streaming client.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self._tk = tokenizer._tk
        context = prompt_ids[-_STREAM_CONTEXT_TOKENS:] if prompt_ids else None
        self._skip_special = skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # The ids so far (the prompt's tail, then every pushed id) and how many of them the
        # text returned so far covers: what the offset decoder (`_offset_step`) resumes from
        # when DecodeStream gives up on a byte sequence.
        self._ids: list[int] = list(context or [])
        self._emitted = len(self._ids)
        self._prefix = max(0, self._emitted - _OFFSET_WINDOW)
        self.text = ""  # all final text (stop strings excluded)
        self._pending = ""  # decoded, but possibly the start of a stop string
        self._stops: list[str] = []
        self._automaton: StopAutomaton | None = None
        self._state = 0  # the automaton's state after all text so far: its depth is held back

    def set_stops(self, stops: list[str]) -> None:
        self._stops = list(stops)
        self._automaton = automaton_for(tuple(stops)) if stops else None
        self._state = 0

    def _step(self, token_id: int) -> str:
        """The text `token_id` makes final: tokenizers' DecodeStream while it can, then the offset
        decoder for the rest of the request. DecodeStream raises "Invalid prefix encountered"
        on some byte-fallback sequences (an invalid UTF-8 run followed by a token whose
        decoding merges with it: common in sampled text of small or random models); that
        must not fail the request."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._tk, token_id) or ""
            except Exception as exc:  # noqa: BLE001  (tokenizers raises a bare Exception)
                if "Invalid prefix" not in str(exc):
                    raise
                self._stream = None
                log.debug("DecodeStream gave up (%s); decoding by offsets from here", exc)
            else:
                if piece:
                    self._emitted = len(self._ids)
                    self._prefix = max(0, self._emitted - _OFFSET_WINDOW)
                return piece
        return self._offset_step()

    def _offset_step(self) -> str:
        """Decode the window from `_prefix`: what goes past the text already returned is new,
        unless it ends in an incomplete character (held until it completes or turns invalid
        for good, then returned with its replacement character)."""
        decode = lambda ids: self._tk.decode(ids, skip_special_tokens=self._skip_special)  # noqa: E731
        before = decode(self._ids[self._prefix:self._emitted])
        now = decode(self._ids[self._prefix:])
        if len(now) <= len(before) or (now.endswith("\ufffd") and len(self._ids) - self._emitted < _MAX_HELD):
            return ""
        self._prefix, self._emitted = self._emitted, len(self._ids)
        return now[len(before):]

    def push(self, token_id: int, stops_on: bool = True) -> tuple[str, str | None]:
        """Add one token; return (text delta, matched stop string or None). ``stops_on`` False
        (a request still short of its ``min_tokens``): no stop string is matched and nothing is
        held back; matching starts afresh with the next token that has them on."""
        piece = self._step(token_id)
        if not stops_on and self._stops:
            delta, self._pending, self._state = self._pending + piece, "", 0
            self.text += delta
            return delta, None
        if not self._stops:
            self.text += piece
            return piece, None
        buf = self._pending + piece
        for stop in self._stops:
            idx = buf.find(stop)
            if idx >= 0:
                delta = buf[:idx]
                self.text += delta
                self._pending = ""
                return delta, stop
        # Hold back the longest tail that is a prefix of some stop string (engine/stops.py).
        assert self._automaton is not None  # set_stops made one with the stop strings
        self._state = self._automaton.feed(self._state, piece)
        keep = self._automaton.depth[self._state]
        delta = buf[: len(buf) - keep]
        self._pending = buf[len(buf) - keep:]
        self.text += delta
        return delta, None

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason."""
        delta, self._pending = self._pending, ""
        self.text += delta
        return delta
