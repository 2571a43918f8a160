"""A gateway's request path (the `Surface` its gRPC and HTTP APIs serve, api/surface.py):
validate against the model, pick a decode worker (gateway/pick.py), stream from it, and when
that stream breaks, continue it on another worker from the tokens already streamed.

Continuation (`resume_token_ids`, docs/api.md): the next worker gets the prompt and the tokens
the client has; it takes them as output already generated (penalties, max_tokens and a seed's
draws count them; stop strings see them), so the client's stream is the one an undisturbed
run would have produced, for greedy and for seeded sampling alike. A worker that refuses a
request before its first token (QoS: RESOURCE_EXHAUSTED; draining: UNAVAILABLE) is not a
failure of the request: the next-best worker is asked, so one loaded worker causes no refusal
while another has room.

Whose failure (docs/gateway.md "Errors"): a worker that died, dropped its stream or is draining
(UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED, a stream without its last message) is avoided for a
while and the stream goes on elsewhere. A failure the worker marks as the request's own
(ERROR_SCOPE_HEADER, api/ingress.py) is returned to the client at once and the worker stays
in rotation: the same request would fail on every worker, and avoiding each in turn would take
them all out of rotation for one bad request. An INTERNAL / UNKNOWN without the mark (an older
worker, a bug, a transport error gRPC reports as INTERNAL) is tried on one more worker, and no
worker is avoided for it.

A request whose ``model`` names a LoRA adapter runs, migrates and races only on workers that
serve it (gateway/lora.py; docs/lora.md, "Through the gateway").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve.api.grpc_service import STATUS, chunk_from_proto
from pdserve.api.adapters import AdapterCard
from pdserve.api.ingress import (ERROR_SCOPE_HEADER, KV_WAIT_HEADER, REQUEST_SCOPE, Chunk, GenerateInput,
                                 RequestError, ServingLimits)
from pdserve.api.security import TENANT_HEADER
from pdserve.api.surface import Checked, Surface, identity, tenant_of
from pdserve.api.v1 import inference_pb2 as pb
from pdserve.common import tracing
from pdserve.api.validate import check_privileges
from pdserve.engine.prompts import PromptChecker

from .backends import Backends
from .forward import metadata_float, metadata_int, worker_request
from .lora import adapter_cards, adapter_of, base_input, unknown_model
from .metrics import GatewayMetrics
from .pick import RaceBudget, race_partner
from .tracing import attempt_span, migrated, raced, request_ended, request_span

log = logging.getLogger(__name__)

CODE_OF = {v: k for k, v in STATUS.items()}
# A stream that ends with one of these (or without a final message) broke with its worker:
# the worker died, its connection dropped, or it is draining and handed the stream back. It
# goes on elsewhere, and the worker is avoided for a while (backends.AVOID_AFTER_FAILURE_S).
BROKEN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
# These may be the request's failure or the worker's. Marked as the request's own
# (ERROR_SCOPE_HEADER): returned to the client. Unmarked: tried on ONE more worker
# (MAX_UNMARKED_FAILURES), and no worker avoided: a request that makes every engine fail must
# neither take the workers out of rotation one by one nor be sent to each of them.
UNMARKED = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
MAX_UNMARKED_FAILURES = 2


@dataclass
class Stream:
    """One client sequence while it runs: where it is now and what the client has."""

    label: str
    worker_id: str | None = None
    worker_rid: str | None = None
    tokens: list[int] = field(default_factory=list)
    migrations: int = 0
    aborted: bool = False
    call: object = None
    span: tracing.AnySpan = tracing.NO_SPAN  # its gateway.request span (common/tracing.py): each attempt's parent
    attempt: tracing.AnySpan = tracing.NO_SPAN  # the current attempt's gateway.attempt span


class _Broken(Exception):
    """The current worker's stream ended before its last message. ``scope``: "worker" (it
    died, dropped the stream or drains: avoid it), "unmarked" (an INTERNAL / UNKNOWN it did
    not mark as the request's own: keep it, try one more worker) or "refused" (QoS, before
    any token). ``unmarked``: how many unmarked failures this stands for (a race: both)."""

    def __init__(self, worker_id: str, why: str, before_first: bool, code: str = "unavailable",
                 predicted_ttft_ms: float | None = None, retry_after_ms: int | None = None, scope: str = "worker"):
        super().__init__(why)
        self.worker_id, self.before_first, self.code, self.scope = worker_id, before_first, code, scope
        self.predicted_ttft_ms, self.retry_after_ms = predicted_ttft_ms, retry_after_ms
        self.unmarked = int(scope == "unmarked")


class GatewayFrontend(Surface):
    def __init__(self, backends: Backends, checker: PromptChecker, metrics: GatewayMetrics, gateway_id: str,
                 served_model: str, dtype: str, limits: ServingLimits | None = None, max_migrations: int = 3,
                 race_fraction: float = 0.0, race_risk: float = 0.5, forward_tenant: bool = True):
        super().__init__(checker, limits, metrics, gateway_id, served_model)
        self.backends = backends
        self.forward_tenant = forward_tenant  # the client's tenant goes to the worker (GatewayConfig)
        self._dtype = dtype
        self.max_migrations = max_migrations
        # Racing (opt-in: race_fraction > 0, and a request's ttft_slo_ms): see `_race_partner`.
        self.race_budget = RaceBudget(race_fraction)
        self.race_risk = race_risk
        self.streams: dict[tuple[str | None, str], Stream] = {}
        self._ids = itertools.count(1)
        self._id_prefix = f"gw{uuid.uuid4().hex[:6]}"

    @property
    def race_fraction(self) -> float:
        return self.race_budget.fraction

    @race_fraction.setter
    def race_fraction(self, value: float) -> None:
        self.race_budget.fraction = value

    def dtype(self) -> str:
        return self._dtype

    def health(self) -> str | None:
        if not self.backends.workers:
            return "no decode worker is registered in etcd"
        return super().health()

    def adapter_cards(self) -> list[AdapterCard]:
        return adapter_cards(self.backends, self.served_model)  # those the workers' records list

    def validate(self, inp: GenerateInput) -> Checked:
        """The base's validation, ``model`` naming the base or an adapter a worker serves."""
        return super().validate(base_input(inp, self.backends, self.served_model))

    def refresh_gauges(self) -> None:
        self.metrics.workers.set(len(self.backends.workers))
        self.metrics.streams.set(len(self.streams))

    def abort(self, request_id: str, caller=None) -> bool:
        if caller is not None and caller.operator:
            found = [s for (_, label), s in self.streams.items() if label == request_id]
        else:
            found = [s] if (s := self.streams.get((identity(caller), request_id))) else []
        for s in found:
            s.aborted = True
            if s.worker_id is not None and s.worker_rid is not None:
                asyncio.get_running_loop().create_task(self._abort_on(s.worker_id, s.worker_rid))
        return bool(found)

    async def _abort_on(self, worker_id: str, rid: str) -> None:
        try:
            stub, md = self.backends.stub(worker_id)
            await stub.Abort(pb.AbortRequest(request_id=rid), metadata=md, timeout=10)
        except (grpc.aio.AioRpcError, KeyError) as exc:
            log.info("gateway: abort of %s on %s: %s", rid, worker_id, exc)

    async def _generate(self, inp: GenerateInput) -> AsyncIterator[Chunk]:
        if self.draining:
            raise RequestError("unavailable", "gateway is draining; retry on another gateway replica")
        check_privileges(inp)
        ids, params, prio = await self.validated(inp)
        adapter = adapter_of(inp, self.served_model)
        label = inp.request_id or uuid.uuid4().hex
        key = (identity(inp.caller), label)
        if key in self.streams:
            raise RequestError("already_exists", f"request_id: {label!r} is still in flight on this gateway; "
                               "wait for it to end (or abort it) before reusing the id", "request_id")
        s = self.streams[key] = Stream(label, span=request_span(inp, label, self.worker_id, len(ids)))
        arrival = time.monotonic()
        self.race_budget.start(arrival)
        tried: set[str] = set()
        refusal: _Broken | None = None
        unmarked = 0  # unmarked INTERNAL / UNKNOWN failures so far (MAX_UNMARKED_FAILURES)
        try:
            while True:
                pick = self.backends.pick(ids + s.tokens, tried, adapter)
                if pick.chosen is None:
                    raise self._no_worker(pick, s, refusal, adapter)
                partner = None
                if not tried:
                    self.metrics.routed(pick.chosen)
                    partner = self._race_partner(pick, inp)
                # Another worker could take it: the chosen one refuses at once when its KV pool is
                # full (no hold, qos.kv_full_wait_ms), so that the next one is asked without delay.
                others = len(pick.scores) > 1
                run = (self._race(s, pick.chosen, partner, tried, ids, params, prio, inp, arrival) if partner
                       else self._attempt(s, pick.chosen, ids, params, prio, inp, arrival, no_hold=others))
                try:
                    # aclosing: a client that leaves closes this generator at its yield; the
                    # attempt is closed with it, at once (its call cancelled, its blocks freed)
                    async with contextlib.aclosing(run) as attempt:
                        async for chunk in attempt:
                            yield chunk
                    return
                except _Broken as b:
                    tried.add(b.worker_id)
                    if b.unmarked:
                        unmarked += b.unmarked
                        self._unmarked(s, b, unmarked)  # raises once it failed on a second worker
                    if b.before_first and not s.tokens:
                        refusal = b  # refused or failed before any token: another worker is asked
                        self.metrics.retry(b.code)
                        if b.scope == "worker":
                            self.metrics.request_error("worker", "retried")
                            self.backends.failed(b.worker_id)
                        continue
                    if b.scope == "worker":
                        self.backends.failed(b.worker_id)
                    if s.aborted:
                        raise RequestError("unavailable", f"aborted while its worker failed: {b}") from None
                    s.migrations += 1
                    if s.migrations > self.max_migrations:
                        self.metrics.migration("failed")
                        if b.scope == "worker":
                            self.metrics.request_error("worker", "returned")
                        raise RequestError("unavailable", f"the stream broke {s.migrations} times (last: {b}); "
                                           f"gateway.max_migrations is {self.max_migrations}") from None
                    self.metrics.migration("moved")
                    migrated(s.span, b, len(s.tokens))
                    if b.scope == "worker":
                        self.metrics.request_error("worker", "retried")
                    log.warning("gateway: %s broke on %s after %d token(s) (%s); continuing elsewhere",
                                label, b.worker_id, len(s.tokens), b)
        finally:
            request_ended(s.span, sys.exc_info()[1], s.migrations, len(s.tokens))
            if self.streams.get(key) is s:
                del self.streams[key]

    def _no_worker(self, pick, s: Stream, refusal: _Broken | None, adapter: str | None) -> RequestError:
        """Why no worker takes the stream now: the last refusal before any token; an adapter no
        worker serves any more (404, it was unloaded since it was checked); or each one's reason."""
        if adapter is not None and not s.tokens and adapter not in self.backends.adapters():
            return unknown_model(self.backends, self.served_model, adapter)
        if refusal is not None and not s.tokens:
            return RequestError(refusal.code, str(refusal), None, refusal.predicted_ttft_ms, refusal.retry_after_ms)
        why = "; ".join(f"{w}: {r}" for w, r in pick.excluded.items()) or "none is registered"
        if s.tokens:
            self.metrics.migration("failed")
            return RequestError("unavailable", f"the stream broke after {len(s.tokens)} token(s) and no "
                                f"other decode worker can continue it ({why})")
        return RequestError("unavailable", f"no decode worker can take this request ({why})")

    def _unmarked(self, s: Stream, b: _Broken, failures: int) -> None:
        """An INTERNAL / UNKNOWN the worker did not mark as the request's own: the request may
        be at fault (it would fail everywhere) or the worker (a bug; a transport error). One
        more worker is asked; a second such failure ends the request with it. No worker is
        avoided either way: only its death, drain or a dropped stream says it is broken."""
        where = f"on {b.worker_id} after {len(s.tokens)} token(s)"
        if failures >= MAX_UNMARKED_FAILURES or s.aborted:
            self.metrics.request_error("unmarked", "returned")
            log.warning("gateway: %s failed %s (%s), scope unmarked, on %d workers now: returned to the client as "
                        "the request's own failure; the workers stay in rotation", s.label, where, b, failures)
            raise RequestError("internal", f"{b} (it failed like this on {failures} decode workers; not retried "
                               "again: change the request, or see the workers' logs)") from None
        self.metrics.request_error("unmarked", "retried")
        log.warning("gateway: %s failed %s (%s), scope unmarked (the worker did not say whether the request or the "
                    "worker is at fault: an older worker, or a bug): tried on one more worker; %s stays in rotation",
                    s.label, where, b, b.worker_id)

    # -- racing ---------------------------------------------------------------------------
    def _race_partner(self, pick, inp: GenerateInput) -> str | None:
        """A second worker to race this request on (gateway/pick.py `race_partner`), within the
        budget of ``race_fraction`` of the last minute's requests; None: no race."""
        if self.race_fraction <= 0:
            return None
        partner, why = race_partner(pick, inp.ttft_slo_ms, self.race_risk)
        if partner is None:
            if why == "refused_load":
                self.metrics.race(why)
            return None
        if not self.race_budget.take(time.monotonic()):
            self.metrics.race("refused_budget")
            return None
        return partner

    async def _race(self, s: Stream, first: str, second: str, tried: set[str], ids, params, prio,
                    inp: GenerateInput, arrival: float) -> AsyncGenerator[Chunk, None]:
        """The request on two workers at once: the first to stream a token wins, the other is
        cancelled (its call ends; its blocks are freed). Only the winner's tokens reach the
        client, so usage counts them once. Raises `_Broken` when both fail before a token."""
        runs = {w: (st, self._attempt(st, w, ids, params, prio, inp, arrival))
                for w, st in ((first, Stream(s.label, span=s.span)), (second, Stream(s.label, span=s.span)))}
        tasks = {asyncio.ensure_future(gen.__anext__()): w for w, (_, gen) in runs.items()}
        won: tuple[str, Chunk] | None = None  # the winner and its first chunk
        broken: _Broken | None = None
        decided, unmarked = False, 0
        try:
            while tasks and won is None:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    w = tasks.pop(t)
                    exc = t.exception()
                    if exc is None and won is None:
                        won = (w, t.result())
                    elif isinstance(exc, _Broken):
                        broken = exc
                        unmarked += exc.unmarked
                        tried.add(w)
                    elif exc is not None and not isinstance(exc, StopAsyncIteration):
                        raise exc
            decided = True
            if won is not None:  # (before the loser's attempt ends: each attempt says its part)
                raced(s.span, {w: st.attempt for w, (st, _) in runs.items()}, won[0])
        finally:
            for t in tasks:  # the loser: stop waiting, then end its call
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w, (_, gen) in runs.items():
                if won is None or w != won[0] or not decided:  # on an error or a client gone: both
                    await gen.aclose()
        if won is None:
            self.metrics.race("both_failed")
            broken = broken or _Broken(second, "neither raced worker answered", True)
            broken.unmarked = unmarked  # each raced worker's unmarked failure counts (MAX_UNMARKED_FAILURES)
            raise broken
        winner, head = won
        loser = second if winner == first else first
        self.metrics.race("won_first" if winner == first else "won_second")
        self.metrics.race_waste(len(ids))  # at most: the loser's prompt, if it was scheduled
        log.info("gateway: %s raced on %s and %s: %s first", s.label, first, loser, winner)
        st, gen = runs[winner]
        s.worker_id, s.worker_rid, s.call, s.tokens = st.worker_id, st.worker_rid, st.call, st.tokens
        async with contextlib.aclosing(gen):
            yield head
            if head.finish_reason:
                return
            async for chunk in gen:
                yield chunk

    async def _attempt(self, s: Stream, worker_id: str, ids, params, prio, inp: GenerateInput,
                       arrival: float, no_hold: bool = False) -> AsyncGenerator[Chunk, None]:
        """One worker's part of the stream; raises `_Broken` when it ends early. ``no_hold``: the
        worker refuses at once rather than hold the prompt for KV room (another worker can take it)."""
        w = self.backends.workers[worker_id]
        stub, md = self.backends.stub(worker_id)
        # The client's key identity, or with keys off here its address (addr:...): the worker's
        # fairness and shares then see this client, where it trusts this gateway to name it (an
        # operator worker key; keys off there, FORWARDED_ALLOW_IPS: api/security.py).
        tenant = tenant_of(inp.caller) if self.forward_tenant else None
        if tenant is not None:
            md = (*(md or ()), (TENANT_HEADER, tenant))
        if no_hold:
            md = (*(md or ()), (KV_WAIT_HEADER, "0"))
        rid = f"{self._id_prefix}-{next(self._ids):x}"
        s.worker_id, s.worker_rid = worker_id, rid
        span = s.attempt = attempt_span(s.span, worker_id, rid, len(s.tokens))
        md = (*(md or ()), *span.carrier().items())  # the worker's spans are this attempt's children
        adapter = adapter_of(inp, self.served_model)
        req = worker_request(ids, rid, params, prio.label, inp, s.tokens, adapter)
        hint = self.backends.cached(ids + s.tokens) if adapter is None else {}  # (Backends.pick)
        own = len(ids) + len(s.tokens) - hint.get(worker_id, 0)
        units = w.queued() + own
        w.streams += 1
        w.queued_tokens += own
        w.mean_prompt = 0.9 * w.mean_prompt + 0.1 * own
        sent, first, finished = time.monotonic(), False, False
        call = s.call = stub.Generate(req, metadata=md)
        try:
            async for msg in call:
                if msg.token_ids and not first:
                    first = True
                    w.queued_tokens -= own
                    w.observe_ttft((time.monotonic() - sent) * 1e3, units)
                    span.event("first_token")
                    if not s.tokens:
                        self.metrics.ttft.observe(time.monotonic() - arrival)
                        s.span.event("first_token")
                        s.span.set({"gen_ai.latency.time_to_first_token": time.monotonic() - arrival})
                s.tokens.extend(msg.token_ids)
                chunk = chunk_from_proto(msg)
                if msg.finish_reason:
                    finished = True
                    self.metrics.request_finished(msg.finish_reason)
                    chunk.breakdown = {**(chunk.breakdown or {}), "migrations": s.migrations}
                yield chunk
                if msg.finish_reason:
                    return
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            md_trail = dict(exc.trailing_metadata() or ())
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not first:
                raise _Broken(worker_id, exc.details(), True, "resource_exhausted",
                              metadata_float(md_trail.get("predicted-ttft-ms")),
                              metadata_int(md_trail.get("retry-after-ms")), scope="refused") from None
            if md_trail.get(ERROR_SCOPE_HEADER) == REQUEST_SCOPE:
                # The worker failed this request alone and is fine (decode/ingress.py as_request_error):
                # every worker would fail it the same way, so it is not sent on and no worker is avoided.
                self.metrics.request_error(REQUEST_SCOPE, "returned")
                log.warning("gateway: %s failed on %s after %d token(s) (%s: %s), scope request (the worker marked "
                            "it as this request's own failure): returned to the client; %s stays in rotation",
                            s.label, worker_id, len(s.tokens), code.name, exc.details(), worker_id)
                raise RequestError(CODE_OF.get(code, "internal"), exc.details() or code.name,
                                   scope=REQUEST_SCOPE) from None
            if code in BROKEN:
                raise _Broken(worker_id, f"{code.name}: {exc.details()}", not first) from None
            if code in UNMARKED:
                raise _Broken(worker_id, f"{code.name}: {exc.details()}", not first, "internal",
                              scope="unmarked") from None
            raise RequestError(CODE_OF.get(code, "internal"), exc.details() or code.name) from None
        finally:
            w.streams -= 1
            if not first:
                w.queued_tokens -= own
            if not finished:
                call.cancel()  # the client left, the stream broke, or it lost a race: the worker frees its blocks
                span.set({"pdserve.outcome": "ended early", "pdserve.tokens": len(s.tokens)})
            span.end()
        raise _Broken(worker_id, "the stream ended without its last message", not first)
