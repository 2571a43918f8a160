"""`SimEngine`: the product's scheduler and KV block manager, stepping on a simulated clock.

What the engine decides is the product's code: `engine/scheduler.py` (continuous batching,
chunked prefill, the SLO-aware step budget, preemption, remote-KV reservations) over
`engine/block_manager.py` (the paged pool and the prefix cache with the real block hashes).
What a step costs comes from the worker's `StepModel` (sim/profile.py) instead of a forward
pass, and the sampled token is made up (the simulator has no logits; every request runs to
its output length, as ``ignore_eos`` does). The bookkeeping after a step follows
`LLMEngine.step` (engine/llm_engine.py): computed counts, newly full blocks cached, a token
for each request whose last position was computed, finished requests freed.

A worker with a second KV tier (``tier_blocks`` in its profile) gets a `SimTier`: the product's
scheduler and block pool call it as they call engine/kv_tier.py's `KVTier` (blocks stored as the
pool evicts them, leading hits loaded back before a prompt is computed, the request waiting in
LOADING_KV meanwhile), with the load's time taken from the profile instead of a copy.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common import Priority
from pdserve.common.block_hash import block_hashes
from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.kv_tier_types import TierLoad
from pdserve.engine.request import Request, RequestStatus, SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.step_budget import attention_pairs

from .profile import CostProfile, StepModel

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


class SimTier:
    """A worker's second KV tier on the simulated clock, behind the interface engine/kv_tier.py's
    `KVTier` offers the scheduler (`leading`, `worth_loading`, `start_load`, `finished_loads`,
    `flush`) and the block pool (`evicting`).

    Slots are an LRU of whole blocks by hash, as the product's: a block the pool evicts is
    stored (the least recently stored or loaded unpinned slot gives way when full; with every
    slot pinned by a load the block is dropped), a load pins its slots and makes them recent.
    The product copies blocks ahead of eviction on its own thread, off the engine's steps; here
    a block is in the tier from its eviction on, at no cost to the step. A load of n blocks
    takes ``n x block_bytes / load_bytes_per_s`` and finishes on its own (the scheduler
    registers its blocks at its next look, `finished_loads`); its measured bandwidth
    (``load_bytes_per_s``, what the router prices tier hits with) is known after the first,
    as KVTier's is."""

    def __init__(self, capacity_blocks: int, block_bytes: int, load_gb_per_s: float, clock):
        if capacity_blocks < 1 or block_bytes < 1 or not load_gb_per_s > 0:
            raise ValueError(f"a tier needs capacity_blocks >= 1, block_bytes >= 1 and a bandwidth > 0 (got "
                             f"{capacity_blocks}, {block_bytes}, {load_gb_per_s})")
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self._bytes_per_s = load_gb_per_s * 1e9
        self.clock = clock
        self.load_bytes_per_s: float | None = None  # measured: None until the first load is over
        self._slots: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()  # LRU first
        self._pins: dict[bytes, int] = {}
        self._loads: list[tuple[float, TierLoad]] = []  # (when it is over, the load), in start order
        self.stats = {"stored": 0, "dropped": 0, "evicted": 0, "loads": 0, "loaded_blocks": 0, "skipped_by_cost": 0}

    def flush(self, now: bool = True) -> None:
        """Tensor-parallel ranks repeat rank 0's copies in the product; one simulated engine has
        nothing to hand over."""

    def evicting(self, block) -> None:
        h = block.block_hash
        if h in self._slots:
            return
        if len(self._slots) >= self.capacity:
            victim = next((k for k in self._slots if not self._pins.get(k)), None)
            if victim is None:
                self.stats["dropped"] += 1
                return
            del self._slots[victim]
            self.stats["evicted"] += 1
        self._slots[h] = (block.parent_hash, block.token_ids)
        self.stats["stored"] += 1

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def leading(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._slots:
                break
            n += 1
        return n

    def worth_loading(self, blocks: int, compute_s_per_token: float | None, block_size: int) -> bool:
        """engine/kv_tier.py KVTier.worth_loading: yes without a measured load or a step cost."""
        if compute_s_per_token is None or self.load_bytes_per_s is None:
            return True
        if blocks * self.block_bytes / self.load_bytes_per_s < blocks * block_size * compute_s_per_token:
            return True
        self.stats["skipped_by_cost"] += 1
        return False

    def start_load(self, request_id: str, hashes: list[bytes], blocks: list, held: list) -> TierLoad | None:
        n = self.leading(hashes)
        if not n:
            return None
        for h in hashes[:n]:
            self._pins[h] = self._pins.get(h, 0) + 1
            self._slots.move_to_end(h)  # loaded: recently used
        meta = [self._slots[h] for h in hashes[:n]]
        load = TierLoad(request_id, list(hashes[:n]), [m[0] for m in meta], [m[1] for m in meta], list(blocks[:n]),
                        held)
        load.seconds = n * self.block_bytes / self._bytes_per_s
        self._loads.append((self.clock() + load.seconds, load))
        return load

    def finished_loads(self) -> list[TierLoad]:
        now = self.clock()
        done = [load for at, load in self._loads if at <= now]
        if not done:
            return []
        self._loads = [(at, load) for at, load in self._loads if at > now]
        for load in done:
            load.finished = True
            for h in load.hashes:
                left = self._pins.get(h, 0) - 1
                if left > 0:
                    self._pins[h] = left
                else:
                    self._pins.pop(h, None)
            self.stats["loads"] += 1
            self.stats["loaded_blocks"] += len(load.blocks)
            self.load_bytes_per_s = self._bytes_per_s
        return done

    def next_load_at(self) -> float | None:
        """When the first load in flight is over (None: none is)."""
        return min((at for at, _ in self._loads), default=None)


class SimEngine:
    """One worker's engine on the simulator's clock (``clock()`` returns seconds)."""

    def __init__(self, model: StepModel, *, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 clock, rng: random.Random, noise_cv: float = 0.0, policy: str = "fcfs",
                 contention_ms_per_token: float = 0.0, load: StreamLoad | None = None, streams: bool = False,
                 tier: SimTier | None = None):
        self.model = model
        # the second KV tier, given to the pool and the scheduler as engine/llm_engine.py gives
        # its KVTier (None: no tier)
        self.tier = tier
        self.kv = KVCacheManager(model.kv_blocks, block_size, tier=tier)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens, max_num_seqs, policy, tier=tier, clock=clock)
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

    def prompt_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The hashes of the prompt's full blocks but the last token's (it is always computed),
        as engine/kv_connector.py hashes them for its lookups."""
        bs = self.kv.block_size
        return block_hashes(token_ids[: ((len(token_ids) - 1) // bs) * bs], bs)

    def tier_prefix_len(self, token_ids: list[int], cached_len: int) -> int:
        """engine/kv_connector.py tier_prefix_len: prompt tokens the second tier holds right after
        the pool's ``cached_len`` (0 without a tier)."""
        if self.tier is None:
            return 0
        bs = self.kv.block_size
        return self.tier.leading(self.prompt_hashes(token_ids)[cached_len // bs:]) * bs

    def tier_load_ms_per_token(self) -> float:
        """engine/kv_connector.py tier_load_ms_per_token: 0 before the tier's first load."""
        tier = self.tier
        if tier is None or not tier.load_bytes_per_s:
            return 0.0
        return tier.block_bytes / self.kv.block_size / tier.load_bytes_per_s * 1e3

    def held_prefix_len(self, hashes: list[bytes]) -> int:
        """Tokens of the leading blocks ``hashes`` this worker holds in its pool's prefix cache or
        its tier: what its KV events tell the cluster's index (cluster/kvindex/, every medium)."""
        cached, tier = self.kv.pool.cached, self.tier
        n = 0
        for h in hashes:
            if h not in cached and (tier is None or not tier.holds(h)):
                break
            n += 1
        return n * self.kv.block_size

    def next_load_at(self) -> float | None:
        """When a tier load in flight is over (None: no tier, or no load): an engine with only
        loads to wait for steps again then."""
        return self.tier.next_load_at() if self.tier is not None else None

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


def worker_engine(model: StepModel, prof: CostProfile, tp: int, *, clock: Callable[[], float], rng: random.Random,
                  shared_load: StreamLoad, streams: bool = False) -> SimEngine:
    """A worker's engine on the simulation's ``clock`` and generator, with its profile's limits, the
    streaming load its steps contend with (its own, or the shared host's ``shared_load``) and its
    second tier (``tier_blocks``; each rank holds its heads of a block, so a load moves 1/tp of it
    per rank)."""
    load = shared_load if prof.contention_scope == "cluster" else StreamLoad()
    tier = None
    if prof.tier_blocks:
        tier = SimTier(prof.tier_blocks, max(1, prof.block_size * prof.kv_bytes_per_token // tp), prof.tier_gb_per_s,
                       clock)
    return SimEngine(model, block_size=prof.block_size, max_num_batched_tokens=prof.max_num_batched_tokens,
                     max_num_seqs=prof.max_num_seqs, clock=clock, rng=rng, noise_cv=prof.noise_cv,
                     contention_ms_per_token=prof.contention_ms_per_token, load=load, streams=streams, tier=tier)
