"""Tokenizer (HF `tokenizer.json`) and incremental detokenization."""

from __future__ import annotations

import functools
import json
import os

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from .config import ConfigError
from .stops import StopAutomaton, automaton_for

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's Jinja chat template."""
        if not self.chat_template:
            raise ConfigError("this model's tokenizer has no chat_template; use the completions API")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)

        def raise_exception(msg):
            raise ValueError(f"messages: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    def stream(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


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
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.text = ""  # all final text (stop strings excluded)
        self._pending = ""  # decoded, but possibly the start of a stop string
        self._stops: list[str] = []
        self._automaton: StopAutomaton | None = None
        self._state = 0  # the automaton's state after all text so far: its depth is held back

    def set_stops(self, stops: list[str]) -> None:
        self._stops = list(stops)
        self._automaton = automaton_for(tuple(stops)) if stops else None
        self._state = 0

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Add one token; return (text delta, matched stop string or None)."""
        piece = self._stream.step(self._tk, token_id) or ""
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
