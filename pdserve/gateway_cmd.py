"""`pdserve gateway`: the front door for many decode workers (gateway/).

    pdserve gateway --topology FILE                 in front of the cluster `pdserve up` started
    pdserve gateway --etcd HOST:PORT --cluster NAME --model DIR
    pdserve gateway --etcd HOST:PORT --cluster NAME --topology FILE  # the topology's model (a pod's)
    pdserve gateway explain --url http://HOST:PORT --prompt TEXT   the scores behind a pick
    pdserve gateway ... --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3

Clients call it exactly as a decode worker (gRPC `Inference`, OpenAI HTTP). Each request goes
to the decode worker with the lowest predicted TTFT; a stream whose worker fails continues on
another one from the tokens already sent (docs/gateway.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import urllib.error
import urllib.request

from pdserve.api.tool_calls import add_chat_flags

from .kv_cmd import _cluster_of
from .observability_args import add_observability_flags, config_fields
from .topology_args import add_topology_arg

HTTP_TIMEOUT_S = 10.0


def register(subparsers) -> None:
    gw = subparsers.add_parser("gateway", help="a front door for many decode workers: routes by predicted TTFT, "
                               "moves streams off failed workers", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_topology_arg(gw)
    gw.add_argument("--etcd", help="etcd HOST:PORT[,HOST:PORT] (default: the cluster `pdserve up` started)")
    gw.add_argument("--cluster", help="cluster name (default: the topology's)")
    gw.add_argument("--model", help="model directory (its tokenizer; default: the model `pdserve up` serves)")
    gw.add_argument("--host", default="127.0.0.1", help="address both servers bind (default 127.0.0.1)")
    gw.add_argument("--grpc-port", type=int, default=0, help="gRPC port (default 0: a free one, printed)")
    gw.add_argument("--http-port", type=int, default=0, help="HTTP port (default 0: a free one, printed)")
    gw.add_argument("--max-migrations", type=int, default=3,
                    help="times one stream may move to another worker before it fails (default 3)")
    gw.add_argument("--no-kv-index", action="store_true",
                    help="do not follow the decode workers' KV events (routing then ignores their prefix caches)")
    gw.add_argument("--routing", choices=("ttft", "random"), default="ttft",
                    help="ttft (default): the lowest predicted TTFT; random: any live worker (a baseline to "
                         "compare with)")
    gw.add_argument("--race-fraction", type=float, default=0.0,
                    help="race up to this fraction of requests on a second worker, cancelling the slower at its "
                         "first token (default 0: never); only requests with ttft_slo_ms whose best predicted "
                         "TTFT is at least --race-risk x it, and only when the runner-up is idle")
    gw.add_argument("--race-risk", type=float, default=0.5, help="see --race-fraction (default 0.5)")
    chat = gw.add_argument_group("chat output (vLLM's flags, as a decode worker's; default: the topology's "
                                 "roles.decode settings)")
    add_chat_flags(chat, auto_default=None)
    gw.add_argument("--api-keys-file", help="API keys the gateway accepts (docs/security.md); default: the "
                    "topology's security.api_keys, else none asked")
    key = gw.add_mutually_exclusive_group()
    key.add_argument("--worker-api-key", help="the key it calls decode workers with when they check keys "
                     "(default: the topology's gateway.worker_api_key_file, else $PDSERVE_API_KEY)")
    key.add_argument("--worker-api-key-file", help="a file holding that key (one line): kept out of the process "
                     "list")
    gw.add_argument("--no-forward-tenant", action="store_true",
                    help="do not send each client's key identity to the workers (x-pdserve-tenant; by default "
                         "their per-key fairness sees the clients, which needs an operator --worker-api-key "
                         "when they check keys)")
    gw.add_argument("--tls-cert", help="serve gRPC and HTTP over TLS with this certificate chain (PEM; default: "
                    "the topology's security.tls.cert, as the decode workers)")
    gw.add_argument("--tls-key", help="its private key (PEM)")
    gw.add_argument("--tls-client-ca", help="mutual TLS: the CA client certificates must chain to")
    gw.add_argument("--worker-ca-file", help="the CA the decode workers' TLS certificates chain to (their TLS on; "
                    "default: the topology's security.tls.ca, else client_ca)")
    gw.add_argument("--worker-client-cert", help="the certificate it presents to decode workers (mutual TLS; "
                    "default: under the topology's mutual TLS, the workers' own)")
    gw.add_argument("--worker-client-key", help="its private key")
    gw.add_argument("--worker-server-name", help="the name the decode workers' certificates carry, when it is not "
                    "the address they register (default: the topology's security.tls.server_name)")
    gw.add_argument("--check", action="store_true", help="validate the arguments and exit; start nothing")
    add_observability_flags(gw)
    gw.set_defaults(func=run)
    sub = gw.add_subparsers(dest="gateway_command", metavar="GATEWAY_COMMAND")
    p = sub.add_parser("explain", help="every decode worker's predicted TTFT for a prompt, and the pick")
    p.add_argument("--url", required=True, help="the gateway's HTTP address, as `pdserve gateway` printed it")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--model", help="a LoRA adapter's name: the pick among the workers that serve it")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(func=explain)


# The chat and security flags, each named as the GatewayConfig field it overrides (the topology
# gives the rest: its roles.decode chat settings, its security).
CHAT_FLAGS = ("enable_auto_tool_choice", "tool_call_parser", "reasoning_parser")
SECURITY_FLAGS = ("api_keys_file", "worker_api_key", "tls_cert", "tls_key", "tls_client_ca", "worker_ca_file",
                  "worker_client_cert", "worker_client_key", "worker_server_name")


def run(args) -> int:
    from pdserve.gateway.actor import chat_config, read_key_file, security_config
    from pdserve.gateway.server import Gateway, GatewayConfig
    from pdserve.topology_args import load_topology_arg

    etcd, cluster, _ = _cluster_of(args)
    model = _model_of(args)
    for name in ("grpc_port", "http_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: a port is 0-65535 (0: a free one)")
    if args.max_migrations < 0:
        raise ValueError(f"--max-migrations {args.max_migrations}: must be >= 0")
    if not 0 <= args.race_fraction <= 1 or args.race_risk <= 0:
        raise ValueError(f"--race-fraction {args.race_fraction} must be in [0, 1] and --race-risk {args.race_risk} > 0")
    if args.worker_api_key_file:
        args.worker_api_key = read_key_file(args.worker_api_key_file, "--worker-api-key-file")
    # The topology's security (what its decode workers and `pdserve up`'s gateways use), each
    # setting overridden by its flag.
    has_key = bool(args.worker_api_key or os.environ.get("PDSERVE_API_KEY"))
    topo = load_topology_arg(args.topology)
    sec = security_config(topo, worker_api_key=has_key)
    sec.update({k: getattr(args, k) for k in SECURITY_FLAGS if getattr(args, k) is not None})
    # How chat output is read: the topology's decode workers' settings, each overridden by its flag
    chat = chat_config(topo)
    chat.update({k: getattr(args, k) for k in CHAT_FLAGS if getattr(args, k) is not None})
    cfg = GatewayConfig(etcd, cluster, model=model, host=args.host, grpc_port=args.grpc_port,
                        http_port=args.http_port, max_migrations=args.max_migrations,
                        kv_index=not args.no_kv_index, routing=args.routing,
                        race_fraction=args.race_fraction, race_risk=args.race_risk,
                        forward_tenant=not args.no_forward_tenant, **chat, **sec, **config_fields(topo, args))
    cfg.chat_options()  # a bad combination names its setting before anything starts

    if args.check:
        from pdserve.api.security import ServerSecurity

        ServerSecurity.from_config(cfg)  # its TLS and key files: a missing one names the option
        said = (["tool_choice auto"] if chat["enable_auto_tool_choice"] else []) + \
            [f"{k.replace('_', ' ')} {chat[k]}" for k in ("tool_call_parser", "reasoning_parser") if chat[k]]
        print(f"gateway arguments OK: cluster {cluster}, etcd {', '.join(etcd)}, model {model}"
              + "".join(f"; {s}" for s in said))
        return 0

    async def serve():
        gw = Gateway(cfg)
        print(f"gateway of cluster {cluster} (etcd {', '.join(etcd)}): waiting for decode workers...", flush=True)
        info = await gw.start()
        print(f"gateway {info['gateway_id']}: gRPC {info['grpc']}, HTTP http://{info['http']}, "
              f"{len(gw.backends.workers)} decode worker(s)", flush=True)
        print(f"  pdserve gateway explain --url http://{info['http']} --prompt 'Hello'", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await gw.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


def _model_of(args) -> str:
    """The model directory whose tokenizer the gateway uses: --model; else the model of the
    cluster `pdserve up` started from --topology; else (with --etcd) the topology's own model
    (``path: auto``: made on this node, as a worker does)."""
    from pathlib import Path

    from pdserve.topology_args import load_topology_arg

    if args.model:
        if not Path(args.model).is_dir():
            raise FileNotFoundError(f"--model {args.model}: not a directory (the gateway reads its tokenizer)")
        return args.model
    else:
        topo = load_topology_arg(args.topology)
        if args.etcd:
            if topo.model.path == "auto":
                if args.check:
                    return "auto (made on start)"
                from pdserve.engine.model_maker import resolve_model

                return resolve_model(topo)
            model = str(topo.resolve(topo.model.path))
        else:
            from pdserve.launcher import ClusterState, state_path

            model = ClusterState.load(state_path(topo)).model
    if not Path(model).is_dir() and not args.check:  # --check in a pod's image may lack the volume
        raise FileNotFoundError(f"model.path {model}: not a directory on this node (the gateway reads its "
                                "tokenizer); mount it, or pass --model")
    return model


def explain(args) -> int:
    req = urllib.request.Request(args.url.rstrip("/") + "/gateway/explain", data=json.dumps(
        {"prompt": args.prompt, **({"model": args.model} if args.model else {})}).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            ans = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise ValueError(f"the gateway answered {exc.code}: {exc.read().decode(errors='replace')}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"--url {args.url}: the gateway did not answer ({exc}); is `pdserve gateway` running?") \
            from exc
    if args.json:
        print(json.dumps(ans, indent=2))
        return 0
    print(f"prompt: {ans['prompt_tokens']} tokens -> {ans['chosen'] or 'no worker'}: {ans['reason']}")
    print(f"{'worker':<20} {'TTFT ms':>9} = {'ms/tok':>7} x ({'queued':>7} + {'own':>6}) + {'step':>6} + "
          f"{'kv pen':>6}   {'cached':>6} {'streams':>7}")
    for s in ans["scores"]:
        print(f"{s['worker_id']:<20} {s['ttft_ms']:>9.1f} = {s['rate_ms']:>7.3f} x ({s['queued_tokens']:>7} + "
              f"{s['own_tokens']:>6}) + {s['step_ms']:>6.1f} + {s['kv_penalty_ms']:>6.1f}   "
              f"{s['cached_tokens']:>6} {s['streams']:>7}")
    for wid, why in ans["excluded"].items():
        print(f"{wid:<20} excluded: {why}")
    return 0
