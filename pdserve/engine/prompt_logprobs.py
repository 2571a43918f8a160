"""Prompt logprobs (vLLM's ``prompt_logprobs``): the log-probability of each prompt token
given the tokens before it, with its rank and the N most likely tokens at that position.

Position ``p``'s logits predict prompt token ``p + 1``, so a prompt of P tokens has P - 1
entries (the first token has none); the logits of the last prompt position are those the first
output token is sampled from. A step's chunk ``[start, start + n)`` of a request that asked adds
the positions not recorded yet (`owed_rows`); their logits come back from the model after the
sampling rows (engine/step_batch.py) and `record` appends the entries. A request that owes
some runs every prompt position through the model (no prefix-cache hit, no tier load, no KV
from a prefill worker: `Request.owes_prompt_logprobs`), so a preempted request that computes
its prompt again adds only what it had not recorded.

The values are those of the model's raw distribution (before temperature, penalties, logit
bias or a grammar), as vLLM reports them. An entry is ``{"token_id", "logprob", "rank",
"top_logprobs": {token id: logprob}}`` (rank 1: the most likely token). What a request
reports (`reported`, with its first token) has one entry per prompt token: the first one's
logprob and rank are None.
"""

from __future__ import annotations

import torch

from .request import Request


def owed_rows(req: Request, start: int, n: int) -> tuple[int, int] | None:
    """The positions ``[a, b)`` of the chunk ``[start, start + n)`` whose logits give prompt
    logprobs ``req`` still owes; None when there are none."""
    got = req.prompt_logprobs
    if got is None:
        return None
    a, b = max(start, len(got)), min(start + n, req.num_prompt_tokens - 1)
    return (a, b) if a < b else None


def reported(req: Request) -> list[dict] | None:
    """``req``'s prompt logprobs as reported: an entry per prompt token, the first without a
    logprob (nothing comes before it); None when not asked."""
    if req.prompt_logprobs is None:
        return None
    first: dict = {"token_id": req.prompt_token_ids[0], "logprob": None, "rank": None, "top_logprobs": {}}
    return [first, *req.prompt_logprobs]


def record(rows: list[tuple[Request, int, int]], logits: torch.Tensor) -> None:
    """Append the entries of each ``(request, a, b)`` from ``logits`` (one row per position,
    the requests' rows one after another, as `owed_rows` gave them)."""
    off = 0
    for req, a, b in rows:
        k = b - a
        block = torch.log_softmax(logits[off:off + k].float(), dim=-1)
        off += k
        got = req.prompt_logprobs
        if got is None or len(got) != a:  # (the rows follow what it recorded, without gaps)
            continue
        targets = torch.tensor(req.prompt_token_ids[a + 1:b + 1], dtype=torch.long, device=block.device)
        chosen = block.gather(1, targets[:, None])
        ranks = (block > chosen).sum(dim=1).add_(1)
        top_n = req.params.prompt_logprobs or 0
        tops = block.topk(top_n, dim=-1) if top_n else None
        ids, vals, rank_list = targets.tolist(), chosen.squeeze(1).tolist(), ranks.tolist()
        top_ids = tops.indices.tolist() if tops is not None else None
        top_vals = tops.values.tolist() if tops is not None else None
        for j in range(k):
            got.append({"token_id": ids[j], "logprob": vals[j], "rank": rank_list[j],
                        "top_logprobs": dict(zip(top_ids[j], top_vals[j])) if top_ids is not None and top_vals is not None
                        else {}})
