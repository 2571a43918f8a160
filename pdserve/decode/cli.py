"""`pdserve serve-decode`: run one decode worker (gRPC + HTTP ingress)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from pdserve.api.tool_calls import add_chat_flags
from pdserve.cluster.security import DEFAULT_OPEN_GRPC_SERVICES, DEFAULT_OPEN_PATHS
from pdserve.common import jsonlog
from pdserve.common.jsonlog import FORMATS
from pdserve.common.tracing import PROTOCOLS, TracingConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve-decode",
        help="run a decode worker: gRPC + OpenAI-compatible HTTP ingress",
        description=(
            "Run one decode worker on a local model directory. It serves the pdserve "
            "Inference gRPC API and an OpenAI-compatible HTTP API (/v1/completions, "
            "/v1/chat/completions, /v1/models, /health, /metrics), admits requests by QoS "
            "and routes them with the router policy (hot-reloaded from --router-policy and, "
            "with --etcd, from the cluster's etcd key)."
        ),
    )
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0 = any free port)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (0 = any free port)")
    p.add_argument("--router-policy", default=None,
                   help="router/QoS policy YAML (default: built-in, same as configs/router/default.yaml)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: directory name)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--cluster", default="default", help="cluster name in etcd keys")
    p.add_argument("--etcd", default=None, help="etcd endpoints, comma-separated host:port (default: no registry)")
    p.add_argument("--lease-ttl", type=float, default=10.0, help="etcd lease TTL seconds")
    p.add_argument("--etcd-ca", default=None, help="CA (PEM) of a TLS etcd (the topology's etcd.tls.ca)")
    p.add_argument("--etcd-cert", default=None,
                   help="client certificate (PEM) for a TLS etcd: the worker identity (etcd.tls.worker.cert)")
    p.add_argument("--etcd-key", default=None, help="its private key (PEM)")
    p.add_argument("--engine-args", default="{}",
                   help='engine arguments as JSON, e.g. \'{"max_num_seqs": 64, "block_size": 16}\'')
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4}\' (the engine argument speculative_config; docs/speculative.md)')
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served from the start, as vLLM's: name=path, or JSON '{\"name\": ..., "
                        "\"path\": ..., \"base_model_name\": ...}'; the request's model names one. Needs "
                        "--engine-args '{\"enable_lora\": true}' (docs/lora.md)")
    p.add_argument("--local-prefill-budget-tokens", type=int, default=None,
                   help="prompt tokens one engine step may take (default: planned every step from the measured "
                        "step costs and the policy's qos.tpot_slo_ms / ttft_slo_ms: running streams keep their "
                        "TPOT, waiting prompts their TTFT; engine/step_plan.py)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip the boot calibration (~0.5 s of timed engine steps that replace the policy's seed "
                        "costs with this machine's before the first request)")
    p.add_argument("--engine-core-process", action="store_true",
                   help="run the engine loop in a process of its own, fed over a Unix socket (msgpack): HTTP, "
                        "streaming, tokenizing and routing stay here and never take the step's interpreter lock "
                        "(vLLM V1's engine core). Off by default: on 2 cores it does not pay (docs/PERFORMANCE.md). "
                        "Colocated serving only for now: not with remote prefill "
                        "(docs/architecture.md, \"The engine core in its own process\")")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight streams may run before they are handed back to their "
                        "clients (a gateway continues them on another decode worker); default 30")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="text", choices=FORMATS,
                   help="log lines as text, or one JSON object per line with request_id and trace_id")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no uvicorn access line per HTTP request (default: on)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry spans over OTLP to this collector (default: tracing off)")
    p.add_argument("--otlp-traces-protocol", default=None, choices=PROTOCOLS,
                   help="grpc or http/protobuf (default: $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else grpc)")
    p.add_argument("--otlp-traces-sample-ratio", type=float, default=None, metavar="R",
                   help="share of new traces kept, 0-1 (default: $OTEL_TRACES_SAMPLER, else every trace)")
    chat = p.add_argument_group("tool calling and reasoning (vLLM's flags; docs/api.md, Tool calling)")
    add_chat_flags(chat)
    sec = p.add_argument_group("security (docs/security.md; the topology's security: section)")
    sec.add_argument("--tls-cert", default=None, help="server certificate chain (PEM): serve gRPC and HTTP over TLS")
    sec.add_argument("--tls-key", default=None, help="its private key (PEM)")
    sec.add_argument("--tls-client-ca", default=None,
                     help="CA (PEM) that clients' certificates must chain to: mutual TLS")
    sec.add_argument("--api-keys-file", default=None,
                     help="file of hashed API keys (pdserve certs hash-key); clients then send "
                          "'Authorization: Bearer <key>'")
    sec.add_argument("--open-paths", default=",".join(DEFAULT_OPEN_PATHS),
                     help="HTTP paths served without a key, comma-separated (default: %(default)s)")
    sec.add_argument("--open-grpc-services", default=",".join(DEFAULT_OPEN_GRPC_SERVICES),
                     help="gRPC services served without a key, comma-separated (default: %(default)s)")
    p.set_defaults(func=_serve)


def _etcd_tls(args: argparse.Namespace) -> dict | None:
    """--etcd-ca/--etcd-cert/--etcd-key: all three or none."""
    given = [args.etcd_ca, args.etcd_cert, args.etcd_key]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("--etcd-ca, --etcd-cert and --etcd-key go together (TLS to etcd as the worker identity)")
    return {"ca_file": args.etcd_ca, "cert_file": args.etcd_cert, "key_file": args.etcd_key, "identity": "worker",
            "setting": "--etcd-cert/--etcd-key"}


def _serve(args: argparse.Namespace) -> int:
    from .worker import DecodeWorker, DecodeWorkerConfig

    jsonlog.setup(args.log_format, args.log_level)
    try:
        engine_args = json.loads(args.engine_args)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--engine-args is not valid JSON: {exc}") from None
    if args.speculative_config is not None:
        from pdserve.engine.spec_config import parse_speculative_config

        parse_speculative_config(args.speculative_config)  # a ConfigError naming the field, before any work
        engine_args["speculative_config"] = json.loads(args.speculative_config)
    cfg = DecodeWorkerConfig(
        model=args.model, engine_args=engine_args, host=args.host, grpc_port=args.grpc_port,
        http_port=args.http_port, router_policy=args.router_policy, worker_id=args.worker_id,
        served_model_name=args.served_model_name, cluster=args.cluster,
        etcd_endpoints=args.etcd.split(",") if args.etcd else None, etcd_tls=_etcd_tls(args),
        lease_ttl_s=args.lease_ttl, local_prefill_budget_tokens=args.local_prefill_budget_tokens,
        calibrate=args.calibrate, lora_modules=args.lora_modules, engine_core_process=args.engine_core_process,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        api_keys_file=args.api_keys_file, open_paths=_names(args.open_paths),
        open_grpc_services=_names(args.open_grpc_services),
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, log_format=args.log_format, access_log=args.access_log,
        tracing=TracingConfig(args.otlp_traces_endpoint, args.otlp_traces_protocol,
                              args.otlp_traces_sample_ratio).to_dict(),
    )

    async def main() -> None:
        worker = DecodeWorker(cfg)
        await worker.start()
        scheme = "https" if worker.security.tls else "http"
        print(f"decode worker {worker.worker_id}: gRPC {worker.grpc_address}  HTTP {scheme}://{worker.http_address}",
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("draining ...", flush=True)
        await worker.drain(args.drain_timeout)
        await worker.stop()

    asyncio.run(main())
    return 0


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]
