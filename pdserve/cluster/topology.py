"""The topology spec: what an XpYd deployment is made of, as one YAML file.

`load_topology(path)` parses `configs/topologies/*.yaml` against the schema:
the roles and `Topology` below, the other sections in topology_sections.py (model,
Ray, queue, network) and topology_security.py (etcd, the decode workers'
TLS and API keys). Unknown keys, bad values and missing required keys are errors that
name the file, line and column and the dotted key (common/yaml_schema.py, the loader of every
YAML schema), e.g.

    configs/topologies/bad.yaml:7:5: roles.prefill.replicas: Input should be greater than or equal to 0 (got -2)

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
from pydantic import Field, PrivateAttr

from pdserve.cluster.etcd_auth import WORKER, EtcdTLS, WorkerCerts, worker_identity
from pdserve.cluster.keys import check_name
from pdserve.cluster.netaddr import LOOPBACK
from pdserve.cluster.runtime import available_cpu_count
from pdserve.cluster.topology_sections import (LoRASpec, check_engine_features, ModelSpec, NetworkSpec, ObservabilitySpec, QueueSpec, RaySpec,
                                               _Strict)
from pdserve.cluster.topology_security import EtcdSpec, SecuritySpec
from pdserve.common.yaml_schema import YamlDocument, YamlIssue, YamlSchemaError

# The workers' entry points (`module:Class`), the one place the control plane names them: it
# never imports a worker; a topology's `roles.<role>.entrypoint` may name another class.
DEFAULT_PREFILL_ENTRYPOINT = "pdserve.prefill.worker:PrefillWorker"
DEFAULT_DECODE_ENTRYPOINT = "pdserve.decode.worker:DecodeWorker"
# The worker that can change role in place (pdserve/role_flip.py; the autoscale policy's allow_role_flip).
DEFAULT_FLEX_ENTRYPOINT = "pdserve.role_flip:FlexWorker"
_ENTRYPOINT = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"

Port = Annotated[int, Field(ge=0, le=65535)]


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
    # Ranks of one replica (tensor parallelism inside the worker, engine/tensor_parallel.py): the
    # engine's tensor_parallel_size. Prefill and decode may differ (the KV handoff maps heads:
    # kvtransfer/head_plan.py); both pools are then HND. On GPUs a replica holds this many devices.
    tensor_parallel_size: int = Field(1, ge=1, le=255)
    # name -> base port; replica i listens on base + i; 0 = any free port.
    ports: dict[str, Port] = Field(default_factory=dict)
    # The cores each replica's process owns (cluster/runtime.py `pin_process`): a list of CPU ids,
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
    abandoned attempt stay unused when a late page write could still land (kvtransfer/decode_side.py)."""

    replicas: int = Field(1, ge=1)
    remote_timeout_s: float = Field(30.0, gt=0)
    remote_quarantine_s: float = Field(60.0, gt=0)
    # Prompt tokens one decode-worker step may take; unset: planned every step from the measured
    # step costs and the router policy's qos.tpot_slo_ms / ttft_slo_ms (engine/step_plan.py).
    local_prefill_budget_tokens: int | None = Field(None, ge=1)
    # Time a few engine steps at boot so that the first requests are routed on this machine's
    # costs, not the policy's seeds (engine/calibrate.py).
    calibrate: bool = True
    # How chat output is read (vLLM's --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser;
    # the worker refuses an unknown parser at start: api/tool_calls.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    entrypoint: str = Field(DEFAULT_DECODE_ENTRYPOINT, pattern=_ENTRYPOINT)


class RolesSpec(_Strict):
    prefill: PrefillRoleSpec = Field(default_factory=PrefillRoleSpec)
    decode: DecodeRoleSpec = Field(default_factory=DecodeRoleSpec)


class GatewaySpec(_Strict):
    """Gateways `pdserve up` starts in front of the decode workers (gateway/, docs/gateway.md),
    each a detached Ray actor; 0 replicas: clients call the decode workers directly."""

    replicas: int = Field(0, ge=0)
    grpc_port: int = Field(0, ge=0, le=65535)  # 0: a free port (printed, in the state file)
    http_port: int = Field(0, ge=0, le=65535)
    routing: Literal["ttft", "random"] = "ttft"
    max_migrations: int = Field(3, ge=0)
    kv_index: bool = True  # follow the decode workers' KV events (those with engine kv_events: true)
    # Racing (docs/gateway.md): at most this fraction of requests also runs on a second worker;
    # a request races when it names ttft_slo_ms and its best prediction is >= race_risk x it.
    race_fraction: float = Field(0.0, ge=0, le=1)
    race_risk: float = Field(0.5, gt=0)
    num_cpus: float = Field(0.5, ge=0)
    # Ray custom resources that place each gateway (a node type's, e.g. {"pdserve_gateway": 1}:
    # deploy/ray/cluster.yaml's gateway_cpu nodes); {}: any node
    custom: dict[str, float] = Field(default_factory=dict)
    # A file holding the API key it calls the decode workers with, when they check keys
    # (security.api_keys): an operator's key. None with API keys on: refused at `up`.
    worker_api_key_file: str | None = None
    # Send each client's key identity to the workers (x-pdserve-tenant, docs/security.md), so
    # their per-key fairness sees the gateway's clients, not its one key
    forward_tenant: bool = True

    @pydantic.model_validator(mode="after")
    def _ports_fit_replicas(self) -> "GatewaySpec":
        if self.replicas > 1 and (self.grpc_port or self.http_port):
            raise ValueError(f"replicas={self.replicas} with a fixed grpc_port/http_port: replicas on one node "
                             "would take the same port; leave the ports at 0 (free ones, printed by `pdserve up`)")
        return self


class KVIndexSpec(_Strict):
    """The cluster's KV index (cluster/kvindex/service.py, docs/kvindex.md) that `pdserve up` starts as a
    detached Ray actor once the workers serve; `pdserve kv status/explain --topology` find it in
    the state file. It follows the workers whose engine args say ``kv_events: true``."""

    enabled: bool = False
    port: int = Field(0, ge=0, le=65535)  # its HTTP port; 0: a free one (printed, in the state file)
    num_cpus: float = Field(0.25, ge=0)
    # Ray custom resources that place it ({}: any node)
    custom: dict[str, float] = Field(default_factory=dict)


class Topology(_Strict):
    """One deployment: cluster name, model, roles, policies, etcd, Ray, queue."""

    cluster: str
    model: ModelSpec
    roles: RolesSpec
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    kv_index: KVIndexSpec = Field(default_factory=KVIndexSpec)
    router_policy: str | None = None  # None: the router's built-in defaults
    autoscale_policy: str | None = None  # None: fixed replica counts
    etcd: EtcdSpec = Field(default_factory=EtcdSpec)
    ray: RaySpec = Field(default_factory=RaySpec)
    queue: QueueSpec = Field(default_factory=QueueSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    observability: ObservabilitySpec = Field(default_factory=ObservabilitySpec)  # traces and logs
    lora: LoRASpec = Field(default_factory=LoRASpec)  # LoRA adapters the decode workers serve (docs/lora.md)
    run_dir: str | None = None  # logs, embedded etcd data; default ./runs

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @pydantic.field_validator("cluster")
    @classmethod
    def _cluster_is_a_key_segment(cls, value: str) -> str:
        return check_name("cluster", value)

    @pydantic.model_validator(mode="after")
    def _engine_features_fit_the_roles(self) -> "Topology":
        check_engine_features(self.roles.prefill.engine, self.roles.decode.engine, self.lora)
        return self

    @pydantic.model_validator(mode="after")
    def _tensor_parallel_fits(self) -> "Topology":
        tps = {role: getattr(self.roles, role).tensor_parallel_size for role in ("prefill", "decode")}
        for role, tp in tps.items():
            spec = getattr(self.roles, role)
            engine = spec.engine
            if 0 < spec.resources.num_gpus < tp:
                raise ValueError(f"roles.{role}.resources.num_gpus={spec.resources.num_gpus:g} but "
                                 f"roles.{role}.tensor_parallel_size={tp}: a replica's ranks each hold a GPU; set "
                                 f"num_gpus: {tp}")
            if tp > 1 and spec.resources.num_gpus > 0 and spec.resources.num_gpus % tp:
                raise ValueError(f"roles.{role}.resources.num_gpus={spec.resources.num_gpus:g} is not a whole number "
                                 f"of GPUs for each of the {tp} ranks (one placement-group bundle per rank); set "
                                 f"num_gpus: {tp}")
            if "tensor_parallel_size" in engine and engine["tensor_parallel_size"] != tp:
                raise ValueError(f"roles.{role}.engine.tensor_parallel_size={engine['tensor_parallel_size']} "
                                 f"disagrees with roles.{role}.tensor_parallel_size={tp}; set the role's only")
            if tps["prefill"] != tps["decode"] and engine.get("kv_layout", "HND") != "HND":
                raise ValueError(f"roles.{role}.engine.kv_layout={engine['kv_layout']!r}: prefill and decode run "
                                 f"different tensor_parallel_size ({tps['prefill']} and {tps['decode']}), so the "
                                 "handoff writes head ranges, contiguous only in HND pools: remove kv_layout or "
                                 "set it to HND")
        kv = {r: str(getattr(self.roles, r).engine.get("kv_cache_dtype", "auto")).lower() for r in ("prefill", "decode")}
        if len({"fp8_e4m3" if k == "fp8" else k for k in kv.values()}) > 1:  # docs/kv_cache.md
            raise ValueError(f"roles.prefill.engine.kv_cache_dtype={kv['prefill']!r} and roles.decode.engine.kv_cache_dtype="
                             f"{kv['decode']!r} differ: KV pages move as stored; set the same on both roles")
        return self

    def engine_args(self, role: str) -> dict[str, Any]:
        """The engine arguments of a replica of ``role``: its ``engine`` map, its TP size, and
        the pool layout the handoff needs (HND when the roles' TP sizes differ)."""
        spec = getattr(self.roles, role)
        out = dict(spec.engine)
        if spec.tensor_parallel_size > 1:
            out["tensor_parallel_size"] = spec.tensor_parallel_size
        if self.roles.prefill.tensor_parallel_size != self.roles.decode.tensor_parallel_size:
            out.setdefault("kv_layout", "HND")
        return out

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
        from pdserve.cluster.etcd_server import EtcdServerTLS

        tls = self.etcd.tls
        if tls is None or tls.server is None:
            return None
        return EtcdServerTLS(cert_file=str(self.resolve(tls.server.cert)), key_file=str(self.resolve(tls.server.key)),
                             ca_file=str(self.resolve(tls.ca)))


class TopologyError(YamlSchemaError):
    """A topology file that does not validate; `issues` holds each problem (`YamlIssue`: key path,
    line, column, message), and `str()` is one `FILE:LINE:COLUMN: key.path: message` line each."""


def load_topology(path: str | Path, *, check_files: bool = True) -> Topology:
    """Parse and validate a topology file (raises TopologyError naming file, line, column and key).

    With `check_files`, the router/autoscale policy files and the security files must exist.
    """
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TopologyError(source, [YamlIssue("", None, f"cannot read: {exc.strerror or exc}")]) from None
    doc = YamlDocument(text, source, TopologyError)
    topology = doc.validate(Topology)
    topology._base_dir = path.resolve().parent
    if check_files:
        missing = [
            doc.issue(tuple(key.split(".")), f"file {value!r} not found (resolved to {topology.resolve(value)})")
            for key, value in (("router_policy", topology.router_policy), ("autoscale_policy", topology.autoscale_policy),
                               *topology.security.files(), *(topology.etcd.tls.files() if topology.etcd.tls else ()),
                               *topology.queue.files(),
                               *topology.ray.files())
            if value is not None and not topology.resolve(value).is_file()
        ]
        workers = topology.etcd.tls.workers if topology.etcd.tls else None
        if workers is not None and not topology.resolve(workers.dir).is_dir():
            resolved = topology.resolve(workers.dir)
            missing.append(doc.issue(("etcd", "tls", "workers", "dir"),
                                     f"directory {workers.dir!r} not found (resolved to {resolved})"))
        if missing:
            raise doc.fail(missing)
    return topology
