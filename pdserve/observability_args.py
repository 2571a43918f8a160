"""The tracing and log flags `pdserve worker`, `pdserve gateway` and `pdserve serve-decode`
share (vLLM's names where it has them; docs/cluster.md, "Tracing" and "Logs"), and how they
override a topology's ``observability`` section."""

from __future__ import annotations

from typing import Any

from pdserve.common.jsonlog import FORMATS
from pdserve.common.tracing import PROTOCOLS, TracingConfig

FLAGS = ("otlp_traces_endpoint", "otlp_traces_protocol", "otlp_traces_sample_ratio", "log_format")


def add_observability_flags(p, defaults: str = "the topology's observability section") -> None:
    g = p.add_argument_group(f"traces and logs (docs/cluster.md; default: {defaults})")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry spans over OTLP to this collector, e.g. http://collector:4317 "
                        "(grpc) or http://collector:4318 (http/protobuf); default: tracing off")
    g.add_argument("--otlp-traces-protocol", default=None, choices=PROTOCOLS,
                   help="OTLP over gRPC or HTTP (default: $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else grpc)")
    g.add_argument("--otlp-traces-sample-ratio", type=float, default=None, metavar="R",
                   help="share of new traces kept, 0-1 (parent-based: a sampled client traceparent is always "
                        "followed; default: $OTEL_TRACES_SAMPLER, else every trace)")
    g.add_argument("--log-format", default=None, choices=FORMATS,
                   help="log lines as text or one JSON object per line with request_id and trace_id "
                        "(default: text)")
    g.add_argument("--no-access-log", dest="access_log", action="store_false", default=None,
                   help="no uvicorn access line per HTTP request (default: on)")


def overrides(args) -> dict[str, Any]:
    """The observability settings the flags name (ValueError naming a flag with a bad value)."""
    out = {k: getattr(args, k) for k in FLAGS if getattr(args, k, None) is not None}
    if getattr(args, "access_log", None) is not None:
        out["access_log"] = args.access_log
    try:
        TracingConfig(**{k: v for k, v in out.items() if k.startswith("otlp_")})
    except ValueError as exc:
        name, _, why = str(exc).partition(":")
        raise ValueError(f"--{name.replace('_', '-')}:{why}") from None
    return out


def with_observability(topo, args):
    """``topo`` with its observability section overridden by the flags (the same object when none is given)."""
    changed = overrides(args)
    if not changed:
        return topo
    return topo.model_copy(update={"observability": topo.observability.model_copy(update=changed)})


def config_fields(topo, args) -> dict[str, Any]:
    """A gateway's (GatewayConfig) tracing, log_format and access_log: the topology's, overridden by the flags."""
    obs = with_observability(topo, args).observability
    return {"tracing": obs.tracing(), "log_format": obs.log_format, "access_log": obs.access_log}
