"""The per-request logits controls of vLLM's sampling parameters, applied by the sampler.

Before penalties and temperature (`apply_logits_controls`, in this order, as vLLM V1):
``allowed_token_ids`` (every other token to -inf), ``bad_words`` (the last token of a bad
word whose other tokens end the output so far: -inf), ``min_tokens`` (the EOS ids and
``stop_token_ids`` to -inf while the output is shorter) and ``logit_bias`` (added to the
logits). After temperature, for random rows only (`apply_min_p`): ``min_p`` drops the tokens
whose probability is below ``min_p`` x the most likely token's. Greedy rows take their
argmax after the first four; min_p never changes an argmax. The raw logprobs a request
reports are those of the logits before any of them.

What a request needs is built once, when the engine makes it (`prepare_controls`, called by
`LLMEngine.make_request`), and kept on the request (`controls_of`): the bad words as token-id
sequences, each tokenized as given and with a leading space (a word in the middle of text),
as vLLM does; the ids to mask for min_tokens (EOS unless ``ignore_eos``, and the stop token
ids). A request that uses none of the controls holds None, and a batch of such requests
costs one attribute read per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .request import InvalidRequestError, Request, SamplingParams

_ATTR = "logits_controls"  # the Request attribute holding a request's LogitsControls (or None)
_UNSET = object()


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class LogitsControls:
    """One request's controls, ready for the sampler (token ids on the host)."""

    allowed: torch.Tensor | None = None  # the only ids that may be sampled (int64)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    min_tokens: int = 0
    min_tokens_ids: list[int] = field(default_factory=list)  # masked while the output is shorter
    bias_ids: torch.Tensor | None = None  # int64
    bias_values: torch.Tensor | None = None  # float32
    max_id: int = -1  # the largest token id any of them names (checked against the logits' width)


def uses_controls(p: SamplingParams) -> bool:
    """Whether ``p`` sets any control this module applies before the penalties."""
    return bool(p.allowed_token_ids is not None or p.bad_words or p.min_tokens > 0 or p.logit_bias)


def bad_words_token_ids(tokenizer: _Encoder, words: list[str], vocab_size: int | None = None) -> list[list[int]]:
    """Each bad word as token ids: the word (its leading whitespace dropped) as it would start a
    text, and with a leading space as it would follow another word, that second form kept only
    where it is a different first token and the same number of tokens (vLLM's rule).
    `InvalidRequestError` on "bad_words" when a token id lies outside the model's vocabulary."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    if vocab_size is not None:
        for ids in out:
            if any(t < 0 or t >= vocab_size for t in ids):
                raise InvalidRequestError("bad_words", f"a bad word tokenizes to ids {ids} outside the model's "
                                          f"vocabulary of {vocab_size}")
    return out


def build_controls(p: SamplingParams, tokenizer: _Encoder | None = None, eos_token_ids=(),
                   vocab_size: int | None = None) -> LogitsControls | None:
    """The controls of validated params ``p``; None when they use none. Bad words need the
    ``tokenizer`` (`InvalidRequestError` without one)."""
    if not uses_controls(p):
        return None
    c = LogitsControls(min_tokens=p.min_tokens)
    ids: list[int] = []
    if p.allowed_token_ids is not None:
        c.allowed = torch.tensor(sorted(set(p.allowed_token_ids)), dtype=torch.long)
        ids.append(int(c.allowed[-1]))
    if p.bad_words:
        if tokenizer is None:
            raise InvalidRequestError("bad_words", "need the engine's tokenizer (requests made by LLMEngine)")
        c.bad_words_ids = bad_words_token_ids(tokenizer, p.bad_words, vocab_size)
        ids += [t for w in c.bad_words_ids for t in w]
    if p.min_tokens > 0:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        c.min_tokens_ids = sorted(stops)
        ids += c.min_tokens_ids
    if p.logit_bias:
        c.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        c.bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        ids += list(p.logit_bias)
    c.max_id = max(ids, default=-1)
    if c.allowed is not None:
        _check_some_token_left(c)
    return c


def _check_some_token_left(c: LogitsControls) -> None:
    """Refuse controls under which no token can ever be sampled: every allowed token a one-token
    bad word, or, while min_tokens holds, every one left ends the output (a typed error naming
    the field, where the sampler would otherwise fail the request at its first step)."""
    assert c.allowed is not None
    left = set(c.allowed.tolist()) - {w[0] for w in c.bad_words_ids if len(w) == 1}
    if not left:
        raise InvalidRequestError("allowed_token_ids", "every allowed token is a one-token bad word "
                                  "(bad_words): nothing can be generated; allow other tokens")
    if c.min_tokens > 0 and not left - set(c.min_tokens_ids):
        raise InvalidRequestError("min_tokens", "allowed_token_ids leaves only tokens that end the output "
                                  "(stop_token_ids or end-of-sequence), which min_tokens forbids for the first "
                                  f"{c.min_tokens} token(s): nothing can be generated; lower min_tokens or allow "
                                  "other tokens")


def prepare_controls(req: Request, tokenizer: _Encoder | None, eos_token_ids=(),
                     vocab_size: int | None = None) -> None:
    """Build ``req``'s controls once and keep them on it (`LLMEngine.make_request`)."""
    setattr(req, _ATTR, build_controls(req.params, tokenizer, eos_token_ids, vocab_size))


def controls_of(req: Request) -> LogitsControls | None:
    """``req``'s controls; built from its params alone (no EOS, no tokenizer) for a request the
    engine did not make (`prepare_controls`)."""
    c = getattr(req, _ATTR, _UNSET)
    if c is _UNSET:
        c = build_controls(req.params)
        setattr(req, _ATTR, c)
    assert c is None or isinstance(c, LogitsControls)
    return c


def _bad_word_hits(c: LogitsControls, output: list[int]) -> list[int]:
    """The last tokens of the bad words whose other tokens end ``output``."""
    hits = []
    n = len(output)
    for ids in c.bad_words_ids:
        k = len(ids) - 1
        if k == 0 or (n >= k and output[n - k:] == ids[:-1]):
            hits.append(ids[-1])
    return hits


def apply_logits_controls(logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, dict[int, Exception]]:
    """allowed_token_ids, bad_words, min_tokens and logit_bias on the rows whose requests use
    them: a new tensor (``logits`` itself when no row does) and the rows that cannot be sampled
    (a control names a token beyond the logits, or leaves no token at all), by index."""
    rows: list[tuple[int, LogitsControls]] = []
    failed: dict[int, Exception] = {}
    for i, r in enumerate(reqs):
        try:
            c = controls_of(r)
        except InvalidRequestError as exc:
            failed[i] = exc
            continue
        if c is not None:
            rows.append((i, c))
    if not rows:
        return logits, failed
    logits = logits.clone()
    vocab, dev = logits.shape[-1], logits.device
    for i, c in rows:
        if c.max_id >= vocab:
            failed[i] = RuntimeError(f"a logits control names token {c.max_id}; the logits have {vocab}")
    rows = [(i, c) for i, c in rows if i not in failed]
    allow = [(i, c.allowed) for i, c in rows if c.allowed is not None]
    if allow:
        keep = torch.zeros(len(allow), vocab, dtype=torch.bool)
        at = torch.cat([torch.full((len(a),), j, dtype=torch.long) for j, (_, a) in enumerate(allow)])
        keep[at, torch.cat([a for _, a in allow])] = True
        idx = torch.tensor([i for i, _ in allow], device=dev)
        logits[idx] = logits[idx].masked_fill(~keep.to(dev), float("-inf"))
    mask_rows: list[int] = []
    mask_cols: list[int] = []
    for i, c in rows:
        out = reqs[i].output_token_ids
        cols = _bad_word_hits(c, out) if c.bad_words_ids else []
        if len(out) < c.min_tokens:
            cols += c.min_tokens_ids
        mask_rows += [i] * len(cols)
        mask_cols += cols
    if mask_rows:
        logits[torch.tensor(mask_rows, device=dev), torch.tensor(mask_cols, device=dev)] = float("-inf")
    bias = [(i, c.bias_ids, c.bias_values) for i, c in rows
            if c.bias_ids is not None and c.bias_values is not None]
    if bias:
        at = torch.cat([torch.full((len(ids),), i, dtype=torch.long) for i, ids, _ in bias]).to(dev)
        cols_t = torch.cat([ids for _, ids, _ in bias]).to(dev)
        vals = torch.cat([v for _, _, v in bias]).to(dev, logits.dtype)
        logits.index_put_((at, cols_t), vals, accumulate=True)
    idx = torch.tensor([i for i, _ in rows], device=dev)
    empty = (logits[idx].amax(dim=-1) == float("-inf")).tolist()
    for (i, _), none_left in zip(rows, empty):
        if none_left:
            failed[i] = RuntimeError("cannot sample: allowed_token_ids, bad_words and min_tokens (with the "
                                     "structured output's grammar) leave no token")
    return logits, failed


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (to -inf) each row's tokens whose probability is below ``min_p`` (per row) x the
    row's largest probability; a row's min_p of 0 keeps every token. ``logits`` are those after
    temperature."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.device, probs.dtype)[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))
