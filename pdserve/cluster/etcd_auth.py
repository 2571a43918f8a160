"""Who may write what in etcd: the identities pdserve's processes act as, and etcd RBAC.

With `etcd.tls` in the topology, etcd serves only TLS, requires a client certificate
signed by the topology's CA (`--client-cert-auth`), and runs with authentication on:
etcd takes the user name from the certificate's common name (CN). The users:

    root                     etcd's superuser: only the bootstrap below (the launcher, `pdserve etcd-auth`)
    operator                 role pdserve-operator: read and write the cluster's whole prefix
                             (config/, drain/, planner/, ...): the `pdserve` commands, the launcher, the planner
    worker/<cluster>/<id>    one per worker id the topology can run (`etcd.tls.workers`), role
                             pdserve-worker/<cluster>/<id>: read the cluster's whole prefix, write only
                             workers/<role>/<id> and nixl/<id> (that worker's record and NIXL metadata)
    worker                   the shared worker identity (`etcd.tls.worker`), role pdserve-worker: read the
                             cluster's prefix, write all of workers/ and nixl/ (any worker's keys)
    reader                   role pdserve-reader: read the cluster's prefix, write nothing: what follows the
                             workers without being one (the gateway, the KV index)

With the etcd gate (`ClusterAccess.gated`, cluster/etcd_gate.py) the workers' users and the
reader get no grants for the cluster at all: they reach etcd only through the gate, which
also keeps them off leases that are not their own (etcd's RBAC does not cover leases).

etcd permissions only add up (there is no "except"): a worker's role reads everything and
writes two single keys (exact keys, not prefixes: `nixl/decode-1` must not cover
`nixl/decode-10`). A worker writes nothing else: its lease, record (load included) and
NIXL metadata are the whole of it, and it may revoke only leases that hold nothing but its
own keys (etcd checks write permission on every key a lease holds).

The per-worker users are made ahead of time, one per *slot*: worker ids are deterministic
(`<role>-<n>`: the launcher's replicas, and the planner's ids, which stay below the role's
slot count, `etcd.tls.workers.slots`, default the larger of the topology's replicas and the
autoscale policy's max_replicas). So nobody needs etcd's root identity or the CA's key at run
time: `bootstrap_rbac` creates every slot's user at start, and `pdserve certs make
--topology` issues every slot's certificate once. A planner that wants a worker beyond the
slots does not start it and says which setting to raise (cluster/planner/core.py).

The shared `worker` identity stays for workers whose ids are not known in advance (the Helm
chart's pods are named by Kubernetes): while a topology lists `etcd.tls.worker`, its role
keeps the role-level grant above; a topology that lists only `etcd.tls.workers` has it
revoked for its cluster at the next bootstrap.

`bootstrap_rbac` creates the users (without passwords: certificates only), the roles and
their grants, and turns authentication on. It is idempotent: run it on every start.
`EtcdTLS` is what one process needs to connect (plain data: it crosses Ray in a worker's
config); `WorkerCerts` is where each worker finds its own certificate. Dependency-free at
import; grpc and aetcd are imported when used.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from pdserve.cluster.keys import Keyspace, check_name, check_role

log = logging.getLogger(__name__)

ROOT, OPERATOR, WORKER, READER = "root", "operator", "worker", "reader"
IDENTITIES = (ROOT, OPERATOR, WORKER, READER)
ROLE_OF = {OPERATOR: "pdserve-operator", WORKER: "pdserve-worker", READER: "pdserve-reader"}
# Who follows a cluster's records without writing them, best first: the gateway, the KV index.
FOLLOWER_IDENTITIES = (READER, OPERATOR, WORKER)
DEFAULT_BOOTSTRAP_TIMEOUT_S = 10.0
MAX_COMMON_NAME = 64  # X.509's upper bound on a common name: the longest etcd user a certificate can name


def worker_user(cluster: str, worker_id: str) -> str:
    """The etcd user (a certificate's CN) of one worker id of one cluster. The cluster is part
    of it because users are global to an etcd that several clusters may share."""
    return f"{WORKER}/{check_name('cluster', cluster)}/{check_name('worker_id', worker_id)}"


def role_of(identity: str) -> str | None:
    """The etcd role an identity (user name) holds, None for a user pdserve does not make."""
    if identity.startswith(f"{WORKER}/"):
        return worker_role(identity)
    return ROLE_OF.get(identity)


def worker_role(user: str) -> str:
    """The etcd role of a per-worker user (`worker_user`): one of its own."""
    return f"pdserve-{user}"


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
        if value is None or isinstance(value, EtcdTLS):
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


@dataclass(frozen=True)
class WorkerCerts:
    """Where each worker of a cluster finds its own etcd client certificate (`etcd.tls.workers`):
    `<dir>/<worker_id>.pem` and `<dir>/<worker_id>-key.pem`, CN `worker/<cluster>/<worker_id>`
    (`pdserve certs make --topology` writes them). Plain data: it crosses Ray in a worker's config,
    and a worker that changes role (a new worker id) picks its new certificate from it."""

    ca_file: str
    dir: str
    cluster: str
    setting: str = "etcd.tls.workers"

    @classmethod
    def of(cls, value: "WorkerCerts | dict[str, Any] | None") -> "WorkerCerts | None":
        if value is None or isinstance(value, WorkerCerts):
            return value
        return cls(**value)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def paths(self, worker_id: str) -> tuple[str, str]:
        """(certificate, key) of `worker_id`."""
        check_name("worker_id", worker_id)
        return os.path.join(self.dir, f"{worker_id}.pem"), os.path.join(self.dir, f"{worker_id}-key.pem")

    def has(self, worker_id: str) -> bool:
        return all(os.path.isfile(p) for p in self.paths(worker_id))

    def tls(self, worker_id: str) -> EtcdTLS:
        """The EtcdTLS of worker `worker_id` (the files are read when it connects)."""
        cert, key = self.paths(worker_id)
        return EtcdTLS(ca_file=self.ca_file, cert_file=cert, key_file=key,
                       identity=worker_user(self.cluster, worker_id), setting=f"{self.setting}.dir")


def no_worker_identity() -> ValueError:
    """The error for a TLS etcd whose topology gives the workers no identity at all."""
    return ValueError("the topology's etcd has TLS but no client certificate for the workers: set "
                      "etcd.tls.workers (one identity per worker) or etcd.tls.worker (one shared by all)")


def worker_identity(worker_id: str, own: WorkerCerts | None, shared: EtcdTLS | None) -> EtcdTLS:
    """The identity worker `worker_id` connects to a TLS etcd as: its own (`own` holds its
    certificate), else the shared worker identity, else a ValueError naming the settings."""
    if own is not None and own.has(worker_id):
        return own.tls(worker_id)
    if shared is not None:
        return shared
    if own is None:
        raise no_worker_identity()
    cert, _ = own.paths(worker_id)
    raise ValueError(f"worker {worker_id} has no etcd identity: no {cert} (and its -key.pem) in {own.setting}.dir. "
                     f"Only the ids of the topology's slots get one ({own.setting}.slots: <role>-0 .. <role>-N-1); "
                     "`pdserve certs make DIR --topology FILE` (or `pdserve certs workers DIR --topology FILE` for "
                     "an existing CA) issues them")


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
    role = role_of(tls.identity)
    may = f" (role {role}: see docs/security.md for what it may write)" if role else ""
    return EtcdAccessDenied(f"etcd refused {action} to identity {tls.identity or '?'!r} "
                            f"(the common name of the certificate in {tls.setting}){may}: permission denied")


# A grant: (permission READ | READWRITE, key, range_end); range_end b"" is the key alone.
Grant = tuple[str, bytes, bytes]


def grants(cluster: str) -> dict[str, list[Grant]]:
    """{role: grants} of the shared identities of one cluster (operator, shared worker, reader)."""
    keys = Keyspace(cluster)

    def prefix(p: bytes) -> tuple[bytes, bytes]:
        return p, _prefix_end(p)

    return {
        ROLE_OF[OPERATOR]: [("READWRITE", *prefix(keys.prefix()))],
        ROLE_OF[WORKER]: [("READ", *prefix(keys.prefix())), ("READWRITE", *prefix(keys.workers_prefix())),
                          ("READWRITE", *prefix(keys.nixl_prefix()))],
        ROLE_OF[READER]: [("READ", *prefix(keys.prefix()))],
    }


def worker_grants(cluster: str, role: str, worker_id: str) -> list[Grant]:
    """What the user of worker `worker_id` (of `role`) may do: read the cluster, write its own
    record and NIXL metadata, each an exact key."""
    keys = Keyspace(cluster)
    return [("READ", keys.prefix(), _prefix_end(keys.prefix())),
            ("READWRITE", keys.worker(check_role(role), worker_id), b""),
            ("READWRITE", keys.nixl(worker_id), b"")]


@dataclass(frozen=True)
class ClusterAccess:
    """What `bootstrap_rbac` sets up for one cluster: the operator's grants; the shared
    `worker` identity's role-level grants while `shared_worker` (else they are revoked); and a
    user and role of its own for each (role, worker_id) of `workers` (the topology's slots)."""

    cluster: str
    workers: tuple[tuple[str, str], ...] = ()
    shared_worker: bool = True
    # Workers and the reader (gateways, the KV index) reach etcd only through the etcd gate
    # (cluster/etcd_gate.py): their users get no permissions for this cluster here (what an
    # earlier bootstrap granted is revoked), so their certificates used directly against etcd
    # read and write nothing, and cannot reach any lease (etcd would let them keep any alive).
    gated: bool = False

    @classmethod
    def of(cls, value: "ClusterAccess | str") -> "ClusterAccess":
        return value if isinstance(value, ClusterAccess) else cls(value)


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for "every key starting with `prefix`"."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    end[-1] += 1
    return bytes(end)


async def bootstrap_rbac(endpoint: str, root: EtcdTLS, clusters: Sequence[ClusterAccess | str],
                         timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S) -> None:
    """Create pdserve's etcd users and roles, grant each role its keys, and turn
    authentication on; connect as `root` (its certificate's CN must be "root"). `clusters`:
    a name alone is `ClusterAccess(name)` (operator and shared worker, no per-worker users).
    Safe to run again: what exists already is kept, grants are added; the removals are the
    shared worker role's grant on a cluster whose access says `shared_worker=False`, and the
    grants of every worker user and of the reader on a `gated` cluster."""
    import grpc
    from aetcd import rpc

    if root.identity != ROOT:
        raise ValueError(f"{root.setting}: the bootstrap connects as etcd's root user, got identity "
                         f"{root.identity!r}")
    access = [ClusterAccess.of(c) for c in clusters]
    channel = grpc.aio.secure_channel(endpoint, root.credentials())
    auth = rpc.AuthStub(channel)

    async def call(method: str, request, *, exists_ok: bool = False, absent_ok: bool = False):
        try:
            return await getattr(auth, method)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            detail = exc.details() or ""
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and (
                    (exists_ok and "already exists" in detail) or (absent_ok and "not granted" in detail)):
                return None
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise EtcdAccessDenied(f"etcd at {endpoint} refused the RBAC bootstrap ({method}) to the identity "
                                       f"of {root.setting}.cert: its CN must be 'root' and etcd's root user must "
                                       "exist with the root role") from None
            raise

    async def user_with_role(user: str, role: str) -> None:
        no_password = rpc.UserAddOptions(no_password=True)  # certificates only: nobody can log in by password
        await call("UserAdd", rpc.AuthUserAddRequest(name=user, options=no_password), exists_ok=True)
        await call("RoleAdd", rpc.AuthRoleAddRequest(name=role), exists_ok=True)
        await call("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=user, role=role))

    async def grant(role: str, perms: list[Grant]) -> None:
        for perm, key, range_end in perms:
            await call("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(
                name=role, perm=rpc.Permission(permType=getattr(rpc.Permission, perm), key=key, range_end=range_end)))

    slots = 0
    try:
        await user_with_role(ROOT, ROOT)
        for identity, role in ROLE_OF.items():
            await user_with_role(identity, role)
        for a in access:
            for role, perms in grants(a.cluster).items():
                # The shared worker's grant goes when a cluster moved to per-worker identities;
                # it and the reader's go when the cluster is gated (they use the gate instead).
                if (role == ROLE_OF[WORKER] and (a.gated or not a.shared_worker)) or \
                        (role == ROLE_OF[READER] and a.gated):
                    for _, key, range_end in perms:
                        await call("RoleRevokePermission", rpc.AuthRoleRevokePermissionRequest(
                            role=role, key=key, range_end=range_end), absent_ok=True)
                    continue
                await grant(role, perms)
            for role, worker_id in a.workers:
                user = worker_user(a.cluster, worker_id)
                await user_with_role(user, worker_role(user))
                if a.gated:
                    for _, key, range_end in worker_grants(a.cluster, role, worker_id):
                        await call("RoleRevokePermission", rpc.AuthRoleRevokePermissionRequest(
                            role=worker_role(user), key=key, range_end=range_end), absent_ok=True)
                    continue
                await grant(worker_role(user), worker_grants(a.cluster, role, worker_id))
                slots += 1
        await call("AuthEnable", rpc.AuthEnableRequest())
    except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "timed out"
        raise EtcdAccessDenied(f"etcd RBAC bootstrap at {endpoint} failed: {detail} (within {timeout_s:g} s; "
                               f"check etcd.endpoints and {root.setting})") from None
    finally:
        await channel.close()
    log.info("etcd at %s: users %s and %d per-worker, authentication on (clusters %s)", endpoint,
             ", ".join(IDENTITIES), slots, ", ".join(a.cluster for a in access))
