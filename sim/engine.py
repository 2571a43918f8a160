"""`SimEngine`: the product's scheduler and KV block manager, stepping on a simulated clock.

What the engine decides is the product's code: `engine/scheduler.py` (continuous batching,
chunked prefill, the SLO-aware step budget, preemption, remote-KV reservations) over
`engine/block_manager.py` (the paged pool and the prefix cache with the real block hashes).
What a step costs comes from the worker's `StepModel` (sim/profile.py) instead of a forward
pass, and the sampled token is made up (the simulator has no logits; every request runs to
its output length, as ``ignore_eos`` does). The bookkeeping after a step follows
`LLMEngine.step` (engine/llm_engine.py): computed counts, newly full blocks cached, a token
for each request whose last position was computed, finished requests freed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pdserve.common import Priority
from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus, SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.step_budget import attention_pairs

from .profile import StepModel

VOCAB = 32000


@dataclass(slots=True)
class StepInfo:
    """One simulated step: what it ran and how long it took."""

    ms: float
    decodes: int  # streams that decoded one token
    prompt_tokens: int  # prompt (or recompute) tokens
    pairs: int  # attention pairs of those prompt tokens
    seqs: int


class StreamLoad:
    """Tokens streamed per second, a moving average over the last ``window_s`` (exponential):
    what the CPU work outside the engine (the frontend's chunks, the clients' parsing) scales with."""

    __slots__ = ("window_s", "_rate", "_t")

    def __init__(self, window_s: float = 1.0):
        self.window_s = window_s
        self._rate = 0.0
        self._t = 0.0

    def rate(self, now: float) -> float:
        return self._rate * math.exp(-(now - self._t) / self.window_s) if now > self._t else self._rate

    def add(self, now: float, tokens: int) -> None:
        self._rate = self.rate(now) + tokens / self.window_s
        self._t = max(now, self._t)


class SimEngine:
    """One worker's engine on the simulator's clock (``clock()`` returns seconds)."""

    def __init__(self, model: StepModel, *, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 clock, rng: random.Random, noise_cv: float = 0.0, policy: str = "fcfs",
                 contention_ms_per_token: float = 0.0, load: StreamLoad | None = None, streams: bool = False):
        self.model = model
        self.kv = KVCacheManager(model.kv_blocks, block_size)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens, max_num_seqs, policy)
        self.scheduler.clock = clock
        self.clock = clock
        self.rng = rng
        # CPU spent elsewhere on the host per token streamed, and the rate it reads (sim/profile.py)
        self.contention_ms_per_token = contention_ms_per_token
        self.load = load
        self.streams = streams  # a decode worker: what it emits is streamed (and counted in ``load``)
        self.noise_sigma = math.sqrt(math.log(1 + noise_cv * noise_cv)) if noise_cv > 0 else 0.0
        self.busy_ms = 0.0
        self.steps = 0
        self.prompt_tokens_computed = 0

    def request(self, rid: str, token_ids: list[int], max_tokens: int, priority: Priority | str,
                arrival: float) -> Request:
        """A request as the engine would make it (greedy, ``ignore_eos``), arriving at ``arrival``."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = Request(rid, token_ids, params, priority=int(Priority.parse(priority)), arrival=arrival)
        req.arrival_time = arrival
        return req

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def cached_prefix_len(self, req_id: str, token_ids: list[int]) -> int:
        """Prompt tokens the prefix cache holds now (a read-only lookup, as the connector's)."""
        _, cached = self.kv.computed_blocks(req_id, token_ids)
        self.kv.hashes.pop(req_id, None)
        return cached

    def plan(self) -> tuple[SchedulerOutput, StepInfo | None]:
        """The next step's plan and its simulated cost (None: nothing to run)."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return out, None
        decodes = prompt = pairs = context = 0
        for req, n in out.scheduled:
            if n == 1 and req.output_token_ids:
                decodes += 1
                context += req.num_computed_tokens
            else:
                prompt += n
                pairs += attention_pairs(n, req.num_computed_tokens)
        ms = self.model.step_ms(decodes, prompt, pairs, context)
        if self.contention_ms_per_token and self.load is not None:
            ms *= 1.0 + self.contention_ms_per_token * self.load.rate(self.clock()) / 1e3
        if self.noise_sigma:
            ms *= self.rng.lognormvariate(-self.noise_sigma ** 2 / 2, self.noise_sigma)
        return out, StepInfo(ms, decodes, prompt, pairs, len(out.scheduled))

    def commit(self, out: SchedulerOutput, info: StepInfo) -> list[tuple[Request, bool]]:
        """Apply a step that ended now: (request, finished) for each request that got a token."""
        now = self.clock()
        self.busy_ms += info.ms
        self.steps += 1
        self.prompt_tokens_computed += info.prompt_tokens
        bs = self.kv.block_size
        emitted = []
        for req, n in out.scheduled:
            if req.status is not RequestStatus.RUNNING:
                continue  # finished meanwhile (an abort)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now - info.ms / 1e3
            before = req.num_computed_tokens
            req.num_computed_tokens += n
            if req.num_computed_tokens // bs > before // bs:
                self.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens, req.cache_salt)
            if req.num_computed_tokens >= req.num_tokens:
                emitted.append((req, self.append(req, now)))
        if self.streams and self.load is not None and emitted:
            self.load.add(now, len(emitted))
        return emitted

    def append(self, req: Request, now: float) -> bool:
        """One made-up token for ``req``; True when that finishes it (its length)."""
        req.output_token_ids.append((req.num_tokens * 2654435761) % VOCAB)
        if req.first_token_time is None:
            req.first_token_time = now
        if len(req.output_token_ids) >= req.params.max_tokens:
            req.finish_reason = "length"
            self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
            return True
        return False
