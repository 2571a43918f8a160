"""The request path every decode-worker API shares (gRPC and HTTP).

validate -> admit (QoS) -> prefix-cache lookup -> decide (router) -> run
(local, or the remote path once one is attached) -> stream chunks -> final
breakdown. Errors are `RequestError` values with a status code the API
layer maps to gRPC / HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from pdserve.api.ingress import Chunk, GenerateInput, RequestError, ServingLimits
from pdserve.api.surface import Surface, identity, tenant_of
from pdserve.api.validate import check_privileges
from pdserve.engine import LoRARequest, SamplingParams, parse_structured_outputs
from pdserve.engine.lora_request import lora_salt
from pdserve.router import ArrivalRate, ClusterSnapshot, admit, tenant_token_limit
from pdserve.router.assess import cluster_snapshot, priced_tier, request_features

from .async_engine import AsyncEngine, EngineDeadError
from .core_client import EngineCoreClient
from .breakdown import breakdown, check_prediction
from .ingress import Prepared, RemotePath, as_request_error
from .metrics import WorkerMetrics
from .policy_state import PolicyState
from .prefill_pool import PrefillView
from .tracing import RequestTrace

__all__ = ["Frontend", "Chunk", "GenerateInput", "Prepared", "RemotePath", "RequestError", "ServingLimits"]

log = logging.getLogger(__name__)
_NO_PREFILL = PrefillView()  # what a worker without a remote path reports (never written)


@dataclass(eq=False)
class Flight:
    """One admitted request on its way through this worker's frontend (what every API's
    request is here, local or remote; a remote one's handoff state is its `RemoteRequest`,
    decode/remote.py, which the remote path owns)."""

    prep: Prepared
    key: tuple[str | None, str]  # (caller identity, label): the client's name for it
    tokens: int  # prompt tokens it computes (uncached; a resumed stream's tokens too)
    remote: bool  # the remote path runs it (its owner there answers for its handoff)
    first: bool = False  # its first token is out
    finished: bool = False  # its last chunk is out
    end: str = "abort"  # how it ended when not finished (the metric's label)
    handed_back: bool = False  # ended by `hand_back`: its stream ends UNAVAILABLE
    emitted: int = 0  # tokens streamed
    last_t: float | None = None  # when its last token was streamed (monotonic)


class Frontend(Surface):
    """Shared request handling of one decode worker (the `Surface` its APIs serve)."""

    def __init__(self, engine: AsyncEngine | EngineCoreClient, policy: PolicyState, metrics: WorkerMetrics,
                 worker_id: str, served_model: str, limits: ServingLimits | None = None,
                 remote: RemotePath | None = None, plan_local_prefill: bool = False):
        super().__init__(engine.prompts, limits, metrics, worker_id, served_model)
        self.engine = engine
        self.policy = policy
        self.remote = remote
        # The router predicts a local prefill as the chunks the engine's step plan would cut it
        # into (`prefill_budget_tokens`); off: no cap is predicted.
        self.plan_local_prefill = plan_local_prefill
        # Identity: what a client names (request_id) is a label scoped to its API key; the
        # engine, the handoff and result delivery key on an id minted here per admission, so
        # a label reused while its old sequence is still being torn down (or by another
        # tenant) can never be attached to that sequence's output.
        self.inflight: dict[tuple[str | None, str], str] = {}  # (key identity, label) -> engine id
        self.flights: dict[str, Flight] = {}  # engine id -> its Flight (every admitted request)
        self._labels_admitting: set[tuple[str | None, str]] = set()  # labels of requests in admission
        self._id_prefix = uuid.uuid4().hex[:8]  # per worker process: ids never repeat across restarts
        self._admissions = itertools.count(1)
        self._local_prefills: dict[str, int] = {}  # admitted locally, first token not yet out: id -> uncached tokens
        self.num_prefilling = 0
        self.num_decoding = 0
        self.arrivals = ArrivalRate()  # requests/s reaching this worker: the cost model's blocking penalty
        self._refusal_log: dict[str, tuple[float, int]] = {}  # reason -> (last line's time, refusals since)
        # Prompts held for KV room (qos.kv_full_wait_ms), in arrival order: only the first re-checks.
        self._kv_waiters: collections.deque[object] = collections.deque()

    def dtype(self) -> str:
        return self.engine.connector.layout_info()["dtype"]

    def health(self) -> str | None:
        if not self.engine.alive:
            return f"engine is not running: {self.engine.error!r}"
        return super().health()

    def prefill_budget_tokens(self, tokens: int = 0, cached: int = 0, backlog: int = 0) -> int | None:
        """The prompt tokens per step the engine's step plan would give a local prefill of
        (tokens, cached) arriving now (engine/step_plan.py); None: no cap. Behind
        ``backlog`` prompt tokens the local prefills still have to compute (`local_backlog`),
        beside the streams decoding now and those admitted ahead of it that will be by then
        (local prompts queued before it, remote ones whose KV arrives meanwhile): a burst of
        short prompts beside a long one decodes through most of its prefill, and their TPOT
        caps its chunks."""
        if not self.plan_local_prefill:
            return None
        return self.engine.predicted_prefill_budget(tokens, cached, self.num_decoding + self.num_prefilling, backlog)

    @property
    def pending_remote_requests(self) -> int:
        """Sent remote by this worker, first token not yet back (queue stats are polled, so a
        burst would otherwise see an empty queue for every request)."""
        return self.remote.pending_requests if self.remote is not None else 0

    @property
    def pending_remote_tokens(self) -> int:
        return self.remote.pending_tokens if self.remote is not None else 0

    @property
    def peers(self):
        """The remote path's prefix loans (decode/borrow.py), None without them."""
        return self.remote.peers if self.remote is not None else None

    @property
    def prefill_view(self) -> PrefillView:
        """The prefill side as the remote path sees it (all zero without one)."""
        return self.remote.view if self.remote is not None else _NO_PREFILL

    def snapshot(self, tokens: int = 0, cached: int = 0) -> ClusterSnapshot:
        """The cluster as this worker sees it, for a prompt of ``tokens`` uncached tokens after
        ``cached`` ones (the local prefill budget the engine would plan for it)."""
        view = self.prefill_view
        load = self.engine.load()
        backlog = self.local_backlog()
        costs = self.policy.costs.snapshot()
        spec_k, spec_per_step = self.engine.spec_outlook(self.num_decoding)
        return cluster_snapshot(  # router/assess.py: the simulator builds its snapshot there too
            costs, queue_depth=view.queue_depth, queue_tokens=view.queue_tokens,
            pool_size=view.pool_size if self.remote and self.remote.available() else 0,
            lora_pool_size=view.lora_workers,  # (those that run LoRA adapters; capped at pool_size)
            pending_remote_requests=self.pending_remote_requests, pending_remote_tokens=self.pending_remote_tokens,
            num_decoding=self.num_decoding, num_prefilling=self.num_prefilling, local_backlog=backlog,
            kv_usage=load.kv_usage, kv_free_tokens=load.num_free_blocks * self.engine.block_size,
            arrival_rate_per_s=self.arrivals.rate(time.monotonic()),
            local_prefill_budget_tokens=self.prefill_budget_tokens(tokens, cached, backlog),
            step_in_flight_ms=costs.step_left_ms(self.engine.in_flight, time.perf_counter()),
            spec_k=spec_k, spec_tokens_per_step=spec_per_step,
        )

    def local_backlog(self) -> int:
        """Prompt tokens the local prefills admitted here still have to compute: a started
        prefill counts what it has left (the engine's progress), not its whole prompt."""
        if not self._local_prefills:
            return 0
        lefts = self.engine.prompts_left(list(self._local_prefills))  # (one read of the engine for all)
        total = 0
        for rid, eff in self._local_prefills.items():
            left = lefts.get(rid)
            total += eff if left is None else min(eff, left)
        return total

    def refresh_gauges(self) -> None:
        m, load, view = self.metrics, self.engine.load(), self.prefill_view
        m.running.set(load.running)
        m.waiting.set(load.waiting)
        m.waiting_remote.set(load.awaiting_remote_kv)
        m.kv_usage.set(load.kv_usage)
        m.prefill_queue_depth.set(view.queue_depth)
        m.prefill_queue_tokens.set(view.queue_tokens)
        m.prefill_pool_size.set(view.pool_size)

    def cached_len(self, ids: list[int], salt: bytes | None = None) -> int:
        """Prompt tokens this worker's prefix cache holds now (read-only lookup; ``salt``: the
        request's prefix-cache salt, an adapter's, engine/lora_request.py)."""
        return self.engine.connector.cached_prefix_len(ids, salt)

    def tenant_token_limit(self):
        """The policy's qos.max_tokens_per_tenant, else (null) this worker's KV pool (Surface)."""
        pool = self.engine.load().num_blocks * self.engine.block_size
        return tenant_token_limit(self.policy.policy.qos, pool)

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
        ids, params, prio = await self.validated(inp)
        self.check_serving()  # it may have changed while the prompt was tokenized
        label = inp.request_id or uuid.uuid4().hex
        key = (identity(inp.caller), label)
        if key in self.inflight or key in self._labels_admitting:
            raise RequestError("already_exists", f"request_id: {label!r} is still in flight on this worker; "
                               "wait for it to end (or abort it) before reusing the id", "request_id")
        # Taken from here on: admission may wait for KV room (an await), and a second request
        # with this label arriving meanwhile must be refused, not admitted beside it. _generate
        # moves the label into `inflight`; any refusal below gives it back.
        self._labels_admitting.add(key)
        try:
            return await self._admit(inp, arrival, ids, params, prio, label)
        except EngineDeadError as exc:  # (an engine core that died while admission read it)
            self._labels_admitting.discard(key)
            raise RequestError("unavailable", f"the engine stopped: {exc}; retry on another decode worker") from None
        except BaseException:
            self._labels_admitting.discard(key)
            raise

    async def _admit(self, inp: GenerateInput, arrival: float, ids, params, prio, label: str) -> Prepared:
        """Admission and routing of a validated request whose label `prepare` reserved."""
        policy = self.policy.policy
        resume = inp.resume_ids or []
        # A resumed request (a migrated stream) computes its prompt and resumed tokens here:
        # the remote path prefills prompts, and its first token would not follow the resumed ones.
        computed = ids + resume
        self.arrivals.observe(arrival)
        connector = self.engine.connector
        spec = parse_structured_outputs(params.structured_outputs)
        grammar_ms = self.engine.prompts.grammars.fresh_compile_ms(spec) if spec is not None else 0.0
        want_prompt_lps = params.prompt_logprobs is not None and not resume  # (a resumed stream sent them)
        lora = self._adapter_of(inp)
        salt = lora_salt(None, lora)  # an adapter's blocks are its own in the prefix cache

        def assess():
            """Admission as the worker stands now: its pool's and the prefill workers' cached
            prefixes (their KV events; decode/remote.py prefix_view), its load, the policy."""
            # prompt logprobs: every prompt position runs here (the router keeps it local)
            cached = self.cached_len(computed, salt) if not want_prompt_lps else 0
            # (a prefill worker's cached prefixes are the base model's: none for an adapter's prompt)
            view = self.remote.prefix_view if self.remote is not None and not resume and lora is None else None
            hint = view.cached_tokens(ids) if view is not None else {}
            # a prefill worker that runs adapters holds this one (their records, decode/prefill_pool.py)
            held_remote = lora is not None and lora.lora_name in self.prefill_view.lora_adapters
            # router/assess.py builds the features and prices the tier (the simulator's worker too)
            feats = request_features(len(computed), cached, priority=prio, ttft_slo_ms=inp.ttft_slo_ms,
                                     route=inp.route, max_tokens=params.max_tokens, resumed=bool(resume), hint=hint,
                                     tier_cached_len=0 if want_prompt_lps else connector.tier_prefix_len(
                                         computed, cached, salt),
                                     peer_reads=self.peers is not None, grammar_compile_ms=grammar_ms,
                                     prompt_logprobs=want_prompt_lps, lora_adapter=lora is not None,
                                     lora_held_remote=held_remote)
            snap = priced_tier(self.snapshot(max(0, len(computed) - cached), cached), feats,
                               connector.tier_load_ms_per_token())
            return cached, hint, feats, snap, admit(feats, snap, policy)

        cached, hint, feats, snap, adm = assess()
        wait_ms = policy.qos.kv_full_wait_ms
        if inp.kv_full_wait_ms is not None:  # the caller's own (a gateway with another worker to ask: 0)
            wait_ms = min(wait_ms, inp.kv_full_wait_ms)
        if not adm.ok and adm.reason == "kv_pool_full" and wait_ms > 0:
            cached, hint, feats, snap, adm = await self._hold_for_room(
                arrival, wait_ms, assess, (cached, hint, feats, snap, adm))
        if lora is not None and self._adapter_of(inp) is not lora:  # unloaded while it waited for room
            raise RequestError("not_found", f"model: the LoRA adapter {lora.lora_name!r} was unloaded", "model")
        if not adm.ok:
            self.metrics.refused(adm.reason)
            self._log_refusal(adm.reason, adm.detail, len(computed), cached)
            raise RequestError("resource_exhausted", adm.detail, None, adm.predicted_ttft_ms, adm.retry_after_ms)
        if adm.degraded and adm.max_tokens is not None and adm.max_tokens < params.max_tokens:
            params = SamplingParams(**{**params.to_dict(), "max_tokens": adm.max_tokens})
        decision = adm.decision
        self.metrics.decision(decision.route, decision.reason)
        self.metrics.prompt_tokens.inc(len(ids))
        if lora is not None:
            self.metrics.lora_admitted(lora.lora_name, len(ids))
        rid = f"{self._id_prefix}-{next(self._admissions):x}"
        residual = (snap.costs.ttft_residual_remote_ms if decision.route == "remote"
                    else snap.costs.ttft_residual_local_ms) if len(computed) > cached else 0.0
        borrow = None
        peers = self.peers
        if decision.route == "local" and peers is not None and not resume and not want_prompt_lps and lora is None:
            borrow = peers.choose(hint, cached, len(ids), snap.costs, feats.tier_cached_len)
        return Prepared(rid, inp, ids, params, prio, cached, decision, arrival, label=label, prefix_hint=hint,
                        tenant=tenant_of(inp.caller), residual_ms=residual, borrow=borrow,
                        local_backlog=snap.local_prefill_queue_tokens, lora=lora)

    def _adapter_of(self, inp: GenerateInput) -> LoRARequest | None:
        """The LoRA adapter the request's model names (None: the base model); validation
        refused an unknown name, and one unloaded since is refused here (404, param model)."""
        if not inp.model or inp.model == self.served_model:
            return None
        lora = self.adapters.get(inp.model) if self.adapters is not None else None
        if lora is None:
            raise RequestError("not_found", f"model: the model {inp.model!r} does not exist here (a LoRA adapter "
                               "unloaded meanwhile?)", "model")
        return lora

    async def _hold_for_room(self, arrival: float, wait_ms: float, assess, refused):
        """A prompt the KV pool cannot hold beside the running streams (``kv_pool_full``) waits
        for them to free room instead of being refused at once: prompts held this way queue in
        arrival order, and the first of them is assessed again after every decode step's worth
        of time until it is admitted, or until ``wait_ms`` after its arrival, when the refusal
        stands (its message says how long it waited). Returns ``assess()``'s last answer."""
        token = object()
        self._kv_waiters.append(token)
        deadline = arrival + wait_ms / 1e3
        last = refused
        try:
            while (left := deadline - time.monotonic()) > 0:
                step_ms = last[3].costs.decode_step_ms
                await asyncio.sleep(min(left, max(0.005, step_ms / 1e3)))
                self.check_serving()
                if self._kv_waiters[0] is not token:
                    continue
                last = assess()
                if last[4].ok or last[4].reason != "kv_pool_full":
                    held_ms = (time.monotonic() - arrival) * 1e3
                    self.metrics.held_for_kv.observe(held_ms / 1e3)
                    log.debug("held %.0f ms for KV room, then %s", held_ms, last[4].reason)
                    return last
        finally:
            self._kv_waiters.remove(token)
        adm = last[4]
        waited = (time.monotonic() - arrival) * 1e3
        detail = f"{adm.detail}; waited {waited:.0f} ms for the running streams to free room (qos.kv_full_wait_ms " \
                 f"{wait_ms:g})"
        return (*last[:4], adm._replace(detail=detail))

    def _log_refusal(self, reason: str, detail: str, tokens: int, cached: int) -> None:
        """One log line per refusal reason per second at most (a refusal storm is counted, not
        printed line by line; pdserve_admissions_refused_total has every one)."""
        now = time.monotonic()
        last, quiet = self._refusal_log.get(reason, (-1e9, 0))
        if now - last < 1.0:
            self._refusal_log[reason] = (last, quiet + 1)
            return
        more = f" (+{quiet} more refused for {reason} since the last line)" if quiet else ""
        log.warning("refused (%s): prompt %d tokens, %d cached: %s%s", reason, tokens, cached, detail, more)
        self._refusal_log[reason] = (now, 0)

    def engine_id(self, label: str, caller=None) -> str | None:
        """The engine's id of the in-flight request a client calls `label` (None: none)."""
        return self.inflight.get((identity(caller), label))

    # -- running -----------------------------------------------------------------------
    async def _generate(self, inp: GenerateInput) -> AsyncIterator[Chunk]:
        trace = RequestTrace(self.worker_id, inp)  # its spans (decode/tracing.py); nothing when not tracing
        try:
            prep = await self.prepare(inp)
        except BaseException as exc:
            trace.end(exc)
            raise
        prep.traceparent = trace.admitted(prep)
        fl = self._begin(prep)
        extra: dict = {}
        remote = self.remote if fl.remote else None
        if inp.resume_ids:
            extra.update(reason=f"resumed: a migrated stream continues after {len(inp.resume_ids)} token(s), "
                         "prefilled locally")
        if prep.decision.route == "remote" and remote is None:  # e.g. forced remote, no live prefill worker
            extra.update(route="local", reason="remote chosen but no live prefill worker: prefilled locally")
        try:
            source = remote.stream(prep) if remote is not None else self._local(prep)
            async for item, final, info in source:
                extra.update(info)
                chunk = self._chunk(fl, item, final, extra)
                if chunk.breakdown is not None:
                    trace.finished(prep, chunk.breakdown)
                yield chunk
                if fl.finished:
                    return
        finally:
            self._end(fl)
            trace.end(how=None if fl.finished else fl.end)

    def _begin(self, prep: Prepared) -> Flight:
        """An admitted request starts (its label moves from admission to in flight)."""
        inp = prep.inp
        remote = (prep.decision.route == "remote" and self.remote is not None and self.remote.available())
        fl = Flight(prep, (identity(inp.caller), prep.label),
                    len(prep.prompt_ids) + len(inp.resume_ids or ()) - prep.cached_len, remote)
        self._labels_admitting.discard(fl.key)  # prepare() reserved it; no await between
        self.inflight[fl.key] = prep.request_id
        self.flights[prep.request_id] = fl
        if prep.lora is not None and self.adapters is not None:  # (an adapter in use is not unloaded)
            self.adapters.begin(prep.lora.lora_name)
        self.num_prefilling += 1
        if not remote:  # a remote one is pending remote work of its owner (decode/remote.py)
            self._local_prefills[prep.request_id] = fl.tokens
        return fl

    def _chunk(self, fl: Flight, item, final, extra: dict) -> Chunk:
        """One engine item as the client's chunk (the last one with its breakdown); a failed or
        handed-back request raises its RequestError."""
        prep = fl.prep
        if not isinstance(item, BaseException) and item.finish_reason == "abort" and fl.handed_back:
            fl.end = "handed_back"
            raise RequestError("unavailable", f"this decode worker is draining and handed the stream back "
                               f"after {len(prep.inp.resume_ids or ()) + fl.emitted} token(s); continue it "
                               "on another decode worker (resume_token_ids; a gateway does this itself)")
        if isinstance(item, BaseException) or item.finish_reason == "error":
            fl.end = "error"
            raise as_request_error(item)
        now = time.monotonic()
        if item.new_token_ids and not fl.first:
            fl.first = True
            self._prefill_done(fl)
            self.num_decoding += 1
            self.metrics.ttft.observe(now - prep.arrival)
            check_prediction(prep, fl.remote, extra, (now - prep.arrival) * 1e3, self.metrics, self.policy)
        elif item.new_token_ids and fl.last_t is not None:
            self.metrics.itl.observe(now - fl.last_t)
        if item.new_token_ids:
            fl.last_t = now
            fl.emitted += len(item.new_token_ids)
            if prep.lora is not None:
                self.metrics.lora_generated(prep.lora.lora_name, len(item.new_token_ids))
        chunk = Chunk(item.new_token_ids, item.text, item.finish_reason, item.logprobs,
                      prompt_logprobs=item.prompt_logprobs)
        if item.finished:
            fl.finished = True
            self.metrics.request_finished(item.finish_reason)
            chunk.breakdown = breakdown(prep, final, extra, now, self.worker_id, self.metrics)
        return chunk

    def _end(self, fl: Flight) -> None:
        """The request's stream is over, however it ended."""
        rid = fl.prep.request_id
        if self.inflight.get(fl.key) == rid:
            del self.inflight[fl.key]
        self.flights.pop(rid, None)
        if fl.prep.lora is not None and self.adapters is not None:
            self.adapters.end(fl.prep.lora.lora_name)
        if not fl.first:
            self._prefill_done(fl)
        else:
            self.num_decoding -= 1
        if not fl.finished:  # client went away or error: free its blocks
            # the client left (cancelled, or its generator closed): counted as an abort
            self.metrics.request_finished(fl.end)
            self._abort_one(rid, fl.remote)
            self.engine.detach(rid)

    def _abort_one(self, rid: str, remote: bool) -> None:
        if remote and self.remote is not None:
            self.remote.abort(rid)
        else:
            self.engine.abort(rid)

    def hand_back(self) -> int:
        """End every in-flight stream with UNAVAILABLE so that its client (a gateway) continues it
        on another decode worker from the tokens it has (`resume_token_ids`): what a drain does
        when its deadline comes with streams still running. Returns how many it ended."""
        flights = [self.flights[rid] for rid in self.inflight.values() if rid in self.flights]
        for fl in flights:
            fl.handed_back = True
            self._abort_one(fl.prep.request_id, fl.remote)
        return len(flights)

    def abort(self, request_id: str, caller=None) -> bool:
        """Abort an in-flight request by the id its client gave (Abort RPC); False if unknown.
        With API keys, ids are scoped to the key that sent them: another key's request is as
        unknown, so request ids of other clients cannot be probed this way; an operator key
        aborts every in-flight request of that id."""
        if caller is not None and caller.operator:
            rids = [rid for (_, label), rid in self.inflight.items() if label == request_id]
        else:
            rids = [rid] if (rid := self.inflight.get((identity(caller), request_id))) else []
        for rid in rids:
            fl = self.flights.get(rid)
            self._abort_one(rid, fl is not None and fl.remote)
        return bool(rids)

    async def _local(self, prep: Prepared):
        peers = self.peers
        if prep.borrow is not None and peers is not None:  # the prefix is read from its holder first
            q = await peers.submit(prep, *prep.borrow)
        else:
            q = self.engine.submit(prep.request_id, prep.prompt_ids, prep.params, prep.priority, prep.tenant,
                                   prep.inp.resume_ids, lora_request=prep.lora)
        while True:
            item, final = await q.get()
            yield item, final, {}
            if isinstance(item, BaseException) or item.finished:
                return

    def _prefill_done(self, fl: Flight) -> None:
        """The request's prefill is over (first token, or it ended before one)."""
        if not fl.remote:
            self._local_prefills.pop(fl.prep.request_id, None)
        self.num_prefilling -= 1
