"""What every worker role needs to start and join the cluster, and the launcher's configs.

`WorkerConfig` holds the fields both roles share (model, engine arguments, cluster
and etcd, the prefill queue, UCX, start-up settings); `DecodeWorkerConfig` and
`PrefillWorkerConfig` extend it with their own. The launcher hands an entry-point
class its config as a plain dict (`launch_config`), so the field names are an
interface: the topology's values arrive under these names.

`worker_slots` lists the worker ids a topology can ever run that get an etcd identity of
their own (`etcd.tls.workers`, cluster/etcd_auth.py): the launcher creates their etcd users,
`pdserve certs make --topology` their certificates, and the planner never starts an id
outside them.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pdserve.common.cores import transfer_threads

from pdserve.cluster.etcd_auth import EtcdTLS, WorkerCerts, no_worker_identity, worker_identity
from pdserve.cluster.keys import DEFAULT_NAMESPACE, DEFAULT_QUEUE_NAME, ROLES
from pdserve.cluster.netaddr import LOOPBACK, resolve_bind, ucx_env
from pdserve.cluster.runtime import pin_process, worker_cpus

if TYPE_CHECKING:
    from pdserve.cluster.topology import Topology

_Config = TypeVar("_Config", bound="WorkerConfig")


@dataclass
class WorkerConfig:
    """The role-independent part of a worker's config; defaults suit one local worker."""

    model: str
    engine_args: dict = field(default_factory=dict)
    worker_id: str | None = None  # None: "<role>-<8 hex digits>"
    cluster: str = "default"
    etcd_endpoints: list[str] | None = None  # None: no registration (decode only; prefill needs etcd)
    # TLS to etcd (etcd_tls_for): this worker's own identity when `etcd_worker_certs`
    # (etcd_auth.WorkerCerts as a dict) holds its certificate, else the shared `worker` identity
    # `etcd_tls` (etcd_auth.EtcdTLS as a dict); both None: plaintext.
    etcd_tls: dict | None = None
    etcd_worker_certs: dict | None = None
    lease_ttl_s: float = 10.0
    queue_name: str = DEFAULT_QUEUE_NAME
    queue_namespace: str = DEFAULT_NAMESPACE
    queue_transport: str = "auto"  # "auto" (the queue's wire when reachable) | "wire" | "ray"
    # TLS to the queue's wire (security.ClientTLS fields: ca_file, cert_file, key_file), from the
    # topology's queue.tls; None: plaintext (a client then refuses a TLS wire, and vice versa).
    queue_tls: dict | None = None
    # Where this worker's servers bind and what it advertises: the topology's network.bind
    # (loopback | node | interface | CIDR | address; cluster/netaddr.py).
    bind: str = LOOPBACK
    # Cores this worker's process owns (runtime.worker_cpus / pin_process): a CPU-id list, "auto"
    # (slot `cpu_slot` of `cpu_slots` workers sharing the host's cores) or None (no pinning).
    cpus: list[int] | str | None = None
    cpu_slot: int = 0
    cpu_slots: int = 1
    # The KV data plane (netaddr.ucx_env): the topology's network.kv_transport (rdma, devices,
    # transports), then any other UCX settings, its network.ucx ("" removes a setting).
    kv_transport: dict = field(default_factory=dict)
    ucx_env: dict = field(default_factory=dict)
    # Freeze the start-up heap out of the cyclic GC (cluster.runtime.freeze_gc_heap): set by the
    # launcher, whose workers own their process; off for a worker embedded in another program.
    freeze_gc: bool = False
    # Take over a record under this worker_id left by this worker's own earlier process (set
    # when Ray restarts the actor: the old lease may outlive the old process by up to its TTL).
    replace_stale_registration: bool = False
    # Traces (common/tracing.py TracingConfig fields; None: off), the log lines' format ("text" |
    # "json", common/jsonlog.py) and uvicorn's access lines: the topology's observability section.
    tracing: dict | None = None
    log_format: str = "text"
    access_log: bool = True

    @classmethod
    def of(cls: type[_Config], cfg: "_Config | dict[str, Any]") -> _Config:
        """`cfg` as this class: the launcher passes plain dicts (the entry-point contract)."""
        if isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, WorkerConfig):  # another role's config: not a mapping of this one's fields
            raise TypeError(f"{cls.__name__}.of: a {type(cfg).__name__} is not a {cls.__name__}")
        return cls(**cfg)

    def address(self) -> str:
        """The address this worker binds and advertises (resolved on its own host)."""
        return resolve_bind(self.bind)

    def agent_ucx_env(self, address: str) -> dict:
        """The UCX settings of this worker's NIXL agent when it is bound to `address`."""
        spec = {k: v for k, v in self.kv_transport.items() if k not in ("threads", "lending", "verify")}
        return ucx_env(address, self.ucx_env, **spec)

    @property
    def lending(self) -> bool:
        """Lend and borrow cached prefixes (kv_transport.lending; docs/kvindex.md)."""
        return bool(self.kv_transport.get("lending", True))

    @property
    def lend_verify(self) -> bool:
        """Check lent blocks against the holder's checksums (kv_transport.verify; kvtransfer/lend.py)."""
        return bool(self.kv_transport.get("verify", False))

    def agent_threads(self, ranks: int) -> int:
        """NIXL posting threads of each of this worker's `ranks` agents (kv_transport.threads)."""
        return transfer_threads(self.kv_transport.get("threads", "auto"), ranks)

    def pin_cpus(self, what: str) -> list[int] | None:
        """Pin this process to its cores (before the engine loads); the cores, or None."""
        cores = worker_cpus(self.cpus, self.cpu_slot, self.cpu_slots)
        return None if cores is None else pin_process(cores, what)

    def worker_id_for(self, role: str) -> str:
        """The configured worker id, or a fresh one for `role`."""
        return self.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"

    def etcd_tls_for(self, worker_id: str) -> EtcdTLS | None:
        """The identity worker `worker_id` reaches etcd as (chosen when it joins, so that a
        worker that changes role in place, under a new id, takes that id's certificate);
        None: plaintext. ValueError naming the settings when TLS is on and it has none."""
        own, shared = WorkerCerts.of(self.etcd_worker_certs), EtcdTLS.of(self.etcd_tls)
        if own is None and shared is None:
            return None
        return worker_identity(worker_id, own, shared)


def launch_config(topology: "Topology", role: str, replica: int, *, model: str,
                  etcd_endpoints: list[str], worker_id: str | None = None) -> dict[str, Any]:
    """The config dict of replica `replica` of `role` ("prefill" | "decode") in `topology`:
    every `WorkerConfig` field, plus the role's own keys the default entry points take.
    The worker id is `<role>-<replica>` unless `worker_id` names another (a pod's name)."""
    spec = getattr(topology.roles, role)
    etcd_tls, etcd_worker_certs = _worker_etcd(topology)
    common = WorkerConfig(model=model, engine_args=topology.engine_args(role), worker_id=worker_id or f"{role}-{replica}",
                          cluster=topology.cluster, etcd_endpoints=list(etcd_endpoints),
                          etcd_tls=etcd_tls, etcd_worker_certs=etcd_worker_certs, lease_ttl_s=topology.etcd.lease_ttl_s,
                          queue_name=topology.queue.name,
                          queue_namespace=topology.ray.namespace, freeze_gc=True,
                          bind=topology.network.bind, ucx_env=dict(topology.network.ucx),
                          kv_transport=topology.network.kv_transport.model_dump(),
                          queue_tls=_queue_client_tls(topology), tracing=topology.observability.tracing(),
                          log_format=topology.observability.log_format,
                          access_log=topology.observability.access_log)
    out = dataclasses.asdict(common)
    # Cores: slot of this replica among the topology's workers, prefill replicas first.
    out.update(cpus=spec.cpus, cpu_slots=max(1, topology.roles.prefill.replicas + topology.roles.decode.replicas),
               cpu_slot=replica if role == "prefill" else topology.roles.prefill.replicas + replica)

    def port(name: str) -> int:  # replica i listens on base + i; 0: any free port
        base = spec.ports.get(name, 0)
        return base + replica if base else 0

    if role == "prefill":
        out.update(batch_max_tokens=topology.queue.batch_max_tokens, poll_timeout_ms=topology.queue.poll_timeout_ms,
                   exit_on_loop_death=True, metrics_port=port("metrics") or None)
    else:
        policy = topology.router_policy_path
        out.update(grpc_port=port("grpc"), http_port=port("http"), router_policy=str(policy) if policy else None,
                   served_model_name=topology.model.name, remote_prefill=topology.roles.prefill.replicas > 0,
                   remote_timeout_s=spec.remote_timeout_s, remote_quarantine_s=spec.remote_quarantine_s,
                   local_prefill_budget_tokens=spec.local_prefill_budget_tokens, calibrate=spec.calibrate,
                   enable_auto_tool_choice=spec.enable_auto_tool_choice, tool_call_parser=spec.tool_call_parser,
                   reasoning_parser=spec.reasoning_parser,
                   lora_modules=[m.model_dump(exclude_none=True) for m in topology.lora.modules],
                   exit_on_engine_death=True, **_decode_security(topology))
    return out


def _worker_etcd(topology: "Topology") -> tuple[dict[str, str] | None, dict[str, str] | None]:
    """The workers' etcd identities (WorkerConfig.etcd_tls, etcd_worker_certs); ValueError naming
    the settings when etcd has TLS and the topology gives the workers no identity."""
    tls = topology.etcd.tls
    if tls is None:
        return None, None
    own = topology.etcd_worker_certs()
    shared = topology.etcd_tls("worker") if tls.worker is not None else None
    if own is None and shared is None:
        raise no_worker_identity()
    return (shared.to_dict() if shared is not None else None), (own.to_dict() if own is not None else None)


def worker_slot_counts(topology: "Topology", max_replicas: dict[str, int] | None = None) -> dict[str, int]:
    """Per role, how many worker ids (`<role>-0` .. `<role>-N-1`) get an etcd identity of their
    own: etcd.tls.workers.slots, else the larger of the role's replicas and `max_replicas` (the
    autoscale policy's). {} without etcd.tls.workers. ValueError when a slot count leaves out
    one of the topology's own replicas."""
    tls = topology.etcd.tls
    if tls is None or tls.workers is None:
        return {}
    out = {}
    slots: dict[str, int] = dict(tls.workers.slots.items())
    for role in ROLES:
        replicas = getattr(topology.roles, role).replicas
        n = slots.get(role, max(replicas, (max_replicas or {}).get(role, 0)))
        if n < replicas:
            raise ValueError(f"etcd.tls.workers.slots.{role} is {n}, fewer than roles.{role}.replicas ({replicas}): "
                             f"every worker needs an etcd identity; set it to at least {replicas}")
        out[role] = n
    return out


def worker_slots(topology: "Topology", max_replicas: dict[str, int] | None = None) -> list[tuple[str, str]]:
    """(role, worker_id) of every worker id with an etcd identity of its own (worker_slot_counts)."""
    return [(role, f"{role}-{i}") for role, n in worker_slot_counts(topology, max_replicas).items() for i in range(n)]


def _queue_client_tls(topology: "Topology") -> dict | None:
    """How workers reach a queue wire that speaks TLS (queue.tls): its CA and, under mutual
    TLS, the client certificate they present; files resolved like the topology's."""
    tls = topology.queue.tls
    if tls is None:
        return None
    path = lambda p: str(topology.resolve(p)) if p else None  # noqa: E731
    out = {"ca_file": path(tls.ca), "cert_file": path(tls.client_cert), "key_file": path(tls.client_key)}
    return out | ({"server_name": tls.server_name} if tls.server_name else {})


def _decode_security(topology: "Topology") -> dict[str, Any]:
    """The decode worker's security keys (DecodeWorkerConfig), files resolved like the topology's."""
    sec = topology.security
    path = lambda p: str(topology.resolve(p)) if p else None  # noqa: E731
    return {"tls_cert": path(sec.tls and sec.tls.cert), "tls_key": path(sec.tls and sec.tls.key),
            "tls_client_ca": path(sec.tls and sec.tls.client_ca),
            "api_keys_file": path(sec.api_keys and sec.api_keys.file),
            "open_paths": list(sec.open_paths), "open_grpc_services": list(sec.open_grpc_services)}
