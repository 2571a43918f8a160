"""Prompt intake: a prompt (text or token ids) checked against the model's limits and
turned into token ids; `LLMEngine.tokenize_prompt` (llm_engine.py) calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .request import InvalidRequestError, check_text

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
