"""A decode worker's spans of one request (common/tracing.py; docs/cluster.md, "Tracing").

`RequestTrace` opens the request's ``decode.request`` span (kind server) when the request
arrives, as a child of the trace context its caller sent (a gateway's attempt, or a client's
``traceparent``), and adds its stages once they are over, from the times the breakdown
measured anyway: ``decode.admission`` (validation, QoS, routing); for a local prefill
``decode.queue`` and ``decode.prefill``; for a remote one ``kv.transfer`` (the prefill
worker's spans, ``queue.wait`` and ``prefill.task``, join the trace through the traceparent
its task carries); the first token as an event. The request span carries the breakdown as
attributes (``pdserve.*``) and vLLM's ``gen_ai.*`` ones. When the worker does not trace, every
call here returns at once.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.api.ingress import GenerateInput
from pdserve.common import jsonlog, tracing

from .ingress import Prepared


class RequestTrace:
    """One request's spans on this decode worker."""

    __slots__ = ("span", "start_ns", "start_s", "engine_id")

    def __init__(self, worker_id: str, inp: GenerateInput):
        self.start_ns, self.start_s = time.time_ns(), time.monotonic()
        self.engine_id: str | None = None
        self.span = tracing.tracer("decode").start(
            "decode.request", inp.trace, start_ns=self.start_ns, kind="server",
            attrs={"pdserve.worker_id": worker_id, "gen_ai.request.id": inp.request_id})
        if self.span:
            jsonlog.bind(trace_id=self.span.trace_id)

    def _ns(self, monotonic_s: float) -> int:
        return self.start_ns + int((monotonic_s - self.start_s) * 1e9)

    def admitted(self, prep: Prepared) -> str | None:
        """Admission is over: its span; the traceparent the request's prefill task carries.
        From here on, lines about it on the engine thread name its ids (common/jsonlog.py)."""
        self.engine_id = prep.request_id
        jsonlog.track(prep.request_id, prep.label or None)
        span = self.span
        if not span:
            return span.traceparent()  # (sampled out: its children are not sampled either)
        d, p = prep.decision, prep.params
        span.record("decode.admission", self.start_ns, time.time_ns(), {
            "pdserve.route": d.route, "pdserve.reason": f"{d.reason}: {d.detail}",
            "pdserve.predicted_ttft_ms": d.predicted_ttft_ms, "pdserve.prompt_tokens": len(prep.prompt_ids),
            "pdserve.cached_tokens": prep.cached_len,
            "pdserve.borrow_holder": prep.borrow[0] if prep.borrow else None,
            "pdserve.borrow_blocks": prep.borrow[1] if prep.borrow else None})
        span.set({"gen_ai.request.max_tokens": p.max_tokens, "gen_ai.request.temperature": p.temperature,
                  "gen_ai.request.top_p": p.top_p, "pdserve.priority": prep.priority.label,
                  "pdserve.resumed_tokens": len(prep.inp.resume_ids or ()) or None,
                  "pdserve.structured_outputs": ",".join(sorted(p.structured_outputs))
                  if p.structured_outputs else None})
        return span.traceparent()

    def finished(self, prep: Prepared, b: dict[str, Any]) -> None:
        """The request's last chunk: its breakdown ``b`` as attributes and its stages as spans."""
        span = self.span
        if not span:
            return
        span.set({f"pdserve.{k}": v for k, v in b.items()})
        span.set({"gen_ai.usage.prompt_tokens": b.get("prompt_tokens"),
                  "gen_ai.usage.completion_tokens": b.get("completion_tokens"),
                  "gen_ai.latency.e2e": b.get("e2e_ms", 0.0) / 1e3})
        ttft = b.get("ttft_ms")
        if ttft is None:
            return
        arrival = self._ns(prep.arrival)
        first = arrival + int(ttft * 1e6)
        span.set({"gen_ai.latency.time_to_first_token": ttft / 1e3,
                  "gen_ai.latency.time_in_queue": b.get("queue_wait_ms", 0.0) / 1e3})
        span.event("first_token", first)
        if b.get("route") == "remote" and "transfer_ms" in b:
            span.record("kv.transfer", first - int(b["transfer_ms"] * 1e6), first, {
                "pdserve.transfer_bytes": b.get("transfer_bytes"), "pdserve.prefill_worker": b.get("prefill_worker"),
                "pdserve.attempts": b.get("attempts")})
        elif "queue_wait_ms" in b and "prefill_ms" in b:  # a local prefill (or a fallback to one)
            scheduled = arrival + int(b["queue_wait_ms"] * 1e6)
            span.record("decode.queue", arrival, scheduled)
            span.record("decode.prefill", scheduled, first, {
                "pdserve.prompt_tokens": b.get("prompt_tokens"), "pdserve.cached_tokens": b.get("cached_tokens"),
                "pdserve.fell_back_to_local": b.get("fell_back_to_local")})

    def end(self, exc: BaseException | None = None, how: str | None = None) -> None:
        """The request is over: refused (``exc``), ended early (``how``: its end's metric
        label), or finished (neither)."""
        if exc is not None:
            self.span.set({"pdserve.error": getattr(exc, "code", type(exc).__name__)})
            self.span.fail(str(exc) or type(exc).__name__)
        elif how is not None:
            self.span.fail(f"ended before its last token: {how}")
        self.span.end()
        if self.engine_id is not None:
            jsonlog.untrack(self.engine_id)
