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
