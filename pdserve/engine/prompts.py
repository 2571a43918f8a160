"""Prompt intake: a prompt (text or token ids) checked against the model's limits and
turned into token ids; `LLMEngine.tokenize_prompt` (llm_engine.py) calls it. The edge check
(`PromptChecker.validate_input`) also compiles a request's structured-output grammar
(engine/structured.py), so a grammar that does not compile is refused before it is queued.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from pdserve.common import Priority

from .request import InvalidRequestError, RequestLimits, SamplingParams, check_text
from .structured import GrammarCompiler
from .structured_spec import parse_structured_outputs

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


def prompt_token_ids(prompt, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> list[int]:
    """The token ids of ``prompt`` (a string, or a list of token ids below ``vocab_size``),
    or `InvalidRequestError` naming the field; prompt plus one generated token must fit in
    ``max_model_len``."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "is empty")
        check_text("prompt", prompt)
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        if len(prompt) >= max_model_len:  # before looking at each id: O(1) refusal
            raise InvalidRequestError(
                "prompt", f"has {len(prompt)} tokens; max_model_len is {max_model_len} "
                "(prompt plus at least one generated token must fit)")
        ids = list(prompt)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise InvalidRequestError(
                    "prompt_token_ids", f"{t!r} is not a token id of this model (vocab size {vocab_size})"
                )
    else:
        raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise InvalidRequestError("prompt", "is empty (no tokens)")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            "prompt", f"has {len(ids)} tokens; max_model_len is {max_model_len} "
            "(prompt plus at least one generated token must fit)"
        )
    return ids


def check_resume_ids(resume, prompt_len: int, max_tokens: int, max_model_len: int, vocab_size: int) -> list[int]:
    """The tokens a migrated request already generated (``resume_token_ids``), checked: ids of
    the model, fewer than ``max_tokens`` (the request must still have one to generate) and
    room for one more token after prompt and them. `InvalidRequestError` names the field."""
    if not isinstance(resume, (list, tuple)):
        raise InvalidRequestError("resume_token_ids", f"must be a list of token ids, got {type(resume).__name__}")
    ids = list(resume)
    if len(ids) >= max_tokens:
        raise InvalidRequestError("resume_token_ids", f"has {len(ids)} tokens; the request's max_tokens is "
                                  f"{max_tokens}, so nothing would be left to generate")
    if prompt_len + len(ids) >= max_model_len:
        raise InvalidRequestError("resume_token_ids", f"prompt ({prompt_len}) plus {len(ids)} resumed tokens "
                                  f"leave no room below max_model_len {max_model_len}")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequestError("resume_token_ids",
                                      f"{t!r} is not a token id of this model (vocab size {vocab_size})")
    return ids


class PromptChecker:
    """Checks a request against one model (its tokenizer, vocabulary and context length)
    without its weights: an engine has one (`LLMEngine.prompts`), and so has a gateway,
    which validates before it picks a decode worker (gateway/).

    ``grammars``: the compiler of structured outputs (an engine passes its own, so the edge
    check's compile is the engine's cache hit); None: one of its own, made at the first
    request that needs it (a gateway's)."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int,
                 grammars: GrammarCompiler | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._grammars = grammars
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler (made on first use when none was given)."""
        if self._grammars is None:
            with self._grammars_lock:
                if self._grammars is None:
                    eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
                    self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, eos)
        return self._grammars

    def tokenize_prompt(self, prompt) -> list[int]:
        """The prompt's token ids, or `InvalidRequestError` naming the field."""
        return prompt_token_ids(prompt, self.tokenizer, self.max_model_len, self.vocab_size)

    def validate_input(self, prompt, params: SamplingParams | None = None,
                       priority: Priority | str | int = Priority.NORMAL,
                       limits: RequestLimits | None = None,
                       compile_grammar: bool = True) -> tuple[list[int], SamplingParams, Priority]:
        """Check a request (safe from any thread): (prompt token ids, params, priority), or
        `InvalidRequestError` naming the field. The parameters are checked before the prompt
        is tokenized; a structured output's grammar is compiled last (cached; waiting at most
        the compiler's time bound), unless ``compile_grammar`` is False (the engine's own
        `make_request`, which compiles off its thread)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", "must be a SamplingParams")
        params.validate(self.vocab_size, limits)
        spec = parse_structured_outputs(params.structured_outputs)
        ids = self.tokenize_prompt(prompt)
        try:
            priority = Priority.parse(priority)
        except ValueError as exc:
            raise InvalidRequestError("priority", str(exc).removeprefix("priority ")) from None
        if spec is not None and compile_grammar:
            self.grammars.compile(spec)
        return ids, params, priority
