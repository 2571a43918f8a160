"""Traces of requests across the cluster: OpenTelemetry spans exported over OTLP (gRPC or
HTTP), off by default (docs/cluster.md, "Tracing").

Each process sets up one tracer per component it runs (`configure("gateway" | "decode" |
"prefill", TracingConfig)`; a worker does it in its `start()`), and the request path asks
for it by name (`tracer("decode")`). Without an endpoint a component's tracer is `NO_TRACER`,
whose spans are `NO_SPAN`: every call on them returns at once, and nothing of the
OpenTelemetry SDK is imported (it is the optional extra ``pdserve[otel]``; the engine step
never sees a tracer at all).

The context crosses processes as W3C Trace Context strings only: ``traceparent`` and
``tracestate`` in HTTP headers and gRPC metadata (`carrier_of`), and the traceparent string in
the prefill task (kvtransfer/task.py); never a pickled object. Spans are mostly made whole
once their stage is over, from the times the request path measured anyway (`Tracer.record`:
explicit start and end), so a stage costs nothing while it runs.

Sampling: `TracingConfig.otlp_traces_sample_ratio` (parent-based: a sampled client trace is
always followed), or when None the standard ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
PROTOCOLS = ("grpc", "http/protobuf")
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_MAX_TRACESTATE = 512  # W3C: 32 members of up to 256 characters; more is dropped, not refused
_KINDS = ("internal", "server", "client", "producer", "consumer")
# How long finished spans wait before they are sent (the SDK's default is 5 s); OTEL_BSP_SCHEDULE_DELAY wins.
EXPORT_DELAY_MS = 500


def parse_traceparent(value: object) -> tuple[str, str, int] | None:
    """(trace id, parent span id, flags) of a W3C ``traceparent`` header; None when it is not
    one (a bad header starts a new trace, as the specification says, never an error)."""
    if not isinstance(value, str):
        return None
    m = _TRACEPARENT.match(value.strip())
    if m is None or m.group(1) == "ff" or (m.group(1) == "00" and m.group(5)):
        return None
    trace_id, span_id = m.group(2), m.group(3)
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return trace_id, span_id, int(m.group(4), 16)


def carrier_of(pairs: Iterable[tuple[str, Any]] | Mapping[str, Any] | None) -> dict[str, str] | None:
    """The trace context a caller sent: ``traceparent`` (when valid) and ``tracestate`` from gRPC
    metadata or HTTP headers (pairs or a mapping, keys in any case); None when it sent none."""
    if pairs is None:
        return None
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    found: dict[str, str] = {}
    for key, value in items:
        k = key.lower() if isinstance(key, str) else key
        if k in (TRACEPARENT, TRACESTATE) and isinstance(value, str) and k not in found:
            found[k] = value.strip()
    if parse_traceparent(found.get(TRACEPARENT)) is None:
        return None
    if TRACESTATE in found:
        found[TRACESTATE] = found[TRACESTATE][:_MAX_TRACESTATE]
    return found


def trace_id_of(carrier: Mapping[str, str] | None) -> str | None:
    """The trace id a carrier names (hex), None without one."""
    parsed = parse_traceparent((carrier or {}).get(TRACEPARENT))
    return parsed[0] if parsed else None


@dataclass(frozen=True)
class TracingConfig:
    """Where a component's spans go (vLLM's setting names). ``otlp_traces_endpoint`` None: off.
    ``otlp_traces_protocol`` None: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else grpc; an HTTP
    endpoint without a path gets ``/v1/traces``. ``otlp_traces_sample_ratio`` None: the
    ``OTEL_TRACES_SAMPLER`` environment, else every trace."""

    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str | None = None
    otlp_traces_sample_ratio: float | None = None

    def __post_init__(self) -> None:
        ep = self.otlp_traces_endpoint
        if ep is not None and (not isinstance(ep, str) or not ep.strip()):
            raise ValueError(f"otlp_traces_endpoint: a URL such as http://collector:4317, got {ep!r}")
        if self.otlp_traces_protocol is not None and self.otlp_traces_protocol not in PROTOCOLS:
            raise ValueError(f"otlp_traces_protocol: one of {', '.join(PROTOCOLS)}, got {self.otlp_traces_protocol!r}")
        r = self.otlp_traces_sample_ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0):
            raise ValueError(f"otlp_traces_sample_ratio: a number in [0, 1], got {r!r}")

    @classmethod
    def of(cls, value: "TracingConfig | Mapping[str, Any] | None") -> "TracingConfig":
        """A config from itself, its dict (a worker config's ``tracing``) or None (off);
        ValueError naming the key for an unknown one or a bad value."""
        if value is None:
            return cls()
        if isinstance(value, TracingConfig):
            return value
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"tracing: unknown key {unknown[0]!r}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**value)

    @property
    def enabled(self) -> bool:
        return self.otlp_traces_endpoint is not None

    @property
    def protocol(self) -> str:
        proto = self.otlp_traces_protocol or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or "grpc"
        if proto not in PROTOCOLS:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: one of {', '.join(PROTOCOLS)}, got {proto!r}")
        return proto

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` instant as unix nanoseconds (what spans are stamped with)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _attr(value: Any) -> Any:
    """An attribute value OpenTelemetry takes (str, bool, int, float); others as their str."""
    return value if isinstance(value, (str, bool, int, float)) else str(value)


class Span:
    """One span of a request's trace (a thin wrapper: the SDK's span behind it)."""

    __slots__ = ("_span", "_tracer")

    def __init__(self, span: Any, tracer: "Tracer"):
        self._span = span
        self._tracer = tracer

    def __bool__(self) -> bool:
        return bool(self._span.is_recording())

    @property
    def trace_id(self) -> str | None:
        ctx = self._span.get_span_context()
        return f"{ctx.trace_id:032x}" if ctx.is_valid else None

    def traceparent(self) -> str | None:
        """This span as the W3C ``traceparent`` its children carry (sampled or not)."""
        ctx = self._span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}" if ctx.is_valid else None

    def carrier(self) -> dict[str, str]:
        """The headers (gRPC metadata) that make a callee's spans this span's children."""
        tp = self.traceparent()
        if tp is None:
            return {}
        out = {TRACEPARENT: tp}
        state = self._span.get_span_context().trace_state
        if state:
            out[TRACESTATE] = state.to_header()
        return out

    def set(self, attrs: Mapping[str, Any]) -> None:
        if self._span.is_recording():
            self._span.set_attributes({k: _attr(v) for k, v in attrs.items() if v is not None})

    def event(self, name: str, at_ns: int | None = None, attrs: Mapping[str, Any] | None = None) -> None:
        if self._span.is_recording():
            self._span.add_event(name, {k: _attr(v) for k, v in (attrs or {}).items() if v is not None}, at_ns)

    def fail(self, message: str) -> None:
        """Its status: error, with the message."""
        if self._span.is_recording():
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self, at_ns: int | None = None) -> None:
        self._span.end(at_ns)

    def record(self, name: str, start_ns: int, end_ns: int, attrs: Mapping[str, Any] | None = None,
               kind: str = "internal") -> "Span | _NoSpan":
        """A finished child of this span, from ``start_ns`` to ``end_ns`` (unix ns)."""
        if not self._span.is_recording():
            return NO_SPAN
        return self._tracer.record(name, self, start_ns, end_ns, attrs, kind)

    def child(self, name: str, attrs: Mapping[str, Any] | None = None, kind: str = "internal") -> "Span":
        """A child of this span that starts now and runs until its `end` (sampled out with it)."""
        return self._tracer.start(name, self, attrs=attrs, kind=kind)


class _NoSpan:
    """The span of a component that does not trace: every call returns at once."""

    __slots__ = ()
    trace_id = None

    def __bool__(self) -> bool:
        return False

    def traceparent(self) -> None:
        return None

    def carrier(self) -> dict[str, str]:
        return {}

    def set(self, attrs: Mapping[str, Any]) -> None:
        pass

    def event(self, name: str, at_ns: int | None = None, attrs: Mapping[str, Any] | None = None) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def end(self, at_ns: int | None = None) -> None:
        pass

    def record(self, name: str, start_ns: int, end_ns: int, attrs: Mapping[str, Any] | None = None,
               kind: str = "internal") -> "_NoSpan":
        return self

    def child(self, name: str, attrs: Mapping[str, Any] | None = None, kind: str = "internal") -> "_NoSpan":
        return self


NO_SPAN = _NoSpan()
AnySpan = Span | _NoSpan  # what a tracer's `start` gives: a span, or NO_SPAN when it does not trace
Parent = Span | _NoSpan | Mapping[str, str] | str | None  # a span, a carrier, a traceparent, or none (a new trace)


class Tracer:
    """One component's tracer: its own provider, resource (``service.name`` pdserve-<component>)
    and OTLP exporter."""

    enabled = True

    def __init__(self, component: str, cfg: TracingConfig, exporter: Any = None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.component, self.cfg = component, cfg
        sampler = (ParentBased(TraceIdRatioBased(cfg.otlp_traces_sample_ratio))
                   if cfg.otlp_traces_sample_ratio is not None else None)  # None: the OTEL_TRACES_SAMPLER env
        resource = Resource.create({"service.name": f"pdserve-{component}", "service.namespace": "pdserve"})
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        delay = int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", EXPORT_DELAY_MS))
        self.provider.add_span_processor(BatchSpanProcessor(exporter or _exporter(cfg), schedule_delay_millis=delay))
        self._tracer = self.provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {name: getattr(SpanKind, name.upper()) for name in _KINDS}

    def _context(self, parent: Parent) -> Any:
        from opentelemetry.context import Context
        from opentelemetry.trace import set_span_in_context

        if isinstance(parent, Span):
            return set_span_in_context(parent._span, Context())
        if isinstance(parent, str):
            parent = {TRACEPARENT: parent}
        if isinstance(parent, Mapping) and parse_traceparent(parent.get(TRACEPARENT)) is not None:
            return self._propagator.extract(dict(parent), Context())
        return Context()  # no parent: a new trace (never the thread's ambient span)

    def start(self, name: str, parent: Parent = None, *, start_ns: int | None = None,
              attrs: Mapping[str, Any] | None = None, kind: str = "internal") -> Span:
        """A span that runs from ``start_ns`` (default now) until its `Span.end`."""
        span = self._tracer.start_span(name, self._context(parent), self._kinds[kind],
                                       {k: _attr(v) for k, v in (attrs or {}).items() if v is not None},
                                       start_time=start_ns)
        return Span(span, self)

    def record(self, name: str, parent: Parent, start_ns: int, end_ns: int,
               attrs: Mapping[str, Any] | None = None, kind: str = "internal") -> Span:
        """A finished span: a stage whose times are known once it is over."""
        span = self.start(name, parent, start_ns=start_ns, attrs=attrs, kind=kind)
        span.end(max(start_ns, end_ns))
        return span

    def flush(self, timeout_s: float = 5.0) -> bool:
        return bool(self.provider.force_flush(int(timeout_s * 1e3)))

    def shutdown(self) -> None:
        self.provider.shutdown()


class _NoTracer:
    """The tracer of a component that does not trace."""

    enabled = False
    cfg = TracingConfig()

    def start(self, name: str, parent: Parent = None, *, start_ns: int | None = None,
              attrs: Mapping[str, Any] | None = None, kind: str = "internal") -> _NoSpan:
        return NO_SPAN

    def record(self, name: str, parent: Parent, start_ns: int, end_ns: int,
               attrs: Mapping[str, Any] | None = None, kind: str = "internal") -> _NoSpan:
        return NO_SPAN

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


NO_TRACER = _NoTracer()
_tracers: dict[str, Tracer] = {}
_lock = threading.Lock()


def _exporter(cfg: TracingConfig) -> Any:
    endpoint = cfg.otlp_traces_endpoint
    assert endpoint is not None
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    from urllib.parse import urlsplit

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter

    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HTTPSpanExporter(endpoint=endpoint)


def configure(component: str, cfg: TracingConfig | Mapping[str, Any] | None, exporter: Any = None) -> Tracer | _NoTracer:
    """Set up ``component``'s tracer in this process from ``cfg`` (off without an endpoint) and
    return it; the one it replaces (another config) is flushed and shut down. ``exporter``: a
    span exporter instead of OTLP's (tests, benchmarks). ImportError naming the extra when
    tracing is asked for and the SDK is not installed."""
    cfg = TracingConfig.of(cfg)
    with _lock:
        old = _tracers.get(component)
        if old is not None and old.cfg == cfg and exporter is None:
            return old
        new: Tracer | None = None
        if cfg.enabled:
            try:
                new = Tracer(component, cfg, exporter)
            except ImportError as exc:
                raise ImportError(f"otlp_traces_endpoint is set but the OpenTelemetry SDK is not installed "
                                  f"({exc}); pip install 'pdserve[otel]'") from None
            _tracers[component] = new
        else:
            _tracers.pop(component, None)
    if old is not None:
        old.shutdown()
    return new if new is not None else NO_TRACER


def tracer(component: str) -> Tracer | _NoTracer:
    """``component``'s tracer in this process (`NO_TRACER` unless `configure` set one up)."""
    return _tracers.get(component, NO_TRACER)


def flush(component: str, timeout_s: float = 5.0) -> bool:
    """Send ``component``'s finished spans now (a worker that stops)."""
    return tracer(component).flush(timeout_s)
