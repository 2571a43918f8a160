"""What to run each step: a token budget spread over running and waiting requests.

There are no separate prefill and decode phases. Each request has
``num_computed_tokens`` (KV already in the pool) and ``num_tokens`` (prompt +
output); a step gives each scheduled request ``num_tokens -
num_computed_tokens`` new tokens, capped by what is left of
``max_num_batched_tokens``, so long prompts are prefilled in chunks next to
other requests' decode tokens. ``prefill_token_budget`` (None: no cap) caps the
prompt tokens of one step separately, so that a worker serving streams can keep
every step short (a decode worker sets it from its TPOT target): decode tokens
are always scheduled first, and a long prefill leaves half of the budget to
prompts that are waiting. Under the SLO-aware plan (``step_cost``, engine/step_budget.py)
short waiting prompts (what is left fits a step of the TPOT target) go first instead, and
the step they finish in, and so get their first token at the end of, stays a short one
(``_short_prompts``), and the long ones first come, first served (``SHARE_UNDER_PLAN``). A
prefill chunk that would leave its prompt at most ``1 / TAIL_SHARE`` of itself for a later
step takes that tail now (``_with_tail``): one step a little longer beats another whole step
(its base, and a step's wait for the prompt's first token) for a few tokens. When the pool
runs out, the least important
running request (lowest priority, then latest arrival) is preempted: its
blocks are freed and it is recomputed later.

Fair share among tenants: when waiting requests carry a tenant (the API key's
identity on a decode worker with keys on), they are admitted in turns: each
tenant's k-th waiting request counts as turn running(tenant) + k, and lower
turns go first (priority first under the priority policy; arrival order breaks
ties). One client's burst (128 sequences of one call) therefore cannot take
every sequence slot ahead of another client's single request: that request
gets the next free slot.

Requests whose prompt KV another worker writes (``remote_kv``) get their blocks in the
``schedule()`` that admits them, ahead of the local prompts (``_reserve_remote``; the seam's
scheduler side, engine/remote_kv.py, is told of each reservation), then wait in ``remote``
(state WAITING_FOR_REMOTE_KV), left out of steps until marked ready. One the pool cannot
hold is queued for a local prefill instead.

A request with structured outputs is admitted only once its grammar is compiled
(``Request.grammar.ready``, engine/structured_state.py); the waiting requests behind it are
admitted meanwhile, and it keeps its place in line.

With a second KV tier (``tier``, engine/kv_tier.py), a waiting request whose prefix goes on
in the tier past the pool's hit waits in ``loading`` (state LOADING_KV) while those blocks
are copied back, then is admitted first in line with them as pool hits.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

from .block_manager import KVCacheManager
from .kv_tier_types import SecondTier
from .lora_slots import lora_fits
from .remote_kv import RemoteKVScheduler, Reservation
from .request import Request, RequestStatus
from .step_budget import HORIZON as STEP_HORIZON
from .step_budget import MIN_TOKENS as MIN_CHUNK
from .step_budget import RULES, Budget, StepCost, StepTargets, plan_budget

PERIOD_ALPHA = 1 / 8  # the weight of each new interval in ``Scheduler.period_ms``
# The step plan and the short-prompt test count the pool's prefix hit of the first this many
# waiting prompts (a lookup each, per step); those further back count in full.
PREFIX_SCAN = 64
# A prefill chunk whose prompt would have at most 1/TAIL_SHARE of the chunk left takes the rest
# now (``_with_tail``): a step at most that much longer instead of one more step for the tail.
TAIL_SHARE = 8
# Under the step plan, whether a running prefill leaves half of the step's prompt tokens to the
# prompts waiting behind it, as under a fixed budget. No: the short ones go first anyway
# (``_short_prompts``), and sharing with a long one only finishes the older prompt later (first
# come, first served finishes it sooner and the other no later; docs/PERFORMANCE.md, session 45).
SHARE_UNDER_PLAN = False


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Owns the waiting / running / remote queues and the per-step plan."""

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: str = "fcfs", tier: SecondTier | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # reserved, awaiting their remote KV
        self.remote_waiting: deque[Request] = deque()  # to be reserved in the next schedule()
        self.remote_kv = RemoteKVScheduler()  # the seam's scheduler side (engine/remote_kv.py)
        self.tier = tier  # the second KV tier (engine/kv_tier.py), if any
        self.loading: dict[str, Request] = {}  # requests whose prefix the tier is loading back
        self.tier_min_blocks = 1  # a tier hit shorter than this is computed instead
        self.tier_loaded_tokens = 0  # prompt tokens loaded back from the tier (stats)
        self.num_preemptions = 0
        self.prefill_token_budget: int | None = None  # prompt tokens per step; None: no cap
        # The cap while no running request is decoding (no stream to keep fast, only arrivals to
        # let in); None: the same as prefill_token_budget.
        self.idle_prefill_token_budget: int | None = None
        # SLO-aware budget (engine/step_budget.py): set, it replaces the two caps above and is
        # planned every step from the cost curve, the streams' TPOT slack and the prompts' TTFT.
        self.step_cost: StepCost | None = None
        self.step_targets: StepTargets | None = None
        self.last_budget: Budget | None = None  # the plan of the latest step (explain, metrics)
        # Planned steps with prompt tokens to place, by the rule that chose them (every key from
        # the start: the event loop reads it while the engine thread counts)
        self.plan_rules: dict[str, int] = dict.fromkeys(RULES, 0)
        # The decoding streams the latest plan saw, (tokens since the first, seconds since it,
        # tokens left): the router's prediction plans beside them (``predicted_budget``).
        self.last_decoding: list[tuple[int, float, int]] = []
        # The streams' time per token lately: an average of the intervals between consecutive
        # plans while streams were decoding (steps and the gaps between them), for the plan.
        self.period_ms: float | None = None
        self._last_plan_at: float | None = None
        # What "now" is for the step plan (request ages): the engine's monotonic clock; the
        # simulator (sim/) runs this scheduler on its simulated clock instead.
        self.clock = clock
        self._planned_left: dict[str, int] = {}  # request id -> prompt tokens past its pool hit (`_plan_budget`)
        self.max_loras: int | None = None  # distinct LoRA adapters among the running (engine/lora_slots.py)
        # Called with a request's id when its blocks are freed (finished, aborted, preempted): a
        # draft model's KV of it goes too (engine/spec_draft.py).
        self.on_free: Callable[[str], None] | None = None
        # A remote request's reservation in another pool (a draft model's, engine/spec_draft.py):
        # called when its blocks are reserved, with the streams decoding now (the draft's block ids,
        # or none); ``followers``, the
        # pools whose reservations move with the request's into quarantine (engine/kv_connector.py).
        self.on_reserve: Callable[[Request, int], list[int]] | None = None
        self.followers: list[KVCacheManager] = []
        # Called with a request's id just before its blocks are freed: a decode step launched
        # ahead that writes them is waited for (engine arg async_scheduling, engine/overlap.py).
        self.before_free: Callable[[str], None] | None = None

    # -- queue management ---------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        if req.remote_kv:
            self.remote_waiting.append(req)
        else:
            self.waiting.append(req)

    def _urgency(self, req: Request):
        return (req.priority, req.arrival) if self.policy == "priority" else (0, req.arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.remote_waiting)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of every queue and free its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.remote_waiting:
            self.remote_waiting.remove(req)
        self.remote.pop(req.request_id, None)
        self.loading.pop(req.request_id, None)  # its load finishes on its own (engine/kv_tier.py)
        if self.before_free is not None:
            self.before_free(req.request_id)
        if not self.remote_kv.request_finished(req, status):  # (an export's blocks wait for their write)
            self.kv.free(req.request_id)
        if self.on_free is not None:
            self.on_free(req.request_id)

    # -- remote KV ----------------------------------------------------------
    def _reserve_remote(self) -> None:
        """Reserve blocks for the waiting requests whose prompt KV another worker writes, in
        arrival order: their cached prefix is pinned and every other prompt position gets a
        block (``external_tokens`` of them arrive from outside). One the pool cannot hold now
        is queued for a local prefill instead (``no_room``)."""
        while self.remote_waiting:
            req = self.remote_waiting.popleft()
            # Its adapter must fit the slots beside those running and awaited (it runs once its KV lands)
            fits = lora_fits(req.lora_request, chain(self.running, self.remote.values()), self.max_loras)
            res = self.kv.reserve_remote(req.request_id, req.prompt_token_ids, req.cache_salt) if fits else None
            if self.tier is not None:  # TP: the other ranks copy what the reservation evicted before a write lands
                self.tier.flush()
            if res is None:
                req.remote_kv = False
                self.add(req)
                self.remote_kv.no_room(req)
                continue
            cached_len, block_ids = res
            assert self.remote_kv.external_tokens(req, cached_len) == req.num_prompt_tokens - cached_len
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            req.num_cached_tokens = cached_len
            self.remote[req.request_id] = req
            draft: tuple[int, ...] = ()
            if self.on_reserve is not None:
                decoding = sum(1 for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens)
                draft = tuple(self.on_reserve(req, decoding))
            self.remote_kv.allocated(req, Reservation(cached_len, block_ids, draft))

    def reserve_now(self, req: Request) -> Reservation | None:
        """Add ``req`` (``remote_kv``) and reserve its blocks at once, outside a step (the
        simulator and tests; a decode worker's requests are reserved by `schedule`). None: no
        room, it was queued for a local prefill."""
        req.remote_kv = True
        self.add(req)
        self._reserve_remote()
        ((_, res),) = self.remote_kv.take(req.request_id)
        return res

    def is_awaiting_remote(self, req_id: str) -> bool:
        """Whether the request's reservation waits for its remote KV."""
        return req_id in self.remote

    def remote_ready(self, req_id: str) -> Request:
        """The prompt KV has arrived: the request runs from its next token on."""
        req = self.remote.pop(req_id)
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_full_blocks(req_id, req.prompt_token_ids, req.num_prompt_tokens, req.cache_salt,
                                  req.lora_request)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def remote_replaced(self, req_id: str, quarantine_as: str) -> Reservation | None:
        """A new remote attempt of an awaited request: its reservation moves under
        ``quarantine_as`` and fresh blocks are reserved at once (None: no room, queued for a
        local prefill)."""
        req = self.remote.pop(req_id)
        self.kv.rename(req_id, quarantine_as)
        self.quarantine_followers(req_id, quarantine_as)
        return self.reserve_now(req)

    def quarantine_followers(self, req_id: str, quarantine_as: str | None) -> None:
        """The request's reservation in the other pools (a draft's) moves under ``quarantine_as``
        with the target's (a late write may land there too), or is released (None)."""
        for pool in self.followers:
            if req_id in pool.tables:
                if quarantine_as is None:
                    pool.free(req_id)
                else:
                    pool.rename(req_id, quarantine_as)

    def remote_failed(self, req_id: str, quarantine_as: str | None = None) -> Request:
        """Queue the request for a local prefill, releasing its reservation, or,
        with ``quarantine_as``, keeping those blocks under that key until the
        caller is sure no late remote write can land in them."""
        req = self.remote.pop(req_id)
        if quarantine_as is None:
            self.kv.release_reservation(req_id)
        else:
            self.kv.rename(req_id, quarantine_as)
        self.quarantine_followers(req_id, quarantine_as)
        req.num_computed_tokens = 0
        req.remote_kv = False
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        return req

    # -- the step plan --------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.remote_waiting:
            self._reserve_remote()
        if self.tier is not None:
            self.finish_loads()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        cap = self.prefill_token_budget
        express: list[Request] = []
        planned = False
        if self.step_cost is not None and self.step_targets is not None:
            planned = True
            plan = self._plan_budget(self.step_cost, self.step_targets)
            cap = plan.tokens
            express, express_tokens = self._short_prompts(plan)
            if express:  # they get their first token when this step ends: keep it short
                cap = max(plan.short_step(), express_tokens + MIN_CHUNK)
        elif cap is not None and self.idle_prefill_token_budget is not None and not any(
                r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            cap = self.idle_prefill_token_budget  # nobody decoding: bigger, more efficient chunks
        prefill_left = cap if cap is not None else budget
        # Under a prefill budget, a running prefill continues with at most half of it while prompts
        # wait, so that a short prompt arriving behind a long one starts in the next step; with
        # the step plan, short prompts that finish in this step are served first.
        chunk_cap = prefill_left
        if express:  # the room they need is kept for them, the rest goes on the long prompts
            chunk_cap = max(MIN_CHUNK, prefill_left - express_tokens)
        elif cap is not None and self.waiting and (SHARE_UNDER_PLAN or not planned):
            chunk_cap = max(1, cap // 2)
        scheduled_ids = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            chunk = req.num_tokens - req.num_computed_tokens > 1  # prefill (or recompute), not decode
            if chunk:
                # (the streams after it in line keep a token each of the step's limit)
                n = _with_tail(min(n, prefill_left, chunk_cap), req.num_tokens - req.num_computed_tokens,
                               budget - (len(self.running) - i - 1))
            elif n == 1 and req.spec_token_ids:  # and its proposals to verify (engine/spec_decode.py)
                n = min(1 + len(req.spec_token_ids), budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                if not chunk and n > 1:  # its proposals go before anyone is preempted
                    req.spec_token_ids, n = [], 1
                    continue
                candidates = [r for r in self.running if r.request_id not in scheduled_ids]
                victim = max(candidates, key=self._urgency)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                scheduled_ids.add(req.request_id)
                budget -= n
                if chunk:
                    prefill_left -= n
                i += 1
        if out.preempted:
            return out  # memory is tight: admit nothing new this step
        if len(self.waiting) > 1 and self.waiting[0].tenant is not None:
            self._fair_order()  # (keys are on for every request of a worker, or for none)
        elif self.policy == "priority" and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self._urgency))
        if express:  # ahead of the long prompts waiting before them (their order kept)
            first = set(map(id, express))
            self.waiting = deque([r for r in self.waiting if id(r) in first] +
                                 [r for r in self.waiting if id(r) not in first])
        held: list[Request] = []  # waiting for their grammar: the requests behind them go first
        while self.waiting and min(budget, prefill_left) > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if (req.grammar is not None and not req.grammar.ready) or not lora_fits(  # (its adapter needs a
                    req.lora_request, chain(self.running, self.remote.values()), self.max_loras):  # slot: later)
                held.append(self.waiting.popleft())
                continue
            hits, cached = self._prefix_hit(req)
            if self.tier is not None and not req.tier_tried and not req.owes_prompt_logprobs:
                req.tier_tried = True
                if self._start_load(req, hits):
                    self.waiting.popleft()
                    continue
            n = _with_tail(min(req.num_tokens - cached, budget, prefill_left), req.num_tokens - cached, budget)
            if not self.kv.allocate(req.request_id, cached + n, hits):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0 and not req.output_token_ids:
                req.num_cached_tokens = cached
            req.num_computed_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
            prefill_left -= n
        if held:
            self.waiting.extendleft(reversed(held))
        return out

    def _short_prompts(self, plan: Budget) -> tuple[list[Request], int]:
        """The waiting prompts that finish their prefill in this step, and their tokens.

        A prompt gets its first token when the step that computes its last prompt token ends,
        so a short prompt admitted beside a long prompt's big chunk waits for that chunk. A
        waiting prompt is short when what is left of it after the prefix the pool holds fits
        a step of the TPOT target (``Budget.target_tokens``); the short ones, in their order,
        up to that many tokens together, go first in a step whose other prompt tokens stay within
        ``Budget.short_step`` (a step of the target, or what the prompts' TTFT targets need:
        the long prompts are never held below what their own TTFT needs, and keep
        ``MIN_CHUNK`` a step). Requests waiting after a preemption are not short: they have
        their output to recompute too."""
        if not self.waiting or plan is None:
            return [], 0
        limit = plan.target_tokens
        out: list[Request] = []
        total = 0
        for pos, req in enumerate(self.waiting):
            left = req.num_tokens - req.num_computed_tokens
            if req.output_token_ids:
                continue
            if left > limit and pos < PREFIX_SCAN:  # long, unless the pool holds its prefix (as planned)
                left = self._planned_left.get(req.request_id, left)
            if left > limit:
                continue
            if total + left > limit or len(out) + len(self.running) >= self.max_num_seqs:
                break
            out.append(req)
            total += left
        if len(out) == len(self.waiting) and not any(r.num_tokens - r.num_computed_tokens > 1 for r in self.running):
            return [], 0  # nothing long in the step: nothing to hold back
        return out, total

    def _prefix_hit(self, req: Request) -> tuple[list, int]:
        """The pool's cached prefix blocks for a waiting request and the tokens they cover; none
        for one that owes prompt logprobs (its every prompt position runs: engine/prompt_logprobs.py)."""
        if req.owes_prompt_logprobs:
            return [], 0
        return self.kv.computed_blocks(req.request_id, req.all_token_ids, req.cache_salt)

    def _waiting_left(self, req: Request) -> int:
        """The prompt tokens a waiting request will compute: those after the prefix the pool
        holds now (``computed_blocks``; it may yet be evicted before the request is admitted)."""
        return req.num_tokens - self._prefix_hit(req)[1]

    def _fair_order(self) -> None:
        """Order the waiting requests in tenant turns (see the module docstring)."""
        waiting = sorted(self.waiting, key=self._urgency) if self.policy == "priority" else list(self.waiting)
        turns = Counter(r.tenant for r in self.running)
        keyed = []
        for pos, req in enumerate(waiting):
            keyed.append((req.priority if self.policy == "priority" else 0, turns[req.tenant], pos))
            turns[req.tenant] += 1
        self.waiting = deque(waiting[k[2]] for k in sorted(keyed))

    def _plan_budget(self, cost: StepCost, targets: StepTargets) -> Budget:
        """This step's plan of prompt tokens from the SLOs (engine/step_budget.py)."""
        now = self.clock()
        decoding, prompts = [], []
        for r in self.running:
            left = r.num_tokens - r.num_computed_tokens
            if left == 1 and r.first_token_time is not None:
                decoding.append((len(r.output_token_ids) - 1, now - r.first_token_time,
                                 r.params.max_tokens - len(r.output_token_ids)))
            elif left > 1:
                prompts.append((left, now - r.arrival_time, r.num_computed_tokens))
        self._planned_left = {}  # this step's lookups, for `_short_prompts` right after
        for pos, r in enumerate(self.waiting):
            left = r.num_tokens
            if pos < PREFIX_SCAN and not r.output_token_ids:
                left = self._planned_left[r.request_id] = self._waiting_left(r)
            prompts.append((left, now - r.arrival_time, r.num_tokens - left))
        if self.last_decoding and decoding and self._last_plan_at is not None:  # stepping all along
            gap = (now - self._last_plan_at) * 1e3
            self.period_ms = gap if self.period_ms is None else self.period_ms + PERIOD_ALPHA * (gap - self.period_ms)
        self._last_plan_at = now
        self.last_decoding = decoding
        self.last_budget = plan = plan_budget(cost, targets, decoding, prompts, self.max_num_batched_tokens,
                                              self.period_ms)
        if prompts and plan.rule in self.plan_rules:
            self.plan_rules[plan.rule] += 1
        return plan

    def predicted_budget(self, tokens: int, cached: int, decodes: int, backlog: int) -> int | None:
        """The prompt tokens per step the step plan would give a prompt of ``tokens`` after
        ``cached`` arriving now behind ``backlog`` waiting prompt tokens, beside ``decodes``
        streams: those of the latest step, then fresh ones (for the router's local
        prediction; engine/step_budget.py); for a short prompt behind a backlog, the short step it
        will finish in (``_short_prompts``). With a fixed cap: the cap (None: none)."""
        if self.step_cost is None or self.step_targets is None:
            return self.prefill_token_budget
        seen = self.last_decoding[:decodes]
        streams = seen + [(0, 0.0, STEP_HORIZON)] * (decodes - len(seen))
        plan = plan_budget(self.step_cost, self.step_targets, streams,
                           [(backlog + tokens, 0.0, cached)], self.max_num_batched_tokens, self.period_ms)
        if backlog and 0 < tokens - cached <= plan.target_tokens:  # a short prompt: it shares a short step
            return max(plan.short_step(), tokens - cached + MIN_CHUNK)
        return plan.tokens

    # -- the second tier ------------------------------------------------------------
    def _start_load(self, req: Request, hits: list) -> bool:
        """Start loading back the blocks that follow the pool's hit in the tier; True when a
        load started (the request then waits in ``loading``)."""
        kv, tier, bs = self.kv, self.tier, self.kv.block_size
        if tier is None:
            return False
        hashes = kv.hashes.get(req.request_id, [])
        rest = hashes[len(hits):(req.num_tokens - 1) // bs]  # the last token is always computed
        n = tier.leading(rest)
        if n < self.tier_min_blocks:
            return False
        per_token = self.step_cost.prefill_ms / 1e3 if self.step_cost is not None else None
        if not tier.worth_loading(n, per_token, bs):
            return False
        pool = kv.pool
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if n > pool.num_free - free_hits:
            return False  # no room now: compute as usual
        pool.touch(hits)  # the request's pool hits must not be evicted to make room for the load
        blocks = pool.allocate(n)
        load = tier.start_load(req.request_id, rest[:n], blocks, list(hits) + blocks)
        if load is None:
            pool.release(list(reversed(list(hits) + blocks)))
            return False
        if len(load.blocks) < n:  # part of it left the tier meanwhile
            pool.release(list(reversed(blocks[len(load.blocks):])))
            load.held = list(hits) + load.blocks
        req.status = RequestStatus.LOADING_KV
        self.loading[req.request_id] = req
        return True

    def finish_loads(self) -> None:
        """Register finished loads' blocks in the prefix cache, give back what the loads held,
        and put their requests first in line (in the order their loads finished)."""
        back: list[Request] = []
        pool = self.kv.pool
        if self.tier is None:
            return
        for load in self.tier.finished_loads():
            if load.error is None:
                for b, h, parent, tokens in zip(load.blocks, load.hashes, load.parents, load.tokens):
                    pool.cache(b, h, parent, tokens)
                self.tier_loaded_tokens += len(load.blocks) * self.kv.block_size
            pool.release(list(reversed(load.held)))  # registered blocks stay findable in the LRU
            req = self.loading.pop(load.request_id, None)
            if req is not None:  # None: it finished (aborted) while loading
                req.status = RequestStatus.WAITING
                back.append(req)
        self.waiting.extendleft(reversed(back))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.tier_tried = False
        if self.before_free is not None:
            self.before_free(req.request_id)
        self.kv.free(req.request_id)
        if self.on_free is not None:
            self.on_free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)


def _with_tail(n: int, left: int, budget: int) -> int:
    """A prefill chunk of ``n`` of the ``left`` tokens its prompt still needs: all of them when
    the rest would be at most ``n / TAIL_SHARE`` and the step's token budget holds them."""
    return left if 0 < left - n <= n // TAIL_SHARE and left <= budget else n
