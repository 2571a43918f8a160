"""The end of a step with speculative rows: mask, sample, verify, append, roll back
(engine/spec_decode.py has the proposer and why the verification is exact; docs/speculative.md).

A request verified in this step has k + 1 consecutive rows in the step's sampling logits
(engine/step_batch.py). Row j is sampled on a view of the request as it would be after its
first j proposals (`draft_view`: the output with them appended, so penalties, bad_words and
min_tokens see what they would see), under its grammar advanced over them (the matcher is
rolled back after). The emitted tokens are appended one by one (`LLMEngine.append_token`:
logprobs, stop strings, stop tokens, max_tokens, the grammar), stopping at the first that
finishes the request; then the KV of the rejected proposals is given up: the request's computed
tokens stop after the last accepted proposal, and blocks past its tokens go back to the pool
(the table then covers the computed tokens, as without proposals; those blocks were never
full, so never in the prefix cache).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from .engine_types import RequestDelta
from .request import Request
from .sampler import SampleResult, SamplingError, cannot_sample, result
from .spec_decode import accepted_prefix, verify_draft_probs

if TYPE_CHECKING:
    from .llm_engine import LLMEngine


def has_drafts(sampling: list[Request]) -> bool:
    """Whether a request has more than one row (its proposals are verified in this step)."""
    return any(a is b for a, b in zip(sampling, sampling[1:]))


def draft_view(req: Request, drafts: list[int]) -> Request:
    """``req`` as it would be with ``drafts`` generated (a shallow copy: its params, generator and
    logits controls are shared); its grammar is masked by `_mask_drafts`, not by the step's mask."""
    view = copy.copy(req)
    view.output_token_ids = req.output_token_ids + drafts
    view.grammar = None
    return view


def _groups(sampling: list[Request]) -> list[tuple[Request, int, int]]:
    """(request, first row, proposals verified) for each request, in row order."""
    out: list[tuple[Request, int, int]] = []
    for i, r in enumerate(sampling):
        if out and out[-1][0] is r:
            req, start, s = out[-1]
            out[-1] = (req, start, s + 1)
        else:
            out.append((r, i, 0))
    return out


def _mask_drafts(eng: LLMEngine, logits: torch.Tensor, views: list[Request],
                 groups: list[tuple[Request, int, int]]) -> dict[str, Exception]:
    """Grammar masks: the plain rows by the step's mask, each speculative row under the matcher
    advanced over the proposals before it; the requests whose mask failed."""
    bad = {views[i].request_id: exc for i, exc in eng.structured.mask(logits, views).items()}
    for req, start, s in groups:
        if s == 0 or req.grammar is None:
            continue
        taken = 0
        try:
            m = eng.structured.ensure(req)
            for j, tok in enumerate(req.spec_token_ids[:s] + [None]):
                if m.is_terminated():  # a proposal ended the grammar: the request ends on it, and the
                    break  # rows after it are never emitted (nor can its matcher mask them)
                failed = eng.structured.mask(logits[start + j:start + j + 1], [req])
                if failed:
                    raise failed[0]
                if tok is not None:
                    if not m.accept_token(tok):  # (checked when proposed: never)
                        raise RuntimeError(f"proposal {tok} is not allowed by the request's grammar")
                    taken += 1
        except Exception as exc:  # noqa: BLE001  (this request fails; the batch goes on)
            bad[req.request_id] = exc
        finally:
            if req.grammar is not None and req.grammar.matcher is not None and taken:
                req.grammar.matcher.rollback(taken)
    return bad


def finish_step(eng: LLMEngine, logits: torch.Tensor, sampling: list[Request], failed: set[str],
                deltas: list[RequestDelta]) -> None:
    """Sample and verify a step's rows, appending each request's delta to ``deltas``."""
    live = [i for i, r in enumerate(sampling) if r.request_id not in failed]
    if len(live) < len(sampling):
        logits, sampling = logits[live], [sampling[i] for i in live]
    groups = _groups(sampling)
    views: list[Request] = []
    for req, _, s in groups:
        drafts = req.spec_token_ids[:s]
        views += [req] if s == 0 else [draft_view(req, drafts[:j]) for j in range(s + 1)]
    bad: dict[str, Exception] = {}
    if any(r.grammar is not None for r in sampling):
        bad = _mask_drafts(eng, logits, views, groups)
    rewind = {r.request_id: r.generator.get_state() for r, _, s in groups
              if s and r.generator is not None and not r.params.greedy}
    drawn = {r.request_id: (start, s) for r, start, s in groups
             if s and r.spec_draft_probs is not None and r.request_id not in bad}
    plain = [i for r, start, s in groups if r.request_id not in drawn for i in range(start, start + s + 1)]
    results: list = [None] * len(views)
    if plain:
        whole = len(plain) == len(views)
        got = eng._sample(logits if whole else logits[plain], views if whole else [views[i] for i in plain])
        for i, res in zip(plain, got):
            results[i] = res
    for req, start, s in groups:
        if req.request_id in bad:
            deltas.append(eng.fail_request(req, bad[req.request_id]))
        elif s == 0:
            deltas.append(_append(eng, req, results[start:start + 1])[0])
        elif req.request_id in drawn:
            try:
                emitted = _draw_verified(eng, logits[start:start + s + 1], views[start:start + s + 1], req)
            except Exception as exc:  # noqa: BLE001  (this request fails; the batch goes on)
                deltas.append(eng.fail_request(req, exc))
                continue
            deltas.append(_verify(eng, req, req.spec_token_ids[:s], emitted, None))
        else:
            deltas.append(_verify(eng, req, req.spec_token_ids[:s], results[start:start + s + 1],
                                  rewind.get(req.request_id)))


def _draw_verified(eng: LLMEngine, logits: torch.Tensor, views: list[Request], req: Request) -> list:
    """The results a verification against the draft's distributions emits (engine/spec_decode.py
    `verify_draft_probs`), with the logprobs the request asked for."""
    drafts, q = req.spec_token_ids[:len(views) - 1], req.spec_draft_probs
    assert q is not None
    pr = eng.sampler.process(logits, views)
    assert pr.probs is not None  # (an unseeded sampling request: every row is random)
    tokens = verify_draft_probs(pr.probs, q[:len(drafts)].to(pr.probs.device), drafts, eng.sampler.generator,
                                bad=pr.failed.keys())
    return [pr.failed.get(j, cannot_sample()) if tok is None else result(views[j], tok, pr.raw_logprobs, j)
            for j, tok in enumerate(tokens)]


def _append(eng: LLMEngine, req: Request, results: list) -> tuple[RequestDelta, int]:
    """Append ``results`` in order until one finishes the request: one delta for them all, and
    how many were appended."""
    parts: list[RequestDelta] = []
    for res in results:
        try:
            if isinstance(res, BaseException):
                raise res
            parts.append(eng.append_token(req, res))
        except Exception as exc:  # noqa: BLE001  (this request fails; the batch goes on)
            parts.append(eng.fail_request(req, exc))
            return _merge(parts), len(parts) - 1
        if req.finish_reason is not None:
            break
    return _merge(parts), len(parts)


def _merge(parts: list[RequestDelta]) -> RequestDelta:
    if len(parts) == 1:
        return parts[0]
    first, last = parts[0], parts[-1]
    return RequestDelta(first.request_id, [t for p in parts for t in p.new_token_ids], "".join(p.text for p in parts),
                        last.finish_reason, [e for p in parts for e in p.logprobs], error=last.error,
                        prompt_logprobs=first.prompt_logprobs)


def _verify(eng: LLMEngine, req: Request, drafts: list[int], results: list, state: torch.Tensor | None
            ) -> RequestDelta:
    """Emit the verified tokens of one request, then roll back its KV and its generator."""
    tokens = []
    for res in results:
        if isinstance(res, (BaseException, SamplingError)):
            break
        assert isinstance(res, SampleResult)
        tokens.append(res.token_id)
    a = accepted_prefix(drafts, tokens)
    keep = results[:min(a + 1, len(tokens))] if tokens else results[:1]  # (row 0's error fails it)
    delta, emitted = _append(eng, req, keep)
    assert eng.spec is not None
    eng.spec.record(req, len(drafts), min(a, emitted), eng.stats)
    if req.finish_reason is not None:
        return delta
    # Computed: the step's first position (counted by the step) and the accepted proposals.
    req.num_computed_tokens += emitted - 1
    try:
        eng.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens, req.cache_salt,
                                 req.lora_request)
        eng.kv.trim(req.request_id, req.num_computed_tokens)  # (as if it had not speculated)
    except Exception as exc:  # noqa: BLE001  (this request fails; the batch goes on)
        return _merge([delta, eng.fail_request(req, exc)])
    if state is not None and req.generator is not None:  # one draw per emitted token, as without proposals
        req.generator.set_state(state)
        for _ in range(emitted):
            eng.sampler.skip_draw(req)
    return delta
