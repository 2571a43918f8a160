"""The topology's security sections: etcd (endpoints, TLS and RBAC identities, the gate)
and who may talk to the decode workers (their TLS and API keys).

What each identity may do is cluster/etcd_auth.py's, the gate's checks cluster/etcd_gate_policy.py's,
the API keys file's format cluster/security.py's; this module only holds the settings and
checks that they fit together. The queue wire's TLS is the queue's section (topology_sections.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic
from pydantic import Field

from pdserve.cluster.etcd_auth import IDENTITIES as ETCD_IDENTITIES
from pdserve.cluster.keys import parse_endpoints
from pdserve.cluster.security import DEFAULT_OPEN_GRPC_SERVICES, DEFAULT_OPEN_PATHS
from pdserve.cluster.topology_sections import _Strict


def _parsed_endpoints(value: list[str]) -> list[str]:
    if value:
        parse_endpoints(value)  # ValueError naming the bad "host:port"
    return value


Endpoints = Annotated[list[str], pydantic.AfterValidator(_parsed_endpoints)]  # etcd's and the gate's


class CertKeySpec(_Strict):
    """A certificate (PEM chain) and its private key."""

    cert: str = Field(min_length=1)
    key: str = Field(min_length=1)


class EtcdWorkersSpec(_Strict):
    """One etcd identity per worker id (cluster/etcd_auth.py): `dir` holds `<worker_id>.pem`
    and `<worker_id>-key.pem` (CN `worker/<cluster>/<worker_id>`), and each worker may write
    only its own record and NIXL metadata. `slots`: per role, how many ids (`<role>-0` ..
    `<role>-N-1`) get a user and a certificate; default: the larger of the role's replicas and
    the autoscale policy's max_replicas."""

    dir: str = Field(min_length=1)
    slots: dict[Literal["prefill", "decode"], Annotated[int, Field(ge=0)]] = Field(default_factory=dict)


class EtcdTlsSpec(_Strict):
    """TLS, client certificates and RBAC for etcd (cluster/etcd_auth.py, docs/security.md).
    `ca` signed etcd's server certificate and every client certificate. Each process
    connects as one identity, the user etcd reads from its certificate's common name:
    workers as their own (`workers`) or as the shared `worker`, the `pdserve` commands, the
    launcher and the planner as `operator`, the gateway and the KV index as `reader` (read
    only; else `operator`, else `worker`); `root` only sets up users and roles (the launcher,
    for an embedded etcd). List the identities this host's processes use; `server` is the
    embedded etcd's own."""

    ca: str = Field(min_length=1)
    server: CertKeySpec | None = None
    root: CertKeySpec | None = None
    operator: CertKeySpec | None = None
    worker: CertKeySpec | None = None
    reader: CertKeySpec | None = None
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
    """Workers and the reader (gateways, the KV index) reach etcd only through the etcd gate
    (cluster/etcd_gate.py), which scopes each to its own keys and leases and refuses
    compaction; their etcd users get no grants for the cluster. With an embedded etcd,
    `pdserve up` starts the gate beside it under a supervisor that restarts it if it dies:
    `port` is where it listens (0: a free port, kept across restarts), on the embedded etcd's
    address. With etcd.endpoints (an etcd you run) you run the gate too (the Helm chart's
    etcd.gate, or `python -m pdserve.cluster.etcd_gate --supervise`): `endpoints` is where it
    listens; `up` hands them to its workers, gateways and KV index, and `pdserve etcd-auth`
    grants their users nothing directly."""

    port: int = Field(0, ge=0, le=65535)
    endpoints: Endpoints = Field(default_factory=list)


class EtcdSpec(_Strict):
    """etcd endpoints ("host:port"); none = start an embedded etcd on loopback. `tls`:
    TLS with client certificates and RBAC (an embedded etcd then needs `tls.server` and
    `tls.root`). `gate`: workers and the reader go through the etcd gate (needs `tls`; with an
    embedded etcd, `tls.server` and `tls.operator` too: `pdserve up` starts the gate beside
    it; with `endpoints`, `gate.endpoints`: the gate you run)."""

    endpoints: Endpoints = Field(default_factory=list)
    data_dir: str | None = None  # embedded only; default <run_dir>/etcd
    lease_ttl_s: float = Field(10.0, ge=2.0)
    tls: EtcdTlsSpec | None = None
    gate: EtcdGateSpec | None = None

    @pydantic.model_validator(mode="after")
    def _embedded_tls_is_complete(self) -> "EtcdSpec":
        if self.tls is not None and not self.endpoints:
            missing = [f"tls.{k}" for k in ("server", "root") if getattr(self.tls, k) is None]
            if missing:
                raise ValueError(f"an embedded etcd (no endpoints) with tls needs {' and '.join(missing)}: its "
                                 "own certificate, and the root identity that sets up its users and roles")
        if self.gate is not None:
            if self.endpoints:  # a gate someone else runs (the Helm chart's, yours)
                if self.tls is None:
                    raise ValueError("gate needs tls: the gate and the etcd behind it serve only TLS with client "
                                     "certificates")
                if not self.gate.endpoints:
                    raise ValueError("gate: with etcd.endpoints (an etcd you run) run the gate yourself (`python -m "
                                     "pdserve.cluster.etcd_gate --supervise`, or the Helm chart's etcd.gate.enabled) "
                                     "and set gate.endpoints to where it listens (docs/security.md)")
                if self.gate.port:
                    raise ValueError("gate.port: only for the gate `pdserve up` starts beside its embedded etcd; "
                                     "with etcd.endpoints, gate.endpoints says where yours listens")
                return self
            missing = ["tls"] if self.tls is None else [
                f"tls.{k}" for k in ("server", "operator") if getattr(self.tls, k) is None]
            if missing:
                raise ValueError(f"gate needs {' and '.join(missing)}: the gate serves workers over TLS with the "
                                 "server certificate and acts as the operator identity towards etcd")
            if self.gate.endpoints:
                raise ValueError("gate.endpoints: `pdserve up` starts the gate beside the etcd it embeds (gate.port "
                                 "pins its port); gate.endpoints is for a gate you run with etcd.endpoints")
        return self


class TlsSpec(_Strict):
    """TLS for the decode workers' gRPC and HTTP (PEM files). `client_ca` set: mutual TLS,
    clients must present a certificate it signed. `ca`: what the cluster's own tools (the
    launcher's health check, `pdserve demo`, a gateway) verify the workers' certificate with;
    default `client_ca`, and with neither the system's trust store. `server_name`: the name
    those tools check the certificate for instead of the address they dial (on Kubernetes,
    where workers register their pod IPs: the decode Service's name)."""

    cert: str = Field(min_length=1)
    key: str = Field(min_length=1)
    client_ca: str | None = None
    ca: str | None = None
    server_name: str | None = Field(None, min_length=1)


class ApiKeysSpec(_Strict):
    """API keys: a file of hashed keys, one per line (format: cluster/security.py,
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
