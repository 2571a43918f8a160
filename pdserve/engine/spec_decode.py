"""Speculative decoding: the n-gram proposer, the load rule and exact verification
(docs/speculative.md).

Before each step (`SpecDecoder.propose`) every decoding request may get up to k proposed
tokens (``Request.spec_token_ids``): the tokens that followed the latest earlier occurrence
of its last n tokens (prompt lookup over the prompt and the output, n from
``prompt_lookup_max`` down to ``prompt_lookup_min``), or with ``method: draft_model`` the
draft model's greedy continuation (engine/spec_draft.py), cut where its grammar refuses one. The
scheduler gives such a request 1 + k positions (engine/scheduler.py), the step batch feeds the
proposals as input and returns k + 1 logits rows for it, consecutive (engine/step_batch.py),
and engine/spec_step.py verifies them after the forward.

Verification (`accepted_prefix`): row j is sampled exactly as the request's next token would
be after the first j proposals (the same sampler, logits controls, penalties and grammar mask,
on the request as it would then be), and the emitted tokens are row 0's, then row j's for as
long as row j - 1's equalled proposal j - 1. Greedy, that is the longest prefix the target's
argmax agrees with, plus its correction (or the bonus token). Random, it is rejection sampling
with a point-mass draft q = [token = d]: the draft is accepted with probability
min(1, p(d) / q(d)) = p(d), and on rejection the token is drawn from
max(0, p - q) / (1 - p(d)) = p without d, renormalised: exactly the chance that a draw from p
is (is not) d and what it then is. So every emitted token has the target's distribution
given what precedes it. A seeded request draws the same one uniform number per emitted token
as without speculation (the generator is rewound past the rows not emitted), so its output
equals the output without speculation, token for token.

With ``draft_sampling: probabilistic`` (the default of the methods whose proposer runs a model)
an unseeded sampling request's proposals are drawn from the draft's own distribution q (its
logits under the request's sampling parameters) and verified against it
(`verify_draft_probs`): proposal d is accepted with probability min(1, p(d) / q(d)), and on
rejection the token is drawn from max(0, p - q), renormalised. Each emitted token again has
the target's distribution (the standard speculative sampling argument), and a proposal is
accepted with probability sum_x min(p(x), q(x)) instead of p(d): the draft's whole distribution
counts, not only its argmax. Seeded requests keep the point-mass draft, so that their output
stays the output without speculation whatever k the load rule gives them.

The load rule (`SpecDecoder.k_for`): no request speculates in a step whose running batch
exceeds ``disable_by_batch_size`` (at a high batch the step is compute-bound and the k extra
positions cost what they would save); a request whose acceptance (a moving average, weight
1/2 per verification) falls below ``acceptance_floor`` stops proposing for
``probe_interval`` steps, then proposes once more; k never passes the request's
``max_tokens`` or the model's length. With ``disable_by_cost`` (the default for the methods
whose proposer runs a model) a step speculates only while measured speculating steps emit
more tokens per unit of time than plain ones at that batch size (engine/spec_cost.py).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from pdserve.common.spec_rule import spec_k

from .request import Request
from .sampler import inverse_cdf
from .spec_config import SpeculativeConfig
from .spec_cost import SpecCostRule

if TYPE_CHECKING:
    from .engine_types import EngineStats
    from .spec_draft import DraftProposer
    from .structured_state import StructuredOutputs

EMA_WEIGHT = 0.5  # the weight of each verification's acceptance in a request's average


def ngram_propose(tokens: Sequence[int], lo: int, hi: int, k: int) -> list[int]:
    """``k`` tokens that followed an earlier occurrence of the last n tokens, for the longest n
    in ``[lo, hi]`` that occurred before; [] when none did.

    The occurrence is the latest one with ``k`` tokens after it. When every occurrence is too
    close to the end (the text repeats with a short period), the latest one's continuation is
    copied over itself, as the lookup would propose again after each proposed token: after
    ``[5, 6, 5, 6]`` the last two tokens followed position 0, and ``6, 5, 6, 5`` is proposed."""
    size = len(tokens)
    if k < 1 or size < lo + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    head = arr[:-1]  # a match must end before the last token (so a token follows it)
    for n in range(min(hi, size - 1), lo - 1, -1):
        hits = np.flatnonzero((sliding_window_view(head, n) == arr[-n:]).all(axis=1))
        if hits.size:
            whole = hits[hits + n + k <= size]
            start = int(whole[-1] if whole.size else hits[-1]) + n
            out = arr[start:start + k].tolist()
            while len(out) < k:  # (start < size: each copied token is one already proposed)
                out.append(out[start + len(out) - size])
            return out
    return []


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading proposals equal the tokens sampled at their positions."""
    a = 0
    for d, t in zip(drafts, sampled):
        if d != t:
            break
        a += 1
    return a


def emitted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verification emits: the sampled rows up to and including the first that
    differs from its proposal (all k + 1 when every proposal was accepted)."""
    return list(sampled[:accepted_prefix(drafts, sampled) + 1])


def verify_draft_probs(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], generator: torch.Generator,
                       bad: Container[int] = ()) -> list[int | None]:
    """Speculative sampling with the draft's distributions: the tokens one verification emits.

    ``p`` holds the target's distributions at the k + 1 positions (row j: after the first j
    proposals), ``q`` the draft's at the k proposals, each proposal drawn from its row of ``q``.
    Proposal j is accepted when u x q(d) < p(d) (u uniform in [0, 1), from ``generator``); the
    first one rejected is replaced by a draw from max(0, p - q) and ends the list; with every
    proposal accepted, a token drawn from the last row of ``p`` follows. A row in ``bad`` (or one
    whose probabilities cannot be drawn from) ends the list with None."""
    out: list[int | None] = []

    def uniform() -> torch.Tensor:  # (on the probabilities' device: inverse_cdf multiplies them)
        return torch.rand(1, generator=generator, dtype=torch.float64).to(p.device)

    for j, d in enumerate(drafts):
        if j in bad:
            return out + [None]
        u = float(torch.rand(1, generator=generator, dtype=torch.float64))
        if u * float(q[j, d]) < float(p[j, d]):
            out.append(int(d))
            continue
        residual = (p[j] - q[j]).clamp(min=0.0)[None]
        tok, empty = inverse_cdf(residual, uniform())
        if bool(empty[0]):  # p <= q everywhere (p = q up to rounding): the rejection's draw is from p
            tok, empty = inverse_cdf(p[j:j + 1], uniform())
        return out + [None if bool(empty[0]) else int(tok[0])]
    s = len(drafts)
    if s in bad:
        return out + [None]
    tok, empty = inverse_cdf(p[s:s + 1], uniform())
    return out + [None if bool(empty[0]) else int(tok[0])]


def grammar_prefix(structured: StructuredOutputs, req: Request, drafts: list[int]) -> list[int]:
    """The proposals the request's grammar accepts one by one (cut at the first it refuses or
    once it has ended); the matcher is rolled back to where it was."""
    if req.grammar is None or not req.grammar.ready:
        return drafts
    m = structured.ensure(req)
    n = 0
    for t in drafts:
        if m.is_terminated() or not m.accept_token(t):
            break
        n += 1
    if n:
        m.rollback(n)
    return drafts[:n]


@dataclass
class _Acceptance:
    rate: float = 1.0  # moving average of accepted / proposed
    pause: int = 0  # steps left without proposals


class SpecDecoder:
    """The engine's speculative decoding: proposals before a step, counters after it."""

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, draft: DraftProposer | None = None):
        self.cfg = cfg
        self.max_model_len = max_model_len
        # method draft_model: the draft model proposes (engine/spec_draft.py); eagle / eagle3: an
        # EAGLE head, a DraftProposer fed the target's hidden states (engine/spec_eagle.py)
        self.draft = draft
        self._acceptance: dict[str, _Acceptance] = {}
        self._drafted: list[Request] = []
        # the measured-cost rule (engine/spec_cost.py), when on: whether this step speculates
        self.cost = SpecCostRule() if cfg.disable_by_cost else None
        self._step_batch = 0  # decoding requests of the step being run (for `end_step`)

    def k_for(self, req: Request, batch: int) -> int:
        """The proposals ``req`` may get this step (the load rule of the module docstring)."""
        cfg = self.cfg
        if spec_k(cfg.num_speculative_tokens, cfg.disable_by_batch_size, batch) == 0:
            return 0
        acc = self._acceptance.get(req.request_id)
        if acc is not None and acc.pause > 0:
            acc.pause -= 1
            return 0
        room = min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - 1
        return spec_k(cfg.num_speculative_tokens, cfg.disable_by_batch_size, batch, room)

    def propose(self, running: list[Request], structured: StructuredOutputs) -> None:
        """Set ``spec_token_ids`` of the running requests that decode (and clear the last step's)."""
        for r in self._drafted:
            r.spec_token_ids, r.spec_draft_probs = [], None
        self._drafted = []
        decoding = [r for r in running if r.output_token_ids and r.num_tokens - r.num_computed_tokens == 1]
        live = {r.request_id for r in running}
        self._acceptance = {k: v for k, v in self._acceptance.items() if k in live}
        cfg = self.cfg
        batch = self._step_batch = len(decoding)
        if decoding and self.cost is not None and not self.cost.decide(batch):
            decoding = []  # the measured cost says a plain step is faster now
        wants = [(r, k) for r in decoding if (k := self.k_for(r, batch)) >= 1]
        found: dict[str, list[int]] = {}
        if self.draft is not None:
            self.draft.retain(live)
            found = self.draft.propose(wants, structured)
        for r, k in wants:
            drafts = (found.get(r.request_id, []) if self.draft is not None
                      else ngram_propose(r.all_token_ids, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k))
            if drafts and r.grammar is not None:
                drafts = grammar_prefix(structured, r, drafts)
            if drafts:
                r.spec_token_ids = drafts
                q = self.draft.draft_probs.pop(r.request_id, None) if self.draft is not None else None
                r.spec_draft_probs = q[:len(drafts)] if q is not None else None
                self._drafted.append(r)

    def end_step(self, pure_decode: bool, verified: bool, ms: float, tokens: int) -> None:
        """The step is done (engine/llm_engine.py): a pure decode step's time and tokens feed the
        measured-cost rule."""
        if self.cost is not None and pure_decode:
            self.cost.observe(self._step_batch, verified, ms, tokens)

    def after_forward(self, scheduled: list[tuple[Request, int]]) -> None:
        """The target's forward ran (before the computed counts move): an EAGLE head keeps the
        hidden states it computed (engine/spec_eagle.py)."""
        if self.draft is not None:
            self.draft.record(scheduled)

    def record(self, req: Request, proposed: int, accepted: int, stats: EngineStats) -> None:
        """Count one verification (EngineStats) and update the request's acceptance."""
        req.num_spec_draft_tokens += proposed
        req.num_spec_accepted_tokens += accepted
        stats.num_spec_drafts += 1
        stats.num_spec_draft_tokens += proposed
        stats.num_spec_accepted_tokens += accepted
        per = stats.spec_accepted_per_position
        per.extend([0] * (proposed - len(per)))
        for j in range(accepted):
            per[j] += 1
        acc = self._acceptance.setdefault(req.request_id, _Acceptance())
        acc.rate += EMA_WEIGHT * (accepted / proposed - acc.rate)
        if acc.rate < self.cfg.acceptance_floor:
            acc.pause, acc.rate = self.cfg.probe_interval, self.cfg.acceptance_floor
