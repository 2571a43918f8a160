"""The topology spec: what an XpYd deployment is made of, as one YAML file.

`load_topology(path)` parses `configs/topologies/*.yaml` against the schema
below. Unknown keys, bad values and missing required keys are errors that
name the dotted key and the file line, e.g.

    configs/topologies/bad.yaml:7: roles.prefill.replicas: Input should be greater than or equal to 0

Relative paths inside a topology (policy files, model path, run_dir,
model.cache_dir) are resolved against the directory of the topology file, so
`router_policy: ../router/default.yaml` in `configs/topologies/x.yaml` means
`configs/router/default.yaml`. `run_dir` and `model.cache_dir` left out
default to `runs/` and `.cache/models/` under the current directory. The policy files themselves are validated by
the router package, not here; this module only checks that they exist.

Engine arguments (`roles.<role>.engine`) are passed through to the engine,
which validates them; worker entry points are "module:Class" strings so the
control plane never imports the workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from .etcd_auth import IDENTITIES as ETCD_IDENTITIES
from .etcd_auth import WORKER, EtcdTLS, WorkerCerts, worker_identity
from .keys import DEFAULT_NAMESPACE, DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_NAME, check_name, parse_endpoints
from .netaddr import LOOPBACK, check_bind
from .runtime import available_cpu_count
from .security import DEFAULT_OPEN_GRPC_SERVICES, DEFAULT_OPEN_PATHS
from .yaml_lines import duplicate_keys, issue_of, line_of

AUTO_MODEL = "auto"
# The workers' entry points (`module:Class`), the one place the control plane names them: it
# never imports a worker; a topology's `roles.<role>.entrypoint` may name another class.
DEFAULT_PREFILL_ENTRYPOINT = "pdserve.prefill.worker:PrefillWorker"
DEFAULT_DECODE_ENTRYPOINT = "pdserve.decode.worker:DecodeWorker"
# The worker that can change role in place (pdserve/role_flip.py; the autoscale policy's allow_role_flip).
DEFAULT_FLEX_ENTRYPOINT = "pdserve.role_flip:FlexWorker"
_ENTRYPOINT = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"

Port = Annotated[int, Field(ge=0, le=65535)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class CertKeySpec(_Strict):
    """A certificate (PEM chain) and its private key."""

    cert: str = Field(min_length=1)
    key: str = Field(min_length=1)


class EtcdWorkersSpec(_Strict):
    """One etcd identity per worker id (control/etcd_auth.py): `dir` holds `<worker_id>.pem`
    and `<worker_id>-key.pem` (CN `worker/<cluster>/<worker_id>`), and each worker may write
    only its own record and NIXL metadata. `slots`: per role, how many ids (`<role>-0` ..
    `<role>-N-1`) get a user and a certificate; default: the larger of the role's replicas and
    the autoscale policy's max_replicas."""

    dir: str = Field(min_length=1)
    slots: dict[Literal["prefill", "decode"], Annotated[int, Field(ge=0)]] = Field(default_factory=dict)


class EtcdTlsSpec(_Strict):
    """TLS, client certificates and RBAC for etcd (control/etcd_auth.py, docs/security.md).
    `ca` signed etcd's server certificate and every client certificate. Each process
    connects as one identity, the user etcd reads from its certificate's common name:
    workers as their own (`workers`) or as the shared `worker`, the `pdserve` commands, the
    launcher and the planner as `operator`; `root` only sets up users and roles (the launcher,
    for an embedded etcd). List the identities this host's processes use; `server` is the
    embedded etcd's own."""

    ca: str = Field(min_length=1)
    server: CertKeySpec | None = None
    root: CertKeySpec | None = None
    operator: CertKeySpec | None = None
    worker: CertKeySpec | None = None
    workers: EtcdWorkersSpec | None = None

    def files(self) -> list[tuple[str, str]]:
        """(dotted key, path) of every file it names."""
        out = [("etcd.tls.ca", self.ca)]
        for name in ("server", *ETCD_IDENTITIES):
            spec = getattr(self, name)
            if spec is not None:
                out += [(f"etcd.tls.{name}.cert", spec.cert), (f"etcd.tls.{name}.key", spec.key)]
        return out


class EtcdGateSpec(_Strict):
    """Workers reach etcd only through the etcd gate (control/etcd_gate.py), which scopes
    each to its own keys and leases and refuses compaction; their etcd users get no grants.
    `port`: where the gate listens (0: a free port), on the embedded etcd's address."""

    port: int = Field(0, ge=0, le=65535)


class EtcdSpec(_Strict):
    """etcd endpoints ("host:port"); none = start an embedded etcd on loopback. `tls`:
    TLS with client certificates and RBAC (an embedded etcd then needs `tls.server` and
    `tls.root`). `gate`: workers go through the etcd gate (needs `tls` with `server` and
    `operator`, and an embedded etcd: `pdserve up` starts the gate beside it)."""

    endpoints: list[str] = Field(default_factory=list)
    data_dir: str | None = None  # embedded only; default <run_dir>/etcd
    lease_ttl_s: float = Field(10.0, ge=2.0)
    tls: EtcdTlsSpec | None = None
    gate: EtcdGateSpec | None = None

    @pydantic.field_validator("endpoints")
    @classmethod
    def _endpoints_parse(cls, value: list[str]) -> list[str]:
        if value:
            parse_endpoints(value)
        return value

    @pydantic.model_validator(mode="after")
    def _embedded_tls_is_complete(self) -> "EtcdSpec":
        if self.tls is not None and not self.endpoints:
            missing = [f"tls.{k}" for k in ("server", "root") if getattr(self.tls, k) is None]
            if missing:
                raise ValueError(f"an embedded etcd (no endpoints) with tls needs {' and '.join(missing)}: its "
                                 "own certificate, and the root identity that sets up its users and roles")
        if self.gate is not None:
            missing = ["tls"] if self.tls is None else [
                f"tls.{k}" for k in ("server", "operator") if getattr(self.tls, k) is None]
            if missing:
                raise ValueError(f"gate needs {' and '.join(missing)}: the gate serves workers over TLS with the "
                                 "server certificate and acts as the operator identity towards etcd")
            if self.endpoints:
                raise ValueError("gate: `pdserve up` starts the gate beside the etcd it embeds; with etcd.endpoints "
                                 "set, run `python -m pdserve.control.etcd_gate` yourself and give the workers its "
                                 "endpoint (docs/security.md)")
        return self


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
    """The KV data plane: how every NIXL agent's UCX moves pages (control/netaddr.py `ucx_env`).
    It has no authentication: keep it on a private network (docs/security.md)."""

    # true on InfiniBand/RoCE hosts: UCX loads its IB modules. false sets UCX_MODULES=^ib: a host
    # with RDMA libraries but no RDMA device can otherwise crash at exit (ENVIRONMENT.md).
    rdma: bool = False
    # UCX_NET_DEVICES. auto: the interface of the bound address (lo on loopback); all: whatever
    # UCX finds; or a UCX device list, e.g. mlx5_0:1 or eth1.
    devices: str = Field("auto", min_length=1)
    # UCX_TLS, e.g. tcp, or rc,cuda_copy,cuda_ipc; unset: UCX picks.
    transports: str | None = Field(None, min_length=1)


class NetworkSpec(_Strict):
    """Where every server binds and what it advertises in etcd (control/netaddr.py): loopback
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


class TlsSpec(_Strict):
    """TLS for the decode workers' gRPC and HTTP (PEM files). `client_ca` set: mutual TLS,
    clients must present a certificate it signed. `ca`: what the cluster's own tools (the
    launcher's health check, `pdserve demo`) verify the workers' certificate with; default
    `client_ca`, and with neither the system's trust store."""

    cert: str = Field(min_length=1)
    key: str = Field(min_length=1)
    client_ca: str | None = None
    ca: str | None = None


class ApiKeysSpec(_Strict):
    """API keys: a file of hashed keys, one per line (format: control/security.py,
    docs/security.md), re-read by the workers when it changes."""

    file: str = Field(min_length=1)


class SecuritySpec(_Strict):
    """Who may talk to the decode workers (docs/security.md). Off by default: fine on
    loopback, required when hosts share a network with anything else. `open_paths` (HTTP,
    exact paths) and `open_grpc_services` stay reachable without a key."""

    tls: TlsSpec | None = None
    api_keys: ApiKeysSpec | None = None
    open_paths: list[str] = Field(default_factory=lambda: list(DEFAULT_OPEN_PATHS))
    open_grpc_services: list[str] = Field(default_factory=lambda: list(DEFAULT_OPEN_GRPC_SERVICES))

    @pydantic.field_validator("open_paths")
    @classmethod
    def _paths_are_absolute(cls, value: list[str]) -> list[str]:
        bad = [p for p in value if not p.startswith("/")]
        if bad:
            raise ValueError(f"paths must start with '/', got {bad}")
        return value

    def files(self) -> list[tuple[str, str]]:
        """(dotted key, path) of every file it names."""
        out = [(f"security.tls.{k}", getattr(self.tls, k)) for k in ("cert", "key", "client_ca", "ca")
               if self.tls is not None and getattr(self.tls, k)]
        return out + ([("security.api_keys.file", self.api_keys.file)] if self.api_keys else [])


class ResourcesSpec(_Strict):
    """Ray resources of ONE replica."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # Ray custom resources: a node type's ({"pdserve_prefill": 1}) or one host's own
    # ({"node:10.0.0.2": 0.01}) to place the role there.
    custom: dict[str, float] = Field(default_factory=dict)


class _RoleSpec(_Strict):
    replicas: int = Field(1, ge=0)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    engine: dict[str, Any] = Field(default_factory=dict)
    # name -> base port; replica i listens on base + i; 0 = any free port.
    ports: dict[str, Port] = Field(default_factory=dict)
    # The cores each replica's process owns (control/runtime.py `pin_process`): a list of CPU ids,
    # or "auto": the host's cores split evenly between the topology's workers (prefill replicas
    # first), one worker per core where there are too few. Unset: no pinning. With cores set,
    # resources.num_cpus defaults to their number (Ray's accounting matches the pinning).
    cpus: list[Annotated[int, Field(ge=0)]] | Literal["auto"] | None = None

    @pydantic.field_validator("cpus")
    @classmethod
    def _cpus_form(cls, value):
        if isinstance(value, list) and (not value or len(set(value)) != len(value)):
            raise ValueError(f"a non-empty list of distinct CPU ids, or 'auto'; got {value}")
        return value


class PrefillRoleSpec(_RoleSpec):
    """Prefill pool. Zero replicas is allowed: every prompt is then prefilled locally."""

    entrypoint: str = Field(DEFAULT_PREFILL_ENTRYPOINT, pattern=_ENTRYPOINT)


class DecodeRoleSpec(_RoleSpec):
    """Decode pool: the ingress, so at least one replica. `remote_timeout_s`: a remote prefill's
    deadline before the request prefills locally; `remote_quarantine_s`: how long blocks of an
    abandoned attempt stay unused when a late page write could still land (handoff/decode_side.py)."""

    replicas: int = Field(1, ge=1)
    remote_timeout_s: float = Field(30.0, gt=0)
    remote_quarantine_s: float = Field(60.0, gt=0)
    # Prompt tokens one decode-worker step may take; unset: planned every step from the measured
    # step costs and the router policy's qos.tpot_slo_ms / ttft_slo_ms (decode/prefill_budget.py).
    local_prefill_budget_tokens: int | None = Field(None, ge=1)
    # Time a few engine steps at boot so that the first requests are routed on this machine's
    # costs, not the policy's seeds (engine/calibrate.py).
    calibrate: bool = True
    entrypoint: str = Field(DEFAULT_DECODE_ENTRYPOINT, pattern=_ENTRYPOINT)


class RolesSpec(_Strict):
    prefill: PrefillRoleSpec = Field(default_factory=PrefillRoleSpec)
    decode: DecodeRoleSpec = Field(default_factory=DecodeRoleSpec)


class Topology(_Strict):
    """One deployment: cluster name, model, roles, policies, etcd, Ray, queue."""

    cluster: str
    model: ModelSpec
    roles: RolesSpec
    router_policy: str | None = None  # None: the router's built-in defaults
    autoscale_policy: str | None = None  # None: fixed replica counts
    etcd: EtcdSpec = Field(default_factory=EtcdSpec)
    ray: RaySpec = Field(default_factory=RaySpec)
    queue: QueueSpec = Field(default_factory=QueueSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    run_dir: str | None = None  # logs, embedded etcd data; default ./runs

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @pydantic.field_validator("cluster")
    @classmethod
    def _cluster_is_a_key_segment(cls, value: str) -> str:
        return check_name("cluster", value)

    @pydantic.model_validator(mode="after")
    def _ports_do_not_collide(self) -> "Topology":
        taken: dict[int, str] = {}
        for role in ("prefill", "decode"):
            spec = getattr(self.roles, role)
            for name, base in spec.ports.items():
                for port in range(base, base + spec.replicas) if base else ():
                    other = taken.setdefault(port, f"roles.{role}.ports.{name}")
                    if other != f"roles.{role}.ports.{name}":
                        raise ValueError(f"roles.{role}.ports.{name}: port {port} is also used by {other}")
        return self

    @pydantic.model_validator(mode="before")
    @classmethod
    def _ray_cpus_follow_pinned_cores(cls, data):
        """A role with `cpus` asks Ray for that many CPUs unless resources.num_cpus says
        otherwise; a list that disagrees with an explicit num_cpus is refused."""
        roles = data.get("roles") if isinstance(data, dict) else None
        if not isinstance(roles, dict):
            return data
        workers = sum(r.get("replicas", 1) if isinstance(r, dict) and isinstance(r.get("replicas", 1), int) else 1
                      for r in (roles.get("prefill"), roles.get("decode")))
        roles = dict(roles)
        for role in ("prefill", "decode"):
            spec = roles.get(role)
            cpus = spec.get("cpus") if isinstance(spec, dict) else None
            if isinstance(cpus, list) and cpus and all(isinstance(c, int) for c in cpus):
                cores = len(set(cpus))
            elif cpus == "auto":
                cores = max(1, available_cpu_count() // max(1, workers))
            else:
                continue
            res = spec.get("resources", {})
            if not isinstance(res, dict):
                continue
            if "num_cpus" not in res:
                roles[role] = {**spec, "resources": {**res, "num_cpus": float(cores)}}
            elif isinstance(cpus, list) and res["num_cpus"] != cores:
                raise ValueError(f"roles.{role}.resources.num_cpus ({res['num_cpus']}) differs from the {cores} "
                                 f"cores of roles.{role}.cpus; drop num_cpus (it follows cpus) or match it")
        return {**data, "roles": roles}

    @pydantic.model_validator(mode="after")
    def _multi_host_needs_reachable_servers(self) -> "Topology":
        if self.network.bind != LOOPBACK and self.queue.wire == "loopback" and self.roles.prefill.replicas:
            raise ValueError("queue.wire: 'loopback' serves only the queue's own host, but network.bind "
                             f"{self.network.bind!r} puts workers on other hosts; set queue.wire: node")
        return self

    @property
    def base_dir(self) -> Path:
        """Directory that relative paths in this topology are resolved against."""
        return self._base_dir

    def resolve(self, path: str) -> Path:
        return (self._base_dir / Path(path).expanduser()).resolve()

    @property
    def router_policy_path(self) -> Path | None:
        return None if self.router_policy is None else self.resolve(self.router_policy)

    @property
    def autoscale_policy_path(self) -> Path | None:
        return None if self.autoscale_policy is None else self.resolve(self.autoscale_policy)

    @property
    def run_path(self) -> Path:
        return self.resolve(self.run_dir) if self.run_dir else Path.cwd() / "runs"

    @property
    def model_cache_path(self) -> Path:
        return self.resolve(self.model.cache_dir) if self.model.cache_dir else Path.cwd() / ".cache" / "models"

    @property
    def model_path(self) -> Path | None:
        """The model directory, or None for `auto` (the launcher makes it)."""
        return None if self.model.is_auto else self.resolve(self.model.path)

    @property
    def embedded_etcd(self) -> bool:
        return not self.etcd.endpoints

    def etcd_tls(self, *identities: str) -> EtcdTLS | None:
        """How a process acting as the first of `identities` the topology lists reaches etcd
        (files resolved); None without `etcd.tls` (plaintext). ValueError naming the setting
        when `etcd.tls` lists none of them."""
        tls = self.etcd.tls
        if tls is None:
            return None
        for identity in identities:
            spec = getattr(tls, identity)
            if spec is not None:
                return EtcdTLS(ca_file=str(self.resolve(tls.ca)), cert_file=str(self.resolve(spec.cert)),
                               key_file=str(self.resolve(spec.key)), identity=identity,
                               setting=f"etcd.tls.{identity}")
        wanted = " or ".join(f"etcd.tls.{i}" for i in identities)
        raise ValueError(f"the topology's etcd has TLS but no client certificate for this process: set {wanted} "
                         "(cert and key; `pdserve certs make` writes etcd-<identity>.pem)")

    def etcd_worker_certs(self) -> WorkerCerts | None:
        """Where each worker finds its own etcd certificate (etcd.tls.workers, resolved); None
        without it."""
        tls = self.etcd.tls
        if tls is None or tls.workers is None:
            return None
        return WorkerCerts(ca_file=str(self.resolve(tls.ca)), dir=str(self.resolve(tls.workers.dir)),
                           cluster=self.cluster)

    def worker_etcd_tls(self, worker_id: str) -> EtcdTLS | None:
        """How worker `worker_id` reaches etcd: as its own identity when etcd.tls.workers holds
        its certificate, else as the shared etcd.tls.worker; None without etcd.tls. ValueError
        naming the settings when it has neither."""
        tls = self.etcd.tls
        if tls is None:
            return None
        return worker_identity(worker_id, self.etcd_worker_certs(), self.etcd_tls(WORKER) if tls.worker else None)

    def embedded_etcd_tls(self):
        """The embedded etcd's EtcdServerTLS (None without etcd.tls)."""
        from .etcd_server import EtcdServerTLS

        tls = self.etcd.tls
        if tls is None or tls.server is None:
            return None
        return EtcdServerTLS(cert_file=str(self.resolve(tls.server.cert)), key_file=str(self.resolve(tls.server.key)),
                             ca_file=str(self.resolve(tls.ca)))


class TopologyError(ValueError):
    """A topology file that does not validate; `issues` holds (key, line, message)."""

    def __init__(self, source: str, issues: list[tuple[str, int | None, str]]):
        self.source = source
        self.issues = issues
        lines = [f"{source}:{line}: {key}: {msg}" if line else f"{source}: {key}: {msg}" for key, line, msg in issues]
        super().__init__(lines[0] if len(lines) == 1 else f"{len(lines)} errors\n  " + "\n  ".join(lines))


def load_topology(path: str | Path, *, check_files: bool = True) -> Topology:
    """Parse and validate a topology file (raises TopologyError naming key and line).

    With `check_files`, the router/autoscale policy files and the security files must exist.
    """
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TopologyError(source, [("(file)", None, f"cannot read: {exc.strerror or exc}")]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        what = " ".join(filter(None, (getattr(exc, "context", None), getattr(exc, "problem", None))))
        raise TopologyError(source, [("(yaml)", mark.line + 1 if mark else None, what or str(exc))]) from None
    if not isinstance(data, dict):
        raise TopologyError(source, [("(file)", 1, "a topology must be a YAML mapping of keys")])
    issues = duplicate_keys(root, ())
    if issues:
        raise TopologyError(source, issues)
    try:
        topology = Topology.model_validate(data)
    except pydantic.ValidationError as exc:
        raise TopologyError(source, [issue_of(root, err) for err in exc.errors()]) from None
    topology._base_dir = path.resolve().parent
    if check_files:
        missing = [
            (key, line_of(root, tuple(key.split("."))), f"file {value!r} not found (resolved to {topology.resolve(value)})")
            for key, value in (("router_policy", topology.router_policy), ("autoscale_policy", topology.autoscale_policy),
                               *topology.security.files(), *(topology.etcd.tls.files() if topology.etcd.tls else ()),
                               *topology.queue.files(),
                               *topology.ray.files())
            if value is not None and not topology.resolve(value).is_file()
        ]
        workers = topology.etcd.tls.workers if topology.etcd.tls else None
        if workers is not None and not topology.resolve(workers.dir).is_dir():
            missing.append(("etcd.tls.workers.dir", line_of(root, ("etcd", "tls", "workers", "dir")),
                            f"directory {workers.dir!r} not found (resolved to {topology.resolve(workers.dir)})"))
        if missing:
            raise TopologyError(source, missing)
    return topology
