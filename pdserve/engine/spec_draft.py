"""Speculative decoding's draft-model proposer (``method: draft_model``; docs/speculative.md).

A second, smaller model with the target's vocabulary proposes k tokens per decoding request
and step, greedily: each is the argmax of the draft's logits. It runs on the engine's own
parts: a `ModelRunner` of its own (its weights, KV pool tensor and attention backend; tensor
parallel size 1, on the target's first device) and a `KVCacheManager` over that pool without a
prefix cache, its batches built by `build_step_batch` as a step's are.

Each request it proposes for has a view in the draft (a `Request` of its own, `_Seq`): the
draft pool holds the KV of a prefix of the request's tokens followed by up to k - 1 of its
latest proposals. Before it proposes again, the proposals the request's tokens now begin with
(those the target accepted) join the prefix, the rest is rolled back (the blocks past it go
back to the pool), and the draft computes the tokens it lacks: the whole prompt the first time
(or after a preemption), then the tokens the target emitted past the last accepted proposal.
That catch-up runs for all requests together in forwards of at most ``max_num_batched_tokens``
tokens; the argmax at each request's last token is its first proposal, then k - 1 forwards of
one position per request each feed the previous proposal.

A request's draft KV is freed when it finishes, is aborted or is preempted (the scheduler's
``on_free``), and when it stops decoding; a request the draft pool has no room for gets no
proposals in that step (its draft KV is given back): the draft never preempts anything.

Why a greedy draft keeps the verification exact (engine/spec_decode.py): a proposal that is a
function of the tokens before it is a point-mass draft, and drawing the target's token at each
position and accepting while it equals the proposal is rejection sampling with that draft.
With ``draft_sampling: probabilistic``, an unseeded sampling request's proposals are drawn
instead, each from the draft's distribution at its position: the draft's logits processed as
the target's row there will be (engine/sampler.py `Sampler.process` on the request as it would
be after the proposals before it: temperature, min_p, top-k, top-p, its logits controls and
penalties, its grammar's mask). Those rows (``draft_probs``) go with the proposals, and the
verification accepts each with probability min(1, p/q) (engine/spec_decode.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from .block_manager import KVCacheManager
from .config import ConfigError, EngineConfig, ModelConfig
from .request import Request, SamplingParams
from .runner import ModelRunner
from .sampler import Sampler, inverse_cdf
from .spec_config import SpeculativeConfig
from .spec_ship import PromptKVAsks, ship_prompt_kv  # noqa: F401  (ship_prompt_kv: the engine's name for it)
from .structured_state import StructuredOutputs

log = logging.getLogger(__name__)
_FIELD = "speculative_config.model"


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft model's config, or `ConfigError` naming ``speculative_config.model`` when the
    directory holds no model this engine runs or its vocabulary is not the target's."""
    path = spec.model
    if path is None:
        raise ConfigError(f"{_FIELD} is required for method 'draft_model' (the draft model's directory)")
    try:
        mc = ModelConfig.from_dir(path)
    except ConfigError as exc:
        raise ConfigError(f"{_FIELD}={path!r} is not a model this engine runs: {exc}") from None
    if mc.vocab_size != target.vocab_size:
        raise ConfigError(f"{_FIELD}={path!r}: its vocab_size {mc.vocab_size} is not the target model's "
                          f"{target.vocab_size}; the draft must share the target's tokenizer and vocabulary")
    return mc


def draft_engine_config(config: EngineConfig, spec: SpeculativeConfig, num_blocks: int) -> EngineConfig:
    """The engine arguments the draft's runner is made with: the target's device, dtype, block
    size, KV layout and type and backends; its own model and pool; none of the target's extras."""
    assert spec.model is not None
    return dataclasses.replace(
        config, model=spec.model, tensor_parallel_size=1, tp_rank_extension=None, speculative_config=None,
        enable_lora=False, cuda_graphs=False, kv_offload_bytes=0, kv_events=False, enable_prefix_caching=False,
        num_gpu_blocks_override=num_blocks, kv_cache_memory_bytes=None, max_model_len=None)


@dataclass
class _Seq:
    """One request as the draft sees it: ``view`` holds its tokens (as prompt) and the step's
    proposals (as output); the pool holds the KV of its first ``valid`` tokens and then of
    ``extra``, the previous step's proposals but the last."""

    view: Request
    valid: int = 0
    extra: list[int] = field(default_factory=list)
    # While proposing: the request (its grammar masks the draft's rows), the proposals its
    # matcher took (rolled back after), and whether it proposes no further this step.
    req: Request | None = None
    taken: int = 0
    stopped: bool = False
    q: list[torch.Tensor] = field(default_factory=list)  # each drawn proposal's distribution


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftProposer:
    """The draft model, its KV pool and each proposing request's place in it."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig, target_blocks: int):
        self.model_config = draft_model_config(spec, target)
        blocks = max(1, int(target_blocks * spec.draft_kv_cache_fraction))
        dcfg = draft_engine_config(config, spec, blocks)
        try:
            self.runner = ModelRunner(dcfg, self.model_config)
        except torch.cuda.OutOfMemoryError as exc:
            raise ConfigError(
                f"speculative_config.draft_kv_cache_fraction={spec.draft_kv_cache_fraction}: the draft model and "
                f"its pool of {blocks} blocks do not fit beside the target ({exc}); lower it, or the target's "
                "gpu_memory_utilization") from None
        m = self.model_config
        self._setup(spec, config, min(m.max_position_embeddings, m.sliding_window or m.max_position_embeddings))

    def _setup(self, spec: SpeculativeConfig, config: EngineConfig, limit: int) -> None:
        """What every proposer has beside its runner (``self.runner``), whose pool it manages."""
        self.block_size = config.block_size
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, enable_caching=False)
        self.max_len = min(limit, self.runner.num_blocks * config.block_size)  # positions the draft can hold
        self.chunk = config.max_num_batched_tokens  # tokens per catch-up forward, all requests together
        self.seqs: dict[str, _Seq] = {}
        self.num_forwards = 0  # the draft's forward passes (tests, benchmarks)
        self.num_tokens = 0  # the positions they computed
        self.sample_drafts = spec.draft_sampling == "probabilistic"
        self.sampler = Sampler(seed=config.seed + 1)  # (its generator draws the proposals)
        self.draft_probs: dict[str, torch.Tensor] = {}  # the last propose's, by request id
        self.prompt_kv = spec.draft_prompt_kv  # where a remote prompt's draft KV comes from (`ship_prompt_kv`)
        self.prompts_kept = 0  # remote prompts whose draft KV `ship_prompt_kv` left to this worker
        self.asks = PromptKVAsks()  # whether its asks are answered (`auto` stops asking when not)

    def close(self) -> None:
        self.runner.close()

    def record(self, scheduled: list[tuple[Request, int]]) -> None:
        """After the target's forward: nothing (an EAGLE head keeps its hidden states here)."""

    def forget(self, request_id: str) -> None:
        """An export is done with: nothing kept for it (an EAGLE head's hidden states are)."""

    # -- lifetime ------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Forget a request and give its draft KV back (finished, aborted, preempted)."""
        self.seqs.pop(request_id, None)
        self.kv.free(request_id)

    def retain(self, live: set[str]) -> None:
        """Release every request not in ``live``."""
        for rid in [r for r in self.seqs if r not in live]:
            self.release(rid)

    # -- a prompt's KV from a prefill worker (engine/kv_connector.py) -----------------
    def ships(self, decoding: int) -> bool:
        """Whether a remote prompt's draft KV is asked of the prefill worker now (`ship_prompt_kv`,
        while asking is answered: engine/spec_ship.py `PromptKVAsks`)."""
        return ship_prompt_kv(self.prompt_kv, decoding) and self.asks.asking(self.prompt_kv)

    def prompt_slots(self, num_tokens: int) -> int:
        """Positions of this pool a prompt of ``num_tokens`` tokens takes when shipped: the
        draft's KV of each of them."""
        return num_tokens

    def prompt_blocks(self, num_tokens: int) -> int:
        """Blocks of this pool a shipped prompt of ``num_tokens`` tokens takes (`prompt_slots`)."""
        return -(-self.prompt_slots(num_tokens) // self.block_size)

    def reserve(self, req: Request, decoding: int) -> list[int]:
        """Blocks for the draft's KV of every prompt position of ``req`` (`prompt_slots`), which a
        prefill worker writes beside the target's (no prefix cache here: all of them), when
        `ships` says so with ``decoding`` streams decoding now; none when it does not, or the
        pool cannot hold them now (the draft then computes the prompt itself)."""
        rid = req.request_id
        if not self.ships(decoding):
            self.prompts_kept += 1
            return []
        if req.num_prompt_tokens >= self.max_len:
            return []  # (past the draft's length: it never proposes for it)
        if rid in self.seqs or rid in self.kv.tables or not self.kv.allocate(rid, self.prompt_slots(req.num_prompt_tokens)):
            return []
        return self.kv.block_ids(rid)

    def adopt(self, request_id: str, num_tokens: int) -> None:
        """The prefill worker wrote the draft's KV of the first ``num_tokens`` positions into the
        reserved blocks: proposing starts from there."""
        seq = self.seqs[request_id] = _Seq(Request(request_id, [], SamplingParams(temperature=0.0, max_tokens=1)))
        seq.valid = num_tokens

    def compute_prompts(self, prompts: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
        """The prefill side: the draft's KV of each ``(key, tokens)`` prompt computed into blocks
        of this pool (forwards of at most ``chunk`` tokens, every prompt together), by key; a
        prompt the pool cannot hold now is left out. The caller writes and frees them."""
        views = []
        for key, tokens in prompts:
            if key not in self.kv.tables and tokens and self.kv.allocate(key, len(tokens)):
                views.append(Request(key, list(tokens), SamplingParams(temperature=0.0, max_tokens=1)))
        self._prefill(views)
        return {v.request_id: list(self.kv.block_ids(v.request_id)) for v in views}

    def _prefill(self, views: list[Request]) -> None:
        """Compute every view's prompt into its blocks, in forwards of at most ``chunk`` tokens
        (`_prompt_forward`); on a GPU, wait for them: another process reads the blocks next."""
        pending = [v for v in views if v.num_computed_tokens < v.num_prompt_tokens]
        while pending:
            budget, plan = self.chunk, []
            for v in pending:
                if budget > 0:
                    n = min(v.num_prompt_tokens - v.num_computed_tokens, budget)
                    plan.append((v, n))
                    budget -= n
            self._prompt_forward(plan)
            self.num_forwards += 1
            for v, n in plan:
                v.num_computed_tokens += n
                self.num_tokens += n
            pending = [v for v in pending if v.num_computed_tokens < v.num_prompt_tokens]
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)  # (NIXL reads the pool once this returns)

    def _prompt_forward(self, plan: list[tuple[Request, int]]) -> None:
        self.runner.execute(plan, self.kv)

    # -- proposing -----------------------------------------------------------------
    def propose(self, wants: list[tuple[Request, int]], structured: StructuredOutputs) -> dict[str, list[int]]:
        """Up to k proposals for each ``(request, k)`` (the draft's argmax, or drawn from its
        distribution: `draws`), by request id (a request left out
        gets none this step: the draft's length or pool has no room for it). A request with a
        grammar gets the argmax among the tokens its grammar allows at each proposal (its matcher
        is advanced over them and rolled back after); its proposals stop where the grammar ends."""
        live: list[tuple[_Seq, int]] = []
        for req, k in wants:
            k = min(k, self.max_len - req.num_tokens + 1)
            if k < 1:
                self.release(req.request_id)
                continue
            seq = self._sync(req)
            if not self.kv.allocate(req.request_id, req.num_tokens + k - 1):
                self.release(req.request_id)  # no room: no proposals (the draft preempts nobody)
                continue
            seq.req, seq.taken, seq.stopped, seq.q = req, 0, False, []
            live.append((seq, k))
        self.draft_probs = {}
        if not live:
            return {}
        try:
            self._catch_up([s for s, _ in live], structured)
            for j in range(1, max(k for _, k in live)):
                self._forward([(s, 1) for s, k in live if k > j and not s.stopped], structured)
        except Exception:  # noqa: BLE001  (the draft's failure costs this step its proposals, nothing else)
            log.exception("the draft model failed; no proposals this step")
            for seq, _ in live:
                seq.view.output_token_ids = []
                self.seqs.pop(seq.view.request_id, None)
                self.kv.free(seq.view.request_id)
        finally:
            for seq, _ in live:
                if seq.taken and seq.req is not None and seq.req.grammar is not None:
                    structured.ensure(seq.req).rollback(seq.taken)
                seq.req, seq.taken = None, 0
        out: dict[str, list[int]] = {}
        for seq, _ in live:
            proposals = list(seq.view.output_token_ids)
            seq.valid, seq.extra = seq.view.num_prompt_tokens, proposals[:-1]  # (the last one's KV: not computed)
            if proposals:
                out[seq.view.request_id] = proposals
                if len(seq.q) == len(proposals):
                    self.draft_probs[seq.view.request_id] = torch.stack(seq.q)
            seq.q = []
        return out

    def draws(self, req: Request | None) -> bool:
        """Whether ``req``'s proposals are drawn from the draft's distribution (unseeded sampling
        requests, under ``draft_sampling: probabilistic``) rather than its argmax."""
        return (self.sample_drafts and req is not None and not req.params.greedy
                and req.generator is None)

    def _sync(self, req: Request) -> _Seq:
        """The request's view with its KV rolled back past what the target rejected: the pool then
        holds its first ``valid`` tokens, and the view computes the rest."""
        rid = req.request_id
        seq = self.seqs.get(rid)
        if seq is None:
            seq = self.seqs[rid] = _Seq(Request(rid, [], SamplingParams(temperature=0.0, max_tokens=1)))
        tokens = req.all_token_ids
        valid = seq.valid + _common(seq.extra, tokens[seq.valid:seq.valid + len(seq.extra)])
        valid = min(valid, len(tokens) - 1)  # (at least the last token runs: its logits propose)
        self.kv.trim(rid, valid)
        view = seq.view
        view.prompt_token_ids, view.output_token_ids, view.num_computed_tokens = tokens, [], valid
        seq.valid, seq.extra = valid, []
        return seq

    def _catch_up(self, seqs: list[_Seq], structured: StructuredOutputs) -> None:
        """Compute each view's tokens the pool lacks, at most ``chunk`` tokens a forward; each
        view then holds its first proposal (or is stopped)."""
        pending = seqs
        while pending:
            budget, plan = self.chunk, []
            for s in pending:
                if budget <= 0:
                    break
                n = min(s.view.num_tokens - s.view.num_computed_tokens, budget)
                plan.append((s, n))
                budget -= n
            self._forward(plan, structured)
            pending = [s for s in pending if not s.view.output_token_ids and not s.stopped]

    def _forward(self, plan: list[tuple[_Seq, int]], structured: StructuredOutputs) -> None:
        """One forward of the draft: positions computed, and each view that reached its last token
        gets the argmax there, or a token drawn from its distribution (`draws`), under its
        request's grammar, as its next proposal."""
        if not plan:
            return
        by_view = {id(s.view): s for s, _ in plan}
        logits, batch = self.runner.execute([(s.view, n) for s, n in plan], self.kv)
        self.num_forwards += 1
        for s, n in plan:
            s.view.num_computed_tokens += n
            self.num_tokens += n
        if not batch.sampling:
            return
        rows = [by_view[id(v)] for v in batch.sampling]
        masked = [s.req if s.req is not None and s.req.grammar is not None else s.view for s in rows]
        failed = structured.mask(logits, masked) if any(r.grammar is not None for r in masked) else {}
        tokens = logits.argmax(dim=-1).tolist()
        drawn = [i for i, s in enumerate(rows) if self.draws(s.req) and i not in failed]
        q: dict[int, torch.Tensor] = {}
        if drawn:
            q = self._draw(logits, rows, drawn, tokens)
            failed = {**failed, **{i: RuntimeError("cannot draw") for i in drawn if i not in q}}
        for i, (s, tok) in enumerate(zip(rows, tokens)):
            if i in failed and masked[i].grammar is None:
                s.stopped = True  # (its distribution could not be drawn from)
                continue
            if masked[i].grammar is not None:
                m = structured.ensure(masked[i]) if i not in failed else None
                if m is None or m.is_terminated() or not m.accept_token(int(tok)):
                    s.stopped = True  # (no token allowed, or the mask failed: the step samples as usual)
                    continue
                s.taken += 1
                s.stopped = bool(m.is_terminated())  # the grammar ended: nothing may follow
            s.view.output_token_ids.append(int(tok))
            if i in q:
                s.q.append(q[i])

    def _draw(self, logits: torch.Tensor, rows: list[_Seq], drawn: list[int], tokens: list[int]
              ) -> dict[int, torch.Tensor]:
        """Draw the proposals of rows ``drawn`` from the draft's distributions (into ``tokens``);
        each row's distribution, by row (a row left out cannot be drawn from)."""
        from .spec_step import draft_view

        views = []
        for i in drawn:
            req = rows[i].req
            assert req is not None
            views.append(draft_view(req, list(rows[i].view.output_token_ids)))
        pr = self.sampler.process(logits[drawn], views, logprobs=False)
        assert pr.probs is not None  # (every row samples)
        u = torch.rand(len(drawn), generator=self.sampler.generator, dtype=torch.float64)
        got, bad = inverse_cdf(pr.probs, u.to(pr.probs.device))
        out = {}
        for j, i in enumerate(drawn):
            if j not in pr.failed and not bool(bad[j]):
                tokens[i] = int(got[j])
                out[i] = pr.probs[j]
        return out
