"""The request path every decode-worker API shares (gRPC and HTTP).

validate -> admit (QoS) -> prefix-cache lookup -> decide (router) -> run
(local, or the remote path once one is attached) -> stream chunks -> final
breakdown. Errors are `RequestError` values with a status code the API
layer maps to gRPC / HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from pdserve.engine import SamplingParams
from pdserve.router import ArrivalRate, ClusterSnapshot, RequestFeatures, admit

from .async_engine import AsyncEngine
from .breakdown import breakdown, check_prediction
from .ingress import (
    Chunk,
    GenerateInput,
    Prepared,
    RemotePath,
    RequestError,
    ServingLimits,
    as_request_error,
    sample_input,
)
from .metrics import WorkerMetrics
from .policy_state import PolicyState
from .prefill_pool import PrefillView
from .validate import Validator, check_privileges

__all__ = ["Frontend", "Chunk", "GenerateInput", "Prepared", "RemotePath", "RequestError", "ServingLimits"]

log = logging.getLogger(__name__)
_NO_PREFILL = PrefillView()  # what a worker without a remote path reports (never written)


class Frontend:
    """Shared request handling of one decode worker."""

    def __init__(self, engine: AsyncEngine, policy: PolicyState, metrics: WorkerMetrics,
                 worker_id: str, served_model: str, limits: ServingLimits | None = None,
                 remote: RemotePath | None = None):
        self.engine = engine
        self.limits = limits or ServingLimits()
        eng = engine.engine
        self.max_prompt_chars = self.limits.max_prompt_chars or eng.max_model_len * eng.tokenizer.max_token_chars
        self.validator = Validator(eng, self.limits, served_model, self.max_prompt_chars)
        # Bounded: a burst of huge prompts queues here instead of starving the event loop.
        self._tokenizer_pool = ThreadPoolExecutor(self.limits.tokenizer_threads, thread_name_prefix="pdserve-tokenize")
        self.policy = policy
        self.metrics = metrics
        self.worker_id = worker_id
        self.served_model = served_model
        self.remote = remote
        self.draining = False
        # Identity: what a client names (request_id) is a label scoped to its API key; the
        # engine, the handoff and result delivery key on an id minted here per admission, so
        # a label reused while its old sequence is still being torn down (or by another
        # tenant) can never be attached to that sequence's output.
        self.inflight: dict[tuple[str | None, str], str] = {}  # (key identity, label) -> engine id
        self.sequences_per_key: Counter = Counter()  # key identity -> sequences its calls hold (keys on)
        self._via_remote: set[str] = set()
        self._id_prefix = uuid.uuid4().hex[:8]  # per worker process: ids never repeat across restarts
        self._admissions = itertools.count(1)
        self.pending_prefill_tokens = 0  # admitted locally, first token not yet produced
        # Sent remote by this worker, first token not yet back: queue stats are
        # polled, so a burst would otherwise see an empty queue for every request.
        self.pending_remote_tokens = 0
        self.pending_remote_requests = 0
        self.num_prefilling = 0
        self.num_decoding = 0
        self.arrivals = ArrivalRate()  # requests/s reaching this worker: the cost model's blocking penalty

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # -- validation (decode/validate.py) ------------------------------------------------
    def validate(self, inp: GenerateInput) -> tuple[list[int], SamplingParams, int]:
        """Check and tokenize one request (CPU work: call it off the event loop)."""
        return self.validator.validate(inp)

    # The prompt tokens per step the worker's engine would give a local prefill of (tokens,
    # cached) now (decode/prefill_budget.py); None: no cap.
    prefill_budget_tokens = staticmethod(lambda tokens=0, cached=0: None)

    @property
    def prefill_view(self) -> PrefillView:
        """The prefill side as the remote path sees it (all zero without one)."""
        return self.remote.view if self.remote is not None else _NO_PREFILL

    def snapshot(self, tokens: int = 0, cached: int = 0) -> ClusterSnapshot:
        """The cluster as this worker sees it, for a prompt of ``tokens`` uncached tokens after
        ``cached`` ones (the local prefill budget the engine would plan for it)."""
        view = self.prefill_view
        load = self.engine.engine.load()
        return ClusterSnapshot(
            costs=self.policy.costs.snapshot(),
            prefill_queue_depth=max(view.queue_depth, self.pending_remote_requests),
            prefill_queue_tokens=max(view.queue_tokens, self.pending_remote_tokens),
            prefill_pool_size=view.pool_size if self.remote and self.remote.available() else 0,
            decode_active_requests=self.num_decoding,
            decode_waiting_requests=self.num_prefilling,
            local_prefill_queue_tokens=self.pending_prefill_tokens,
            local_prefill_queue_requests=self.num_prefilling - self.pending_remote_requests,
            decode_kv_usage=load.kv_usage,
            kv_free_tokens=load.num_free_blocks * self.engine.engine.config.block_size,
            arrival_rate_per_s=self.arrivals.rate(time.monotonic()),
            local_prefill_budget_tokens=self.prefill_budget_tokens(tokens, cached),
        )

    def refresh_gauges(self) -> None:
        m, load, view = self.metrics, self.engine.engine.load(), self.prefill_view
        m.running.set(load.running)
        m.waiting.set(load.waiting)
        m.waiting_remote.set(load.awaiting_remote_kv)
        m.kv_usage.set(load.kv_usage)
        m.prefill_queue_depth.set(view.queue_depth)
        m.prefill_queue_tokens.set(view.queue_tokens)
        m.prefill_pool_size.set(view.pool_size)

    def cached_len(self, ids: list[int]) -> int:
        """Prompt tokens this worker's prefix cache holds now (read-only lookup)."""
        return self.engine.engine.connector.cached_prefix_len(ids)

    def check_serving(self) -> None:
        if self.draining:
            raise RequestError("unavailable", "worker is draining; retry on another decode worker")
        if not self.engine.alive:
            raise RequestError("unavailable", "this worker's engine is not running; retry on another decode worker")

    async def prepare(self, inp: GenerateInput) -> Prepared:
        """Validate (in the tokenizer pool), admit and route; raises RequestError."""
        arrival = time.monotonic()
        self.check_serving()
        check_privileges(inp)
        loop = asyncio.get_running_loop()
        ids, params, prio = await loop.run_in_executor(self._tokenizer_pool, self.validate, inp)
        self.check_serving()  # it may have changed while the prompt was tokenized
        label = inp.request_id or uuid.uuid4().hex
        if (_identity(inp.caller), label) in self.inflight:
            raise RequestError("already_exists", f"request_id: {label!r} is still in flight on this worker; "
                               "wait for it to end (or abort it) before reusing the id", "request_id")
        policy = self.policy.policy
        resume = inp.resume_ids or []
        # A resumed request (a migrated stream) computes its prompt and resumed tokens here:
        # the remote path prefills prompts, and its first token would not follow the resumed ones.
        computed = ids + resume
        cached = self.cached_len(computed)
        self.arrivals.observe(arrival)
        # The prefill workers' cached prefixes of it (their KV events; decode/remote.py prefix_view).
        view = self.remote.prefix_view if self.remote is not None and not resume else None
        hint = view.cached_tokens(ids) if view is not None else {}
        remote_cached = max(hint.values(), default=0)
        connector = self.engine.engine.connector
        feats = RequestFeatures(prompt_len=len(computed), cached_len=cached, priority=prio,
                                ttft_slo_ms=inp.ttft_slo_ms, override="local" if resume else inp.route,
                                max_tokens=params.max_tokens,
                                remote_cached_len=remote_cached,
                                tier_cached_len=connector.tier_prefix_len(computed, cached),
                                peer_reads=getattr(self.remote, "peers", None) is not None)
        snap = self.snapshot(max(0, len(computed) - cached), cached)
        if feats.tier_cached_len:  # the tier's measured load cost (engine/kv_tier.py)
            snap = dataclasses.replace(snap, costs=dataclasses.replace(
                snap.costs, tier_load_ms_per_token=connector.tier_load_ms_per_token()))
        adm = admit(feats, snap, policy)
        if not adm.ok:
            self.metrics.refused(adm.reason)
            raise RequestError("resource_exhausted", adm.detail, None, adm.predicted_ttft_ms, adm.retry_after_ms)
        if adm.degraded and adm.max_tokens is not None and adm.max_tokens < params.max_tokens:
            params = SamplingParams(**{**params.to_dict(), "max_tokens": adm.max_tokens})
        decision = adm.decision
        self.metrics.decision(decision.route, decision.reason)
        self.metrics.prompt_tokens.inc(len(ids))
        rid = f"{self._id_prefix}-{next(self._admissions):x}"
        residual = (snap.costs.ttft_residual_remote_ms if decision.route == "remote"
                    else snap.costs.ttft_residual_local_ms) if len(computed) > cached else 0.0
        borrow = None
        peers = getattr(self.remote, "peers", None)
        if decision.route == "local" and peers is not None and not resume:
            borrow = peers.choose(hint, cached, len(ids), snap.costs, feats.tier_cached_len)
        return Prepared(rid, inp, ids, params, prio, cached, decision, arrival, label=label, prefix_hint=hint,
                        tenant=_identity(inp.caller), residual_ms=residual, borrow=borrow)

    def engine_id(self, label: str, caller=None) -> str | None:
        """The engine's id of the in-flight request a client calls `label` (None: none)."""
        return self.inflight.get((_identity(caller), label))

    @contextlib.contextmanager
    def _key_share(self, caller, sequences: int):
        """Hold `sequences` of the caller's API key's share (limits.max_sequences_per_key) for
        one call; refused (429) before any work when the key's calls would hold more. With keys
        off every client is the same anonymous tenant: no per-key bound then."""
        identity = _identity(caller)
        if identity is None:
            yield
            return
        cap, held = self.limits.max_sequences_per_key, self.sequences_per_key[identity]
        if held + sequences > cap:
            self.metrics.refused("key_sequences")
            raise RequestError("resource_exhausted", f"this API key has {held} sequence(s) in flight on this "
                               f"worker and this call adds {sequences}, over its limit of {cap} "
                               "(limits.max_sequences_per_key); wait for some to finish", None, None, 1000)
        self.sequences_per_key[identity] += sequences
        try:
            yield
        finally:
            self.sequences_per_key[identity] -= sequences
            if self.sequences_per_key[identity] <= 0:
                del self.sequences_per_key[identity]

    # -- running -----------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[Chunk]:
        """One sequence: admitted, routed and streamed (within its key's share)."""
        with self._key_share(inp.caller, 1):
            async for chunk in self._generate(inp):
                yield chunk

    async def _generate(self, inp: GenerateInput) -> AsyncIterator[Chunk]:
        prep = await self.prepare(inp)
        rid = prep.request_id
        key = (_identity(inp.caller), prep.label)
        eff = len(prep.prompt_ids) + len(inp.resume_ids or ()) - prep.cached_len
        self.inflight[key] = rid  # no await since prepare() checked the label is free
        self.num_prefilling += 1
        state = {"first": False, "finished": False}
        extra: dict = {}
        remote = self.remote if (prep.decision.route == "remote" and self.remote is not None
                                 and self.remote.available()) else None
        if inp.resume_ids:
            extra.update(reason=f"resumed: a migrated stream continues after {len(inp.resume_ids)} token(s), "
                         "prefilled locally")
        if prep.decision.route == "remote" and remote is None:  # e.g. forced remote, no live prefill worker
            extra.update(route="local", reason="remote chosen but no live prefill worker: prefilled locally")
        if remote is not None:
            self._via_remote.add(rid)
            self.pending_remote_tokens += eff
            self.pending_remote_requests += 1
        else:
            self.pending_prefill_tokens += eff
        try:
            source = remote.stream(prep) if remote is not None else self._local(prep)
            last_t = None
            async for item, final, info in source:
                extra.update(info)
                if isinstance(item, BaseException) or item.finish_reason == "error":
                    state["end"] = "error"
                    raise as_request_error(item)
                now = time.monotonic()
                if item.new_token_ids and not state["first"]:
                    state["first"] = True
                    self._prefill_done(eff, remote is not None)
                    self.num_decoding += 1
                    self.metrics.ttft.observe(now - prep.arrival)
                    check_prediction(prep, remote is not None, extra, (now - prep.arrival) * 1e3, self.metrics, self.policy)
                elif item.new_token_ids and last_t is not None:
                    self.metrics.itl.observe(now - last_t)
                if item.new_token_ids:
                    last_t = now
                chunk = Chunk(item.new_token_ids, item.text, item.finish_reason, item.logprobs)
                if item.finished:
                    state["finished"] = True
                    self.metrics.request_finished(item.finish_reason)
                    chunk.breakdown = breakdown(prep, final, extra, now, self.worker_id, self.metrics)
                yield chunk
                if item.finished:
                    return
        finally:
            if self.inflight.get(key) == rid:
                del self.inflight[key]
            self._via_remote.discard(rid)
            if not state["first"]:
                self._prefill_done(eff, remote is not None)
            else:
                self.num_decoding -= 1
            if not state["finished"]:  # client went away or error: free its blocks
                # the client left (cancelled, or its generator closed): counted as an abort
                self.metrics.request_finished(state.get("end", "abort"))
                if remote is not None:
                    remote.abort(rid)
                else:
                    self.engine.abort(rid)
                self.engine.detach(rid)

    async def generate_many(self, inputs: list[GenerateInput], n: int = 1) -> AsyncIterator[tuple[int, Chunk]]:
        """Several prompts, ``n`` samples each: ``(index, chunk)`` as chunks come, where
        index = prompt index * n + sample index (OpenAI's choice index).

        Every sequence is validated and admitted before the first chunk is yielded, so a
        refusal of any of them (RequestError) ends all of them before the client is
        answered. Sample 0 of each prompt starts first; its siblings start once it has its
        first token, when the prompt's full blocks are in the prefix cache: they share those
        blocks instead of computing them again (and may route locally on that hit). With
        several sequences, sequence i runs as request ``<request_id>-<i>``; with a seed,
        sample j uses seed + j (vLLM's parallel sampling).
        """
        cap = self.limits.max_sequences_per_request
        if len(inputs) * n > cap:
            raise RequestError("invalid_argument", f"n: {len(inputs)} prompt(s) x n={n} = {len(inputs) * n} "
                               f"sequences, over this worker's limit of {cap} "
                               "(limits.max_sequences_per_request); send fewer prompts or a smaller n", "n")
        if len(inputs) == 1 and n == 1:
            async for chunk in self.generate(inputs[0]):
                yield 0, chunk
            return
        with self._key_share(inputs[0].caller, len(inputs) * n):
            async for item in self._generate_many(inputs, n):
                yield item

    async def _generate_many(self, inputs: list[GenerateInput], n: int) -> AsyncIterator[tuple[int, Chunk]]:
        base = inputs[0].request_id or uuid.uuid4().hex
        seqs: dict[int, AsyncIterator[Chunk]] = {}
        firsts: dict[int, Chunk] = {}
        pending: dict[asyncio.Future, int] = {}
        try:
            for wave in (range(1), range(1, n)):
                started = [p * n + j for p in range(len(inputs)) for j in wave]
                for i in started:
                    seqs[i] = self._generate(sample_input(inputs[i // n], i % n, f"{base}-{i}"))
                got = await asyncio.gather(*(seqs[i].__anext__() for i in started), return_exceptions=True)
                for item in got:
                    if isinstance(item, BaseException):
                        raise item
                firsts.update(zip(started, got))
            for i in sorted(firsts):
                yield i, firsts[i]
                if firsts[i].finish_reason is None:
                    pending[asyncio.ensure_future(seqs[i].__anext__())] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=pending.__getitem__):
                    i = pending.pop(fut)
                    try:
                        chunk = fut.result()
                    except StopAsyncIteration:
                        continue
                    yield i, chunk
                    if chunk.finish_reason is None:
                        pending[asyncio.ensure_future(seqs[i].__anext__())] = i
        finally:  # a refusal, an error or the client gone: end every sequence (frees its blocks)
            for fut in pending:
                fut.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for gen in seqs.values():
                await gen.aclose()

    async def detokenize(self, token_ids: list[int]) -> str:
        """Text of token ids (special tokens skipped), in the tokenizer pool."""
        tok = self.engine.engine.tokenizer
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, tok.decode, token_ids)

    def abort(self, request_id: str, caller=None) -> bool:
        """Abort an in-flight request by the id its client gave (Abort RPC); False if unknown.
        With API keys, ids are scoped to the key that sent them: another key's request is as
        unknown, so request ids of other clients cannot be probed this way; an operator key
        aborts every in-flight request of that id."""
        if caller is not None and caller.operator:
            rids = [rid for (_, label), rid in self.inflight.items() if label == request_id]
        else:
            rids = [rid] if (rid := self.inflight.get((_identity(caller), request_id))) else []
        for rid in rids:
            if rid in self._via_remote and self.remote is not None:
                self.remote.abort(rid)
            else:
                self.engine.abort(rid)
        return bool(rids)

    async def _local(self, prep: Prepared):
        peers = getattr(self.remote, "peers", None)
        if prep.borrow is not None and peers is not None:  # the prefix is read from its holder first
            q = await peers.submit(prep, *prep.borrow)
        else:
            q = self.engine.submit(prep.request_id, prep.prompt_ids, prep.params, prep.priority, prep.tenant,
                                   prep.inp.resume_ids)
        while True:
            item, final = await q.get()
            yield item, final, {}
            if isinstance(item, BaseException) or item.finished:
                return

    def _prefill_done(self, eff: int, was_remote: bool) -> None:
        """The request's prefill is over (first token, or it ended before one)."""
        if was_remote:
            self.pending_remote_tokens -= eff
            self.pending_remote_requests -= 1
        else:
            self.pending_prefill_tokens -= eff
        self.num_prefilling -= 1

def _identity(caller) -> str | None:
    """Whose request-id namespace a request lives in: its API key's identity (None: keys off)."""
    return None if caller is None else caller.identity
