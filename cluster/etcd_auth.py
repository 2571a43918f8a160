"""Who may write what in etcd: the identities pdserve's processes act as, and etcd RBAC.

With `etcd.tls` in the topology, etcd serves only TLS, requires a client certificate
signed by the topology's CA (`--client-cert-auth`), and runs with authentication on:
etcd takes the user name from the certificate's common name (CN). Three users:

    root       etcd's superuser: only the bootstrap below (the launcher, `pdserve etcd-auth`)
    operator   role pdserve-operator: read and write the cluster's whole prefix
               (config/, drain/, planner/, ...): the `pdserve` commands, the launcher, the planner
    worker     role pdserve-worker: read the cluster's whole prefix, write only workers/ and
               nixl/ (its own record and NIXL metadata, bound to its lease)

etcd permissions only add up (there is no "except"), so the worker role reads everything
and writes two sub-prefixes. The grants are per role, not per worker id: a worker
identity can overwrite another worker's record or NIXL metadata, but cannot drain a
worker, change a policy or touch the planner's keys. A user per worker id would need the
launcher and the planner to hold etcd's root identity and the CA key at run time (to
create users and issue certificates as workers come and go), which is a larger risk than
the one it removes (docs/security.md).

`bootstrap_rbac` creates the users (without passwords: certificates only), the roles and
their grants, and turns authentication on. It is idempotent: run it on every start.
`EtcdTLS` is what one process needs to connect (plain data: it crosses Ray in a worker's
config). Dependency-free at import; grpc and aetcd are imported when used.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from typing import Any

from .keys import Keyspace

log = logging.getLogger(__name__)

ROOT, OPERATOR, WORKER = "root", "operator", "worker"
IDENTITIES = (ROOT, OPERATOR, WORKER)
ROLE_OF = {OPERATOR: "pdserve-operator", WORKER: "pdserve-worker"}
DEFAULT_BOOTSTRAP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EtcdTLS:
    """How one process reaches a TLS etcd: the CA that signed etcd's server certificate,
    and this process's client certificate and key (PEM paths). `identity` is the etcd user
    the certificate's CN names, and `setting` the topology key it came from (for messages)."""

    ca_file: str
    cert_file: str
    key_file: str
    identity: str = ""
    setting: str = "etcd.tls"

    @classmethod
    def of(cls, value: "EtcdTLS | dict[str, Any] | None") -> "EtcdTLS | None":
        """`value` as an EtcdTLS (configs carry it as a plain dict); None stays None."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**value)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def credentials(self):
        """gRPC channel credentials, read from the files now (a new client sees rotated files)."""
        import grpc

        def read(path: str, what: str) -> bytes:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise ValueError(f"{self.setting}: cannot read the {what} {path}: {exc.strerror or exc}") from None

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file, "CA"),
                                            private_key=read(self.key_file, "key"),
                                            certificate_chain=read(self.cert_file, "certificate"))


class EtcdAccessDenied(RuntimeError):
    """etcd refused this process's identity an operation (RBAC), or its TLS files are
    unusable. Not transient: retrying does not help; the message names the setting."""


def access_denied(exc: BaseException) -> bool:
    """True if `exc` (an aetcd or gRPC error) is etcd refusing the caller's permissions."""
    import grpc

    for err in (exc, exc.__cause__):
        if isinstance(err, EtcdAccessDenied):
            return True
        if isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.PERMISSION_DENIED:
            return True
    return False


def denied_error(tls: EtcdTLS | None, action: str, exc: BaseException) -> EtcdAccessDenied:
    """The error to raise when etcd refused `action`: who asked and what to change."""
    if tls is None:
        return EtcdAccessDenied(f"etcd refused {action} (permission denied): this etcd has authentication "
                                "on; set etcd.tls in the topology with a client certificate it accepts")
    role = ROLE_OF.get(tls.identity)
    may = f" (role {role}: see docs/security.md for what it may write)" if role else ""
    return EtcdAccessDenied(f"etcd refused {action} to identity {tls.identity or '?'!r} "
                            f"(the common name of the certificate in {tls.setting}){may}: permission denied")


def grants(cluster: str) -> dict[str, list[tuple[str, bytes]]]:
    """{role: [(permission, key prefix)]} of one cluster (permission READ | READWRITE)."""
    keys = Keyspace(cluster)
    return {
        ROLE_OF[OPERATOR]: [("READWRITE", keys.prefix())],
        ROLE_OF[WORKER]: [("READ", keys.prefix()), ("READWRITE", keys.workers_prefix()),
                          ("READWRITE", keys.nixl_prefix())],
    }


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for "every key starting with `prefix`"."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    end[-1] += 1
    return bytes(end)


async def bootstrap_rbac(endpoint: str, root: EtcdTLS, clusters: list[str] | tuple[str, ...],
                         timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S) -> None:
    """Create pdserve's etcd users and roles, grant each role its cluster prefixes, and turn
    authentication on; connect as `root` (its certificate's CN must be "root"). Safe to
    run again: what exists already is kept (grants are added, never removed)."""
    import grpc
    from aetcd import rpc

    if root.identity != ROOT:
        raise ValueError(f"{root.setting}: the bootstrap connects as etcd's root user, got identity "
                         f"{root.identity!r}")
    channel = grpc.aio.secure_channel(endpoint, root.credentials())
    auth = rpc.AuthStub(channel)

    async def call(method: str, request, *, exists_ok: bool = False):
        try:
            return await getattr(auth, method)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            exists = exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "already exists" in (exc.details() or "")
            if exists_ok and exists:
                return None
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise EtcdAccessDenied(f"etcd at {endpoint} refused the RBAC bootstrap ({method}) to the identity "
                                       f"of {root.setting}.cert: its CN must be 'root' and etcd's root user must "
                                       "exist with the root role") from None
            raise

    try:
        no_password = rpc.UserAddOptions(no_password=True)  # certificates only: nobody can log in by password
        for user in IDENTITIES:
            await call("UserAdd", rpc.AuthUserAddRequest(name=user, options=no_password), exists_ok=True)
        await call("RoleAdd", rpc.AuthRoleAddRequest(name=ROOT), exists_ok=True)
        await call("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=ROOT, role=ROOT))
        for identity, role in ROLE_OF.items():
            await call("RoleAdd", rpc.AuthRoleAddRequest(name=role), exists_ok=True)
            await call("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=identity, role=role))
        for cluster in clusters:
            for role, perms in grants(cluster).items():
                for perm, prefix in perms:
                    perm_type = getattr(rpc.Permission, perm)
                    await call("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(
                        name=role, perm=rpc.Permission(permType=perm_type, key=prefix, range_end=_prefix_end(prefix))))
        await call("AuthEnable", rpc.AuthEnableRequest())
    except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "timed out"
        raise EtcdAccessDenied(f"etcd RBAC bootstrap at {endpoint} failed: {detail} (within {timeout_s:g} s; "
                               f"check etcd.endpoints and {root.setting})") from None
    finally:
        await channel.close()
    log.info("etcd at %s: users %s, roles %s, authentication on (clusters %s)", endpoint, ", ".join(IDENTITIES),
             ", ".join(ROLE_OF.values()), ", ".join(clusters))
