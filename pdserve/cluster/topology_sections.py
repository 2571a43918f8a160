"""The topology's plain sections: the model, Ray, the prefill queue and the network.

`_Strict` (unknown keys are errors, values frozen) is the base of every section of the
schema; `Topology` (topology.py) puts these sections together with the roles and the
security sections (topology_security.py). The queue's section holds its wire's TLS
(`QueueTlsSpec`) with it; paths are resolved by `Topology.resolve`, not here.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from pdserve.common.yaml_schema import YamlModel
from pdserve.cluster.keys import DEFAULT_NAMESPACE, DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_NAME
from pdserve.cluster.netaddr import LOOPBACK, check_bind

AUTO_MODEL = "auto"


_Strict = YamlModel  # every section: unknown keys are errors, values frozen (common/yaml_schema.py)


class ModelSpec(_Strict):
    """Which weights every worker loads. `path: auto` makes a small random-weight
    model under `cache_dir` on first run (arguments in `make`, validated by
    the engine's model maker); any other value is a model directory."""

    path: str = Field(min_length=1)
    name: str | None = None  # the model id clients send; default: the directory name
    cache_dir: str | None = None  # where `auto` models are made; default ./.cache/models
    make: dict[str, Any] = Field(default_factory=dict)

    @property
    def is_auto(self) -> bool:
        return self.path == AUTO_MODEL


class RaySpec(_Strict):
    """Where the Ray cluster is: none = start one in-process; "auto" = join the local one.
    `auth: token`: Ray's own token authentication on every Ray process pdserve starts or
    joins with (pdserve/ray_auth.py, docs/security.md); the token is read from `token_file`,
    else from Ray's own sources (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)."""

    address: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    # Nice value of the worker processes of a Ray head the launcher starts (the workers, the
    # queue actor). Ray's own default, 15, ranks the serving path below every other process
    # on the host; 0 keeps it level. Not applied when joining an existing Ray (address).
    worker_niceness: int = Field(0, ge=0, le=19)
    auth: Literal["disabled", "token"] = "disabled"
    token_file: str | None = Field(None, min_length=1)

    @pydantic.model_validator(mode="after")
    def _token_file_needs_token_auth(self) -> "RaySpec":
        if self.token_file is not None and self.auth != "token":
            raise ValueError("token_file is only read with auth: token; set ray.auth: token or remove ray.token_file")
        return self

    def files(self) -> list[tuple[str, str]]:
        """(dotted key, path) of every file it names."""
        return [("ray.token_file", self.token_file)] if self.token_file else []


class QueueTlsSpec(_Strict):
    """TLS for the prefill queue's wire (PEM files; docs/security.md). `cert`/`key`: the queue
    actor's certificate, which must name the address the wire advertises (127.0.0.1 with
    `wire: loopback`, the Ray head's IP with `wire: node`). `ca`: what the workers verify it
    with (default: the system's trust store). `client_ca` set: mutual TLS, workers present
    `client_cert`/`client_key`, which that CA must have signed. `server_name`: the name the
    workers check the certificate for instead of the address dialled (a Ray head whose IP
    changes, as on Kubernetes: its Service's name)."""

    cert: str = Field(min_length=1)
    key: str = Field(min_length=1)
    ca: str | None = None
    client_ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    server_name: str | None = Field(None, min_length=1)

    @pydantic.model_validator(mode="after")
    def _mutual_tls_is_complete(self) -> "QueueTlsSpec":
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together")
        if self.client_ca is not None and self.client_cert is None:
            raise ValueError("client_ca (mutual TLS) needs client_cert and client_key: the certificate the "
                             "workers present to the queue")
        return self


class QueueSpec(_Strict):
    """The prefill queue actor, and how prefill workers pull from it."""

    name: str = DEFAULT_QUEUE_NAME
    capacity: int = Field(DEFAULT_QUEUE_CAPACITY, ge=1)
    batch_max_tokens: int = Field(8192, ge=1)
    # How long an idle prefill worker's get_batch waits for a task before asking again. A put
    # wakes the waiting call at once, so this bounds idle polling (actor calls per second), not
    # latency: a short value only burns CPU on idle clusters.
    poll_timeout_ms: float = Field(1000.0, gt=0)
    # Liveness beyond the lease: a prefill worker holding tasks that the queue has not heard
    # from for this long (it calls every 0.5 s while serving a batch) is taken as hung; its
    # tasks are failed back and their decode workers prefill locally at once, instead of
    # waiting for the worker's lease (which another etcd client may even keep alive).
    stall_timeout_s: float = Field(3.0, gt=0)
    # Where the queue actor serves its wire (queue calls over a socket, ~6x faster than Ray
    # actor calls): "loopback" (clients on the queue's Ray node; others use Ray calls),
    # "node" (the node's IP: every node of a multi-node cluster) or "off" (Ray calls only).
    wire: Literal["loopback", "node", "off"] = "loopback"
    # The wire over TLS (or mutual TLS); its token is still required. Off by default: set it
    # whenever the wire's address is reachable by anything but the cluster (wire: node).
    tls: QueueTlsSpec | None = None

    @pydantic.model_validator(mode="after")
    def _tls_needs_a_wire(self) -> "QueueSpec":
        if self.tls is not None and self.wire == "off":
            raise ValueError("tls: the queue serves no wire (wire: off); remove queue.tls or set queue.wire")
        return self

    @pydantic.model_validator(mode="after")
    def _idle_polls_within_the_stall_bound(self) -> "QueueSpec":
        # An idle prefill worker is heard from once per poll: a poll longer than half the stall
        # bound would make idle workers look hung (not live: decode workers would stop routing
        # remote) between two polls.
        if self.poll_timeout_ms > self.stall_timeout_s * 500:
            raise ValueError(f"poll_timeout_ms: {self.poll_timeout_ms:g} ms is over half of stall_timeout_s "
                             f"({self.stall_timeout_s:g} s): idle prefill workers would look hung; lower "
                             "queue.poll_timeout_ms or raise queue.stall_timeout_s")
        return self

    def files(self) -> list[tuple[str, str]]:
        """(dotted key, path) of every file it names."""
        return [(f"queue.tls.{k}", getattr(self.tls, k)) for k in ("cert", "key", "ca", "client_ca", "client_cert",
                                                                    "client_key")
                if self.tls is not None and getattr(self.tls, k)]

    def server_tls(self, resolve) -> dict | None:
        """The queue actor's `wire_tls` (files resolved with `resolve`); None: plaintext."""
        tls = self.tls
        if tls is None:
            return None
        return {"cert": str(resolve(tls.cert)), "key": str(resolve(tls.key)),
                "client_ca": str(resolve(tls.client_ca)) if tls.client_ca else None}


class KVTransportSpec(_Strict):
    """The KV data plane: how every NIXL agent's UCX moves pages (cluster/netaddr.py `ucx_env`).
    It has no authentication: keep it on a private network (docs/security.md)."""

    # true on InfiniBand/RoCE hosts: UCX loads its IB modules. false sets UCX_MODULES=^ib: a host
    # with RDMA libraries but no RDMA device can otherwise segfault at exit (rc 139).
    rdma: bool = False
    # UCX_NET_DEVICES. auto: the interface of the bound address (lo on loopback); all: whatever
    # UCX finds; or a UCX device list, e.g. mlx5_0:1 or eth1.
    devices: str = Field("auto", min_length=1)
    # UCX_TLS, e.g. tcp, or rc,cuda_copy,cuda_ipc; unset: UCX picks.
    transports: str | None = Field(None, min_length=1)
    # Threads each NIXL agent posts a large write from (NIXL's UCX num_threads): a write of
    # many descriptors (a head range per block, between TP sizes) is split over them. auto: the
    # cores each rank owns, at most 4; 0 when it owns one (common/cores.py transfer_threads).
    threads: int | Literal["auto"] = "auto"
    # Prefix loans between workers (docs/kvindex.md): every worker, at any TP size, lends its cached
    # prefixes to other workers' reads and borrows theirs instead of computing them. false: neither.
    lending: bool = True
    # Checksum every lent block (debugging, chaos soaks; kvtransfer/lend.py): a borrower asks the
    # holder for each block's checksum with the grant and computes the prefix instead when what
    # it read differs (counted checksum_mismatch). Loans between single-rank workers only, and
    # at most 64 blocks a loan. Safety does not need it (the holder confirms every loan).
    verify: bool = False

    @pydantic.field_validator("threads")
    @classmethod
    def _threads(cls, value: int | Literal["auto"]) -> int | Literal["auto"]:
        if value != "auto" and value < 0:
            raise ValueError("use auto or a number >= 0")
        return value


class NetworkSpec(_Strict):
    """Where every server binds and what it advertises in etcd (cluster/netaddr.py): loopback
    for one host; node, an interface, a CIDR or an address when peers are on other hosts.
    `kv_transport` picks the KV pages' network; `ucx` holds any other UCX settings for every
    NIXL agent, applied last ("" removes a setting)."""

    bind: str = LOOPBACK
    kv_transport: KVTransportSpec = Field(default_factory=KVTransportSpec)
    ucx: dict[str, str] = Field(default_factory=dict)

    @pydantic.field_validator("bind")
    @classmethod
    def _bind_form(cls, value: str) -> str:
        return check_bind(value)

    @pydantic.field_validator("ucx")
    @classmethod
    def _ucx_keys(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [k for k in value if not k.startswith("UCX_")]
        if bad:
            raise ValueError(f"keys must be UCX_* environment variables, got {bad}")
        return value


class ObservabilitySpec(_Strict):
    """Traces and logs of every worker and gateway (docs/cluster.md, "Tracing" and "Logs"): the
    OTLP endpoint spans go to (None: tracing off), its protocol and the share of traces kept
    (vLLM's setting names; common/tracing.py), the log lines' format, and uvicorn's access lines."""

    otlp_traces_endpoint: str | None = None  # e.g. http://collector:4317 (grpc), http://collector:4318 (http)
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] | None = None  # None: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else grpc
    otlp_traces_sample_ratio: float | None = Field(None, ge=0, le=1)  # None: OTEL_TRACES_SAMPLER, else all
    log_format: Literal["text", "json"] = "text"
    access_log: bool = True

    def tracing(self) -> dict[str, Any]:
        """The workers' and gateways' ``tracing`` config (common/tracing.py TracingConfig fields)."""
        return {"otlp_traces_endpoint": self.otlp_traces_endpoint, "otlp_traces_protocol": self.otlp_traces_protocol,
                "otlp_traces_sample_ratio": self.otlp_traces_sample_ratio}


class LoRAModuleSpec(_Strict):
    """One LoRA adapter the decode workers serve from the start (vLLM's ``--lora-modules`` JSON
    form): ``name`` is the model requests send, ``path`` the PEFT adapter directory on every
    decode worker's host, ``base_model_name`` its parent in /v1/models (default: the model's
    name). The adapter's files are checked when a decode worker starts."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    base_model_name: str | None = None

    @pydantic.field_validator("name", "path")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value or value != value.strip():
            raise ValueError("must not hold NUL or leading/trailing whitespace")
        return value


class LoRASpec(_Strict):
    """LoRA adapters (docs/lora.md): the ones every decode worker serves from the start; more are
    loaded at run time with POST /v1/load_lora_adapter. Needs ``enable_lora: true`` in
    ``roles.decode.engine``."""

    modules: list[LoRAModuleSpec] = Field(default_factory=list)

    @pydantic.field_validator("modules")
    @classmethod
    def _names_unique(cls, value: list[LoRAModuleSpec]) -> list[LoRAModuleSpec]:
        names = [m.name for m in value]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"the adapter name {dup!r} is given twice")
        return value


def check_engine_features(prefill: dict[str, Any], decode: dict[str, Any], lora: LoRASpec) -> None:
    """The roles' engine maps against the features they ask for (a ValueError naming the key):
    LoRA adapters (docs/lora.md) need ``enable_lora`` on the decode workers; speculative decoding
    (docs/speculative.md) is the decode workers' setting, checked as the engine checks it, except
    the draft model's files, which each worker reads when it starts (paths on its host)."""
    if lora.modules and not decode.get("enable_lora"):
        raise ValueError("lora.modules: the decode workers serve LoRA adapters only with enable_lora: true in "
                         "roles.decode.engine")
    for role, engine in (("decode", decode), ("prefill", prefill)):
        raw = engine.get("speculative_config")
        if raw is None:
            continue
        from pdserve.engine.config import ConfigError  # (the engine's own check; torch loads only here)
        from pdserve.engine.spec_config import parse_speculative_config

        try:
            spec = parse_speculative_config(raw, check_files=False)
        except ConfigError as exc:
            raise ValueError(f"roles.{role}.engine.{exc}") from None
        # A prefill worker never speculates; with the decode workers' draft model or head it computes
        # its prompt KV beside the target's (draft_prompt_kv auto or prefill, docs/speculative.md).
        if role == "prefill" and (spec is None or spec.method == "ngram" or spec.draft_prompt_kv == "decode"):
            raise ValueError("roles.prefill.engine.speculative_config: prefill workers do not decode, so they "
                             "never speculate; they take only the decode workers' draft model or head (method "
                             "draft_model, eagle, eagle3 or mtp with draft_prompt_kv auto or prefill), to compute "
                             "its KV of each prompt beside the target's")
