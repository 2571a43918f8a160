"""The engine: requests in, token deltas out, one `step()` at a time.

`LLMEngine` is what serving loops drive (add / abort / step / load); the
remote-KV calls of disaggregated workers are its `connector` (kv_connector.py);
what a step hands back (deltas, errors) and the load and counters are in
engine_types.py; `LLM`, the offline batch API on top, is in offline.py.
"""

from __future__ import annotations

import itertools
import logging
import time

from pdserve.common import Priority, failpoints, jsonlog
from pdserve.common.kv_events import MEDIUM_CPU, MEDIUM_GPU

from .block_manager import KVCacheManager
from .config import ConfigError, EngineConfig, ModelConfig
from .engine_types import EngineLoad, EngineStateError, EngineStats, RequestDelta, StepError
from .kv_connector import KVConnector
from .kv_events import KVEventLog
from .kv_tier import KVTier
from .lora import check_lora_config, check_request
from .lora_request import LoRARequest, lora_salt
from .overlap import Lookahead, launch_next, predict_next
from .prompt_logprobs import record as record_prompt_logprobs
from .prompt_logprobs import reported as reported_prompt_logprobs
from .prompts import PromptChecker, check_resume_ids
from .request import (
    InvalidRequestError,
    Request,
    RequestLimits,
    RequestOutput,
    RequestStatus,
    RequestTimes,
    SamplingParams,
)
from .runner import ModelRunner
from .sampler import Sampler, SampleResult, SamplingError
from .scheduler import Scheduler
from .spec_config import HEAD_METHODS, parse_speculative_config
from .spec_decode import SpecDecoder
from .spec_draft import DraftProposer, draft_model_config
from .spec_eagle import EagleProposer
from .spec_mtp_model import proposer_head_config
from .spec_step import finish_step as finish_spec_step
from .spec_step import has_drafts
from .step_budget import StepCost, StepTargets, attention_pairs
from .structured import GrammarCompiler
from .structured_spec import parse_structured_outputs
from .structured_state import StructuredOutputs
from .tokenizer import IncrementalDetokenizer, Tokenizer
from .tp_group import TPGroupBroken

_POISON_ON = failpoints.enabled("request.poison")  # common/failpoints.py: off unless a chaos run sets it
log = logging.getLogger(__name__)
GRAMMAR_POLL_S = 0.01  # a step with only grammars compiling waits this long at most for one


class LLMEngine:
    """One model, one KV pool, one scheduler; not thread-safe (one loop drives it)."""

    def __init__(self, config: EngineConfig):
        config.validate()
        check_lora_config(config)
        spec = parse_speculative_config(config.speculative_config)  # (refused before the model loads)
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        if spec is not None and spec.method == "draft_model":
            draft_model_config(spec, self.model_config)  # (its vocabulary refused before either model loads)
        if spec is not None and spec.method in HEAD_METHODS:
            proposer_head_config(spec.model, spec.method, self.model_config)  # (its hidden size: likewise)
        self.tokenizer = Tokenizer(config.model)
        self.runner = ModelRunner(config, self.model_config)
        self.max_model_len = self._max_model_len()
        # What the prefix cache gains and loses, for the cluster's KV index (engine/kv_events.py).
        self.kv_events = (KVEventLog(config.block_size, MEDIUM_GPU if self.runner.device.type == "cuda" else MEDIUM_CPU)
                          if config.kv_events else None)
        # The second KV tier (engine/kv_tier.py): it copies the next blocks to be evicted, so
        # it watches as many as two full steps could take.
        self.tier = None
        if config.kv_offload_bytes:
            self.tier = KVTier(self.runner.kv_cache, config.kv_offload_bytes, config.kv_offload_backend,
                               config.kv_offload_path, self.kv_events,
                               window=max(64, 2 * -(-config.max_num_batched_tokens // config.block_size)),
                               mirror=self._mirror_tier if self.runner.group is not None else None)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 self.kv_events, self.tier)
        self._overlap = config.overlap_steps or config.async_scheduling
        if config.cuda_graphs:
            self.runner.enable_decode_graphs(self.kv, min(config.cuda_graph_max_batch, config.max_num_seqs),
                                             self.max_model_len, slots=2 if self._overlap else 1)
        if self._overlap:
            self.runner.lookahead = Lookahead(config.block_size, self.runner.device)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.scheduling_policy, self.tier)
        self.scheduler.max_loras = config.max_loras if config.enable_lora else None
        self.sampler = Sampler(config.seed)
        if config.async_scheduling and self.runner.lookahead is not None:
            self.scheduler.before_free = self.runner.lookahead.settle  # (engine/overlap.py)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.stats = EngineStats()
        self.stats.step_plan_rules = self.scheduler.plan_rules
        self._ids = itertools.count()
        self.last_step = (0, 0, 0)  # (sequences, tokens, decode sequences) of the last step
        # Its prompt (and recompute) tokens' attention work: sum over them of the positions each
        # attends to (a chunk of n tokens from position s: n x s + n(n+1)/2). The step cost
        # curve's quadratic part (engine/step_budget.py).
        self.last_step_pairs = 0
        self.last_step_drafts = 0  # proposals the last step verified (engine/spec_step.py): decode work
        eos = list(self.model_config.eos_token_ids)
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = [self.tokenizer.eos_token_id]
        self.eos_token_ids = set(eos)
        self.connector = KVConnector(self)  # the remote-KV seam disaggregated workers use
        # Structured outputs (engine/structured.py): one compiler, shared with the edge check, and
        # each request's grammar matcher and the step's token masks (engine/structured_state.py).
        self.grammars = GrammarCompiler(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
            timeout_s=config.structured_outputs_timeout_s, cache_entries=config.structured_outputs_cache_entries,
            cache_bytes=config.structured_outputs_cache_bytes, threads=config.structured_outputs_threads,
            nice=config.structured_outputs_compile_nice)
        self.structured = StructuredOutputs(self.grammars)
        self._grammar_failed: list[tuple[Request, Exception]] = []  # to end with the step's deltas
        self.prompts = PromptChecker(self.tokenizer, self.max_model_len, self.model_config.vocab_size, self.grammars)
        # Speculative decoding (engine/spec_decode.py; docs/speculative.md): None when off.
        draft = None
        if spec is not None and spec.method == "draft_model":  # its own runner and pool (engine/spec_draft.py)
            draft = DraftProposer(spec, config, self.model_config, self.runner.num_blocks)
            self.scheduler.on_free = draft.release
        elif spec is not None and spec.method in HEAD_METHODS:  # fed the target's hidden states
            draft = EagleProposer(spec, config, self.model_config, self.runner.num_blocks, self.runner.model)
            self.scheduler.on_free = draft.release
        if draft is not None and spec is not None and spec.draft_prompt_kv != "decode":
            # A remote prompt's draft KV reserved beside the target's (engine/spec_draft.py `reserve`).
            self.scheduler.on_reserve = draft.reserve
            self.scheduler.followers.append(draft.kv)
        self.spec = SpecDecoder(spec, self.max_model_len, draft) if spec is not None else None

    def close(self) -> None:
        """Stop the second tier's copy thread and the other tensor-parallel ranks (engine/tp_group.py)."""
        if self.tier is not None:
            self.tier.close()
        self.grammars.close()
        if self.spec is not None and self.spec.draft is not None:
            self.spec.draft.close()
        self.runner.close()

    def _max_model_len(self) -> int:
        m = self.model_config
        limit = m.max_position_embeddings
        if m.sliding_window:
            # Positions beyond the window would need sliding-window attention.
            limit = min(limit, m.sliding_window)
        want = self.config.max_model_len or limit
        if want > limit:
            raise ConfigError(f"max_model_len={want} exceeds the model's limit of {limit} tokens")
        capacity = self.runner.num_blocks * self.config.block_size
        if want > capacity:
            if self.config.max_model_len is None:
                return capacity
            raise ConfigError(
                f"max_model_len={want} but the KV pool holds only {capacity} tokens; "
                "raise kv_cache_memory_bytes (or gpu_memory_utilization) or lower max_model_len"
            )
        return want

    # -- requests -------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> list[int]:
        """The prompt's token ids, or `InvalidRequestError` naming the field (engine/prompts.py)."""
        return self.prompts.tokenize_prompt(prompt)

    def validate_input(self, prompt, params: SamplingParams | None = None,
                       priority: Priority | str | int = Priority.NORMAL,
                       limits: RequestLimits | None = None) -> tuple[list[int], SamplingParams, Priority]:
        """Check a request without touching engine state (safe from any thread; `PromptChecker`)."""
        return self.prompts.validate_input(prompt, params, priority, limits)

    def make_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     priority: Priority | str | int = Priority.NORMAL, arrival: float | None = None,
                     tenant: str | None = None, resume_ids: list[int] | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Validate and build a request without queueing it (`tenant`: see `Request.tenant`;
        ``lora_request``: its `LoRARequest`, read and checked here, engine/lora.py).

        ``resume_ids``: tokens this request already generated elsewhere (a stream migrated off
        a decode worker that failed). They become its first output tokens, computed like a
        preempted request's: penalties and ``max_tokens`` count them, a seeded generator is
        advanced by one draw per resumed token when sampling is random (as if it had drawn
        them), the detokenizer and stop strings see them without emitting their text again,
        so the continuation equals the run that was never interrupted.

        A request with ``structured_outputs`` starts its grammar's compile here, off the engine
        thread (engine/structured_state.py); it is scheduled once the grammar is ready."""
        ids, params, priority = self.prompts.validate_input(prompt, params, priority, compile_grammar=False)
        resume = [] if resume_ids is None else check_resume_ids(
            resume_ids, len(ids), params.max_tokens, self.max_model_len, self.model_config.vocab_size)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequestError("request_id", f"{rid!r} is already in flight")
        lora = None
        if lora_request is not None:
            lora = self.runner.lora.check(lora_request) if self.runner.lora else check_request(lora_request, False)
        req = Request(rid, ids, params, priority=priority, arrival=arrival, tenant=tenant,
                      cache_salt=lora_salt(None, lora))  # (two adapters never share KV)
        req.lora_request = lora
        self.sampler.prepare(req, self.tokenizer, self.eos_token_ids, self.model_config.vocab_size)  # logits controls
        req.arrival_time = self.scheduler.clock()  # request times come off the scheduler's clock (its plan reads them)
        detok = self.tokenizer.stream(ids, params.skip_special_tokens)
        detok.set_stops(params.stop)
        if resume:
            self._replay(req, detok, resume)
        spec = parse_structured_outputs(params.structured_outputs)
        if spec is not None:  # (a resumed stream's matcher is advanced over its resumed tokens)
            self.structured.start(req, spec)
        self._detok[rid] = detok
        self.requests[rid] = req
        return req

    def _replay(self, req: Request, detok, resume: list[int]) -> None:
        """Bring a resumed request to the state its first worker left it in (see make_request)."""
        p = req.params
        for i, tok in enumerate(resume):
            _, stop = detok.push(tok, stops_on=i + 1 > p.min_tokens)
            ended = stop is not None or tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids)
            if ended:
                why = f"stop string {stop!r}" if stop is not None else f"stop token {tok}"
                raise InvalidRequestError("resume_token_ids", f"the request had already stopped at resumed token "
                                          f"{i} ({why}); nothing is left to resume")
            if req.generator is not None and not p.greedy:
                self.sampler.skip_draw(req)
        req.output_token_ids = list(resume)
        if req.logprobs is not None:  # the first worker streamed theirs; these positions have none here
            req.logprobs = [None] * len(resume)
        req.prompt_logprobs = None  # (and its prompt's logprobs, with its first token)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: Priority | str | int = Priority.NORMAL, arrival: float | None = None,
                    tenant: str | None = None, resume_ids: list[int] | None = None,
                    remote_kv: bool = False, lora_request: LoRARequest | None = None) -> Request:
        """Queue a request. ``remote_kv``: another worker writes its prompt KV; the scheduler
        reserves its blocks in the step that admits it (engine/remote_kv.py; the connector's
        `take_reservations` tells the worker), and it runs once the connector's `remote_ready`
        says the pages are written."""
        req = self.make_request(prompt, params, request_id, priority, arrival, tenant, resume_ids, lora_request)
        req.remote_kv = remote_kv and not req.output_token_ids  # (a resumed stream computes its tokens here)
        if req.remote_kv and req.owes_prompt_logprobs:  # (the router keeps these local: reason prompt_logprobs)
            self._forget(req)
            raise InvalidRequestError("prompt_logprobs", "computed where the prompt runs: such a request "
                                      "cannot take its prompt's KV from another worker (route it locally)")
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request and free its blocks; False if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        req.finish_reason = "abort"
        self._forget(req)
        return True

    def tier_stats(self) -> dict:
        """The second KV tier, for a worker's stats: what it holds and did, and the prompt tokens
        loaded back from it instead of computed (engine/kv_tier.py); {} without a tier."""
        if self.tier is None:
            return {}
        return {"tier": self.tier.snapshot(), "tier_loaded_tokens": self.scheduler.tier_loaded_tokens}

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """True while a step would schedule something (requests running or waiting)."""
        return self.scheduler.has_work()

    def step_plan(self) -> dict:
        """The latest step's plan as a trace line gives it: requests running and waiting, the
        prompt-token budget and why (engine/step_budget.py; the fixed cap when none is planned)."""
        sch = self.scheduler
        plan = sch.last_budget if sch.step_cost is not None else None
        return {"running": len(sch.running), "waiting": len(sch.waiting),
                "budget": plan.tokens if plan is not None else sch.prefill_token_budget,
                "reason": plan.reason if plan is not None else "", "rule": plan.rule if plan is not None else ""}

    def prompt_left(self, request_id: str) -> int | None:
        """Positions request ``request_id`` has still to compute before its next token (its
        prefill's remainder; None: no such request). Safe to read from another thread: two
        int reads, at worst one step stale."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return max(0, req.num_tokens - req.num_computed_tokens)

    def load(self) -> EngineLoad:
        kv = self.kv
        return EngineLoad(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                          awaiting_remote_kv=len(self.scheduler.remote), num_blocks=kv.pool.num_blocks,
                          num_free_blocks=kv.num_free_blocks, kv_usage=kv.usage)

    def set_prefill_token_budget(self, tokens: int | None, idle_tokens: int | None = None) -> None:
        """Cap the prompt (and recompute) tokens of one step at ``tokens``, decode tokens
        untouched; None removes the cap. ``idle_tokens`` replaces it while no running request
        is decoding. A decode worker sets both so that no step stalls its running streams past
        their TPOT target, nor a newly arrived prompt for long (engine/step_plan.py)."""
        for name, value in (("prefill token budget", tokens), ("idle prefill token budget", idle_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        self.scheduler.prefill_token_budget = tokens
        self.scheduler.idle_prefill_token_budget = idle_tokens

    def set_step_targets(self, cost: StepCost | None, targets: StepTargets | None) -> None:
        """Plan every step's prompt tokens from the SLOs (engine/step_budget.py): ``cost`` is
        the measured step cost curve, ``targets`` the TPOT and TTFT SLOs. None for either goes
        back to the fixed caps of ``set_prefill_token_budget``."""
        if cost is not None and not (cost.fixed_ms >= 0 and cost.decode_ms >= 0 and cost.prefill_ms > 0):
            raise ValueError(f"step cost must have fixed_ms >= 0, decode_ms >= 0, prefill_ms > 0, got {cost}")
        if targets is not None and not (targets.tpot_ms > 0 and targets.ttft_ms > 0):
            raise ValueError(f"step targets must be > 0 ms, got {targets}")
        self.scheduler.step_cost, self.scheduler.step_targets = cost, targets

    def predicted_prefill_budget(self, tokens: int, cached: int, decodes: int, backlog: int) -> int | None:
        """What the step plan would give a prompt arriving now (``Scheduler.predicted_budget``)."""
        return self.scheduler.predicted_budget(tokens, cached, decodes, backlog)

    @property
    def prefill_token_budget(self) -> int | None:
        """The prompt-token cap of the latest step (planned, or the fixed one)."""
        if self.scheduler.last_budget is not None and self.scheduler.step_cost is not None:
            return self.scheduler.last_budget.tokens
        return self.scheduler.prefill_token_budget

    # -- the step --------------------------------------------------------------
    def _mirror_tier(self, slots: int, ops: list, now: bool) -> None:
        """The tier's copies, for the other tensor-parallel ranks to repeat (engine/kv_tier_store.py
        `TierMirror`, in engine/tp_rank.py): with the next step, or at once."""
        group = self.runner.group
        assert group is not None  # mirrored only at TP > 1
        if now:
            group.call("tier", slots=slots, ops=ops)
        else:
            group.attach({"kind": "tier", "slots": slots, "ops": ops})

    def step(self, layer_hook=None, on_plan=None) -> list[RequestDelta]:
        """Run one scheduled step and return what it added to each request.

        ``on_plan(scheduled)``, when given, sees the step's plan (list of (request, new tokens))
        before the forward pass and may return a per-layer hook for this step, called as
        ``hook(layer, ready)`` (the prefill worker streams KV with it; engine/kv_ready.py).
        """
        self._before_plan()
        started = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.structured)
        try:
            plan = self.scheduler.schedule()
        except Exception as exc:  # the scheduler's own state: no single request to blame
            raise EngineStateError(f"scheduler failed: {exc.__class__.__name__}: {exc}") from exc
        self.stats.num_preemptions += _preempted(plan.preempted)
        self._count_step(plan.scheduled, plan.num_tokens)
        if not plan.scheduled:
            if self.scheduler.loading and self.tier is not None:
                self.tier.wait_for_load()  # only loads in flight: wait for one, not spin
            elif self.structured.pending and not self._grammar_failed:
                self.structured.wait_any(GRAMMAR_POLL_S)  # only grammars compiling: wait for one
            return self._end_failed_grammars()
        now = self.scheduler.clock()
        for req, _ in plan.scheduled:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        try:
            logits, sampling = self._forward(plan.scheduled, layer_hook, on_plan)
        except TPGroupBroken:
            raise  # not this step's requests' fault: the engine cannot step again (the worker exits)
        except Exception as exc:
            # Nothing of the step was committed (computed counts move only below).
            raise StepError(exc, [r.request_id for r, _ in plan.scheduled]) from exc
        if self.spec is not None:
            self.spec.after_forward(plan.scheduled)  # (an EAGLE head keeps the target's hidden states)
        self.stats.num_steps += 1
        bs = self.config.block_size
        deltas = self._end_failed_grammars()
        failed: set[str] = set()
        for req, n in plan.scheduled:
            prompt_left = req.num_prompt_tokens - req.num_computed_tokens
            if prompt_left > 0:
                self.stats.num_prompt_tokens_computed += min(n, prompt_left)
                if req.num_computed_tokens == req.num_cached_tokens and req.num_preemptions == 0:
                    self.stats.num_prompt_tokens_cached += req.num_cached_tokens
            before = req.num_computed_tokens
            n = min(n, req.num_tokens - before)  # (proposals count once verified: engine/spec_step.py)
            req.num_computed_tokens += n
            if req.num_computed_tokens // bs > before // bs:
                try:  # indexing this request's full blocks for prefix reuse: its own failure
                    self.kv.cache_full_blocks(req.request_id, req.all_token_ids,
                                              req.num_computed_tokens, req.cache_salt, req.lora_request)
                except Exception as exc:  # noqa: BLE001  (this request fails; the batch goes on)
                    failed.add(req.request_id)
                    deltas.append(self.fail_request(req, exc))
        self._while_forward_runs(plan.scheduled, failed)
        if sampling and self.spec is not None and has_drafts(sampling):
            finish_spec_step(self, logits, sampling, failed, deltas)
            sampling = []
        if sampling:
            live = [i for i, req in enumerate(sampling) if req.request_id not in failed]
            if len(live) < len(sampling):
                logits, sampling = logits[live], [sampling[i] for i in live]
            if any(r.grammar is not None for r in sampling):
                logits, sampling = self._constrain(logits, sampling, deltas)
            for req, res in zip(sampling, self._sample(logits, sampling) if sampling else []):
                try:
                    if isinstance(res, BaseException):
                        raise res
                    deltas.append(self.append_token(req, res))
                except Exception as exc:  # noqa: BLE001  (this request fails; the batch goes on)
                    deltas.append(self.fail_request(req, exc))
        if self.spec is not None:
            self._spec_step_done(started, deltas)
        return deltas

    def _while_forward_runs(self, scheduled: list[tuple[Request, int]], failed: set[str]) -> None:
        """Host work that needs no token of this step (on a GPU, the forward is still running):
        the tier's copies of the next blocks to evict, the next decode step's inputs
        (engine arg overlap_steps: engine/overlap.py)."""
        if self.tier is not None:
            self.tier.offer_lru_head(self.kv.pool)  # copied while the next steps run
        if self.runner.lookahead is not None and self.spec is None:
            try:
                nxt = predict_next(scheduled, self.scheduler.running, self._admitting(), failed, self.kv)
                if nxt is not None:
                    self.runner.lookahead.prepare(nxt[0], self.kv.block_ids, self.runner.plan_ahead, nxt[1])
            except Exception:  # noqa: BLE001  (only a missed prediction: the next step builds its inputs)
                log.exception("preparing the next decode step failed; it is built when it starts")
                self.runner.lookahead.drop()

    def _before_plan(self) -> None:
        # The grammars that compiled get matchers (the scheduler admits their requests); those
        # that failed stay held back and end with this step's deltas (engine/structured_state.py).
        if self.structured.pending:
            self._grammar_failed += self.structured.poll()
        # A step prepared ahead gives back the blocks its prediction took before a plan that
        # admits someone: admission sees the pool it would without it (engine/overlap.py).
        if self.runner.lookahead is not None and self._admitting():
            self.runner.lookahead.release(self.kv)

    def _admitting(self) -> int:
        """Requests the next plan may admit: prompts, remote-KV reservations, tier loads."""
        s = self.scheduler
        return len(s.waiting) + len(s.remote_waiting) + len(s.loading)

    def _spec_step_done(self, started: float, deltas: list[RequestDelta]) -> None:
        """The measured-cost rule times pure decode steps (engine/spec_cost.py)."""
        assert self.spec is not None
        scheduled, _, decoding = self.last_step
        self.spec.end_step(scheduled == decoding, self.last_step_drafts > 0,
                           1e3 * (time.perf_counter() - started), sum(len(d.new_token_ids) for d in deltas))
        if self.spec.cost is not None:
            self.stats.num_spec_cost_off_steps = self.spec.cost.off_steps

    def _count_step(self, scheduled: list[tuple[Request, int]], num_tokens: int) -> None:
        """The step's shape (``last_step``, ``last_step_drafts``, ``last_step_pairs``): a
        decoding request runs one new token, with its proposals to verify if it has any (the
        step's draft tokens: decode work, not prompt work); the rest are prompt chunks."""
        decoding = [(r, n) for r, n in scheduled if r.output_token_ids and r.num_tokens - r.num_computed_tokens == 1]
        self.last_step = (len(scheduled), num_tokens, len(decoding))
        self.last_step_drafts = sum(n - 1 for _, n in decoding)
        decoders = {id(r) for r, _ in decoding}
        self.last_step_pairs = sum(attention_pairs(n, r.num_computed_tokens) for r, n in scheduled
                                   if id(r) not in decoders)

    def _forward(self, scheduled: list[tuple[Request, int]], layer_hook, on_plan) -> tuple:
        """The step's forward pass: the logits of the requests that sample, and those requests
        (the prompt logprobs the step's chunks owe are recorded: engine/prompt_logprobs.py)."""
        if on_plan is not None:
            layer_hook = on_plan(scheduled) or layer_hook
        if self.tier is not None:
            self.tier.flush(now=False)  # TP: the other ranks copy as rank 0 did, before this forward
        logits, batch = self.runner.execute(scheduled, self.kv, layer_hook)
        sampling = batch.sampling
        if batch.prompt_rows:  # the prompt positions' rows follow the sampling ones
            record_prompt_logprobs(batch.prompt_rows, logits[len(sampling):])
            logits = logits[:len(sampling)]
        return logits, sampling

    def _end_failed_grammars(self) -> list[RequestDelta]:
        """Fail the requests whose grammar did not compile (their error delta each)."""
        if not self._grammar_failed:
            return []
        failed, self._grammar_failed = self._grammar_failed, []
        return [self.fail_request(r, e) for r, e in failed if r.finish_reason is None]

    def _constrain(self, logits, reqs: list[Request], deltas: list[RequestDelta]) -> tuple:
        """Mask, in place, what each constrained row's grammar does not allow next (before the
        sampler: logprobs are those of the constrained distribution); a row whose mask fails
        fails its request alone and leaves the batch."""
        bad = self.structured.mask(logits, reqs)
        if not bad:
            return logits, reqs
        for i, exc in bad.items():
            deltas.append(self.fail_request(reqs[i], exc))
        keep = [i for i in range(len(reqs)) if i not in bad]
        return logits[keep], [reqs[i] for i in keep]

    def _sample(self, logits, reqs: list[Request]) -> list:
        """The batch's samples; should the batched sampler itself raise, each row alone,
        so one request's failure stays its own. With async_scheduling, the next step is
        launched from the drawn tokens before they are read (engine/overlap.py `launch_next`)."""
        try:
            drawn = self.sampler.draw(logits, reqs)
            if self.config.async_scheduling:
                launch_next(self.runner, reqs, drawn.tokens)
            return self.sampler.finish(drawn, reqs)
        except TPGroupBroken:
            raise
        except Exception:  # noqa: BLE001
            log.exception("batched sampling failed; sampling the %d rows one by one", len(reqs))
        if self.runner.lookahead is not None:  # (launched from a draw this fallback replaces)
            self.runner.lookahead.discard()
        out = []
        for i, req in enumerate(reqs):
            try:
                out.append(self.sampler(logits[i:i + 1], [req])[0])
            except Exception as exc:  # noqa: BLE001
                out.append(SamplingError(f"{exc.__class__.__name__}: {exc}"))
        return out

    def fail_request_id(self, request_id: str, exc: BaseException) -> RequestDelta | None:
        """Finish a live request with finish_reason "error" and forget it (blocks freed);
        None if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.finish_reason is not None:
            return None
        delta = self.fail_request(req, exc)
        self._forget(req)
        return delta

    def fail_request(self, req: Request, exc: BaseException) -> RequestDelta:
        """Finish one request with finish_reason "error" (blocks freed unless ``keep_kv``)."""
        log.warning("request %s failed: %s: %s", req.request_id, exc.__class__.__name__, exc,
                    extra=jsonlog.about(req.request_id))
        req.finish_reason = "error"
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        self.stats.num_failed += 1
        return RequestDelta(req.request_id, [], "", "error", error=f"{exc.__class__.__name__}: {exc}")

    def append_token(self, req: Request, res: SampleResult) -> RequestDelta:
        """Append one sampled token to ``req`` (its logprobs, text and stop checks): what each
        step does per request, and the remote-KV seam for a first token sampled elsewhere."""
        if _POISON_ON:  # a chaos run's poison request fails here, as a detokenizer bug would
            failpoints.check_poison(req.prompt_token_ids)
        p = req.params
        tok = res.token_id
        # through the grammar first: a token it refuses fails the request before it is appended
        grammar_ended = req.grammar is not None and self.structured.accept(req, tok)
        req.output_token_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = self.scheduler.clock()
        self.stats.num_generation_tokens += 1
        entry = None
        if req.logprobs is not None:
            entry = {"token_id": tok, "logprob": res.logprob, "top_logprobs": res.top_logprobs or {}}
            req.logprobs.append(entry)
        detok = self._detok[req.request_id]
        # stop strings count from the token after the first min_tokens on (vLLM's rule)
        text, stop_str = detok.push(tok, stops_on=len(req.output_token_ids) > p.min_tokens)
        finish = None
        if stop_str is not None:
            finish, req.stop_reason = "stop", stop_str
        elif tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            finish, req.stop_reason = "stop", tok
        elif grammar_ended:  # the grammar took its stop token (EOS, even with ignore_eos): nothing may follow
            finish, req.stop_reason = "stop", tok
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            finish = "length"
        if finish is not None:
            if stop_str is None:
                text += detok.flush()
            req.finish_reason = finish
            status = RequestStatus.FINISHED_STOPPED if finish == "stop" else RequestStatus.FINISHED_LENGTH
            self.scheduler.finish(req, status)
            self.stats.num_finished += 1
        delta = RequestDelta(req.request_id, [tok], text, finish, [entry] if entry else [])
        if req.prompt_logprobs is not None and len(req.output_token_ids) == 1:
            delta.prompt_logprobs = reported_prompt_logprobs(req)  # with the first token (its prompt ran before it)
        return delta

    def output_of(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=self._detok[req.request_id].text,
            finish_reason=req.finish_reason, logprobs=req.logprobs,
            num_cached_tokens=req.num_cached_tokens, stop_reason=req.stop_reason,
            prompt_logprobs=reported_prompt_logprobs(req),
            times=RequestTimes(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                               req.num_preemptions, self._spec_counts(req)),
        )

    def _spec_counts(self, req: Request) -> tuple[int, int] | None:
        """Its proposals verified and accepted (None: this engine does not speculate)."""
        if self.spec is None:
            return None
        return req.num_spec_draft_tokens, req.num_spec_accepted_tokens

    def release(self, request_id: str) -> RequestOutput | None:
        """Build the final output of a finished request and forget it."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        out = self.output_of(req)
        self._forget(req)
        return out

    def grammar_stats(self) -> dict:
        """The structured-output compiler's counters, for a worker's metrics (engine/structured.py
        `GrammarCompiler.stats`)."""
        return self.grammars.stats()

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.structured.forget(req.request_id)
        self._detok.pop(req.request_id, None)


def _preempted(preempted: list[Request]) -> int:
    """How many a step preempted, each logged at debug with its request's ids (common/jsonlog.py)."""
    if preempted and log.isEnabledFor(logging.DEBUG):
        for r in preempted:  # (its blocks are freed; it is computed again when it is scheduled)
            log.debug("request %s preempted (%d time(s))", r.request_id, r.num_preemptions,
                      extra=jsonlog.about(r.request_id))
    return len(preempted)
