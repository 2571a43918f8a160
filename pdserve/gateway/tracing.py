"""A gateway's spans of one request (common/tracing.py; docs/cluster.md, "Tracing").

``gateway.request`` (kind server) runs from the request's arrival to its last chunk, a child
of the trace context its client sent; each call of a decode worker is a ``gateway.attempt``
(kind client) under it, whose context goes to the worker in the call's metadata, so the
worker's ``decode.request`` is its child. A stream that moves to another worker shows one
attempt per worker and a ``migration`` event; a raced request shows both attempts under it,
each with its part (``pdserve.race``: won or lost; the loser's ended early), and the request
names both (``pdserve.race_winner``, ``pdserve.race_loser``).
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.api.ingress import GenerateInput
from pdserve.common import jsonlog, tracing


def request_span(inp: GenerateInput, label: str, gateway_id: str, prompt_tokens: int) -> tracing.AnySpan:
    """A request's gateway.request span; its log lines name the trace from here on."""
    span = tracing.tracer("gateway").start("gateway.request", inp.trace, kind="server", attrs={
        "gen_ai.request.id": label, "pdserve.gateway_id": gateway_id, "pdserve.prompt_tokens": prompt_tokens})
    if span:
        jsonlog.bind(trace_id=span.trace_id)
    return span


def attempt_span(request: tracing.AnySpan, worker_id: str, rid: str, resumed: int) -> tracing.AnySpan:
    """One call of a decode worker for the request (its `end` is the caller's)."""
    return request.child("gateway.attempt", kind="client", attrs={
        "pdserve.worker_id": worker_id, "pdserve.worker_request_id": rid, "pdserve.resumed_tokens": resumed})


def raced(request: tracing.AnySpan, attempts: Mapping[str, tracing.AnySpan], winner: str) -> None:
    """A race is decided (``attempts``: worker id -> its attempt's span, before the loser's ends)."""
    losers = [w for w in attempts if w != winner]
    request.set({"pdserve.race_winner": winner, "pdserve.race_loser": losers[0] if losers else None})
    for w, span in attempts.items():
        span.set({"pdserve.race": "won" if w == winner else "lost"})


def migrated(request: tracing.AnySpan, broken: Exception, tokens: int) -> None:
    """The stream broke on a worker after ``tokens`` and goes on elsewhere."""
    request.event("migration", attrs={"pdserve.from_worker": getattr(broken, "worker_id", None),
                                      "pdserve.reason": str(broken), "pdserve.tokens": tokens})


def request_ended(request: tracing.AnySpan, exc: BaseException | None, migrations: int, tokens: int) -> None:
    """The request is over (``exc``: how it failed, or the client that left)."""
    if exc is not None:
        request.fail(f"{type(exc).__name__}: {exc}")
    request.set({"pdserve.migrations": migrations, "gen_ai.usage.completion_tokens": tokens})
    request.end()
