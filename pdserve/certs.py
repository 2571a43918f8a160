"""`pdserve certs`: throw-away TLS material and API keys for tests and demos.

`make_certs(dir, hosts)` writes a private CA and one certificate per role, all signed by
it (ECDSA P-256, PEM):

    ca.pem  ca-key.pem                the CA (keep ca-key.pem away from the workers)
    decode.pem  decode-key.pem        server + client certificates for the hosts given
    prefill.pem prefill-key.pem       (the later control-plane increments use these)
    etcd.pem    etcd-key.pem
    queue.pem   queue-key.pem         the prefill queue's wire (topology queue.tls)
    client.pem  client-key.pem        a client-only certificate for mutual TLS
    etcd-root.pem      etcd-root-key.pem       etcd client certificates, one per etcd identity
    etcd-operator.pem  etcd-operator-key.pem   (client use only; the common name is the etcd
    etcd-worker.pem    etcd-worker-key.pem     user: cluster/etcd_auth.py, docs/security.md)
    etcd-workers/<worker_id>.pem, -key.pem     with --topology: one per worker slot of its cluster,
                                               CN worker/<cluster>/<worker_id> (etcd.tls.workers)

`certs workers DIR --topology FILE` issues the per-worker certificates from the CA already in
DIR (more slots later, or a renewal with --force) without touching anything else.
`hash-key` prints the keys-file line of a key read on stdin; `new-key` makes a random
key, appends its line to a keys file and prints the key once (cluster/security.py has
the file's format). Production clusters use certificates from their own CA
(docs/security.md); these are for loopback tests and demos.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
import sys
from pathlib import Path

from pdserve.cluster.etcd_auth import IDENTITIES as ETCD_IDENTITIES
from pdserve.cluster.etcd_auth import MAX_COMMON_NAME, worker_user
from pdserve.cluster.security import key_line

SERVER_ROLES = ("decode", "prefill", "etcd", "queue")
CLIENT_ROLE = "client"
# etcd takes the user name from a client certificate's common name: CN = the identity.
ETCD_CLIENTS = {f"etcd-{identity}": identity for identity in ETCD_IDENTITIES}
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
WORKERS_DIR = "etcd-workers"  # under DIR: the per-worker etcd certificates (etcd.tls.workers.dir)
KEY_PREFIX = "pds-"


def make_certs(out_dir: str | os.PathLike, hosts: list[str] | tuple[str, ...] = DEFAULT_HOSTS, *,
               days: int = 30, force: bool = False, cluster: str | None = None,
               worker_ids: list[str] | tuple[str, ...] = ()) -> dict[str, Path]:
    """A CA and per-role certificates under `out_dir`; returns {name: path}. Refuses to
    overwrite existing files unless `force` (a CA replaced by mistake breaks every peer).
    `worker_ids` (with `cluster`): an etcd client certificate per worker id as well
    (`issue_worker_certs`)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    out = Path(out_dir)
    names = ["ca", *SERVER_ROLES, CLIENT_ROLE, *ETCD_CLIENTS]
    paths = {n: out / f"{n}.pem" for n in names} | {f"{n}-key": out / f"{n}-key.pem" for n in names}
    workers = _worker_paths(out, worker_ids)
    existing = sorted(str(p) for p in [*paths.values(), *workers.values()] if p.exists())
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists (and {len(existing) - 1} more); use --force to replace them")
    if worker_ids:
        _check_common_names(cluster, worker_ids)
    out.mkdir(parents=True, exist_ok=True)
    start, end = _validity(days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(_name("pdserve test CA")).issuer_name(_name("pdserve test CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    _write(paths["ca"], ca_cert, paths["ca-key"], ca_key)
    sans = [_san(h) for h in hosts]
    for role in (*SERVER_ROLES, CLIENT_ROLE, *ETCD_CLIENTS):
        key = ec.generate_private_key(ec.SECP256R1())
        server = role in SERVER_ROLES
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else \
            [ExtendedKeyUsageOID.CLIENT_AUTH]
        cn = ETCD_CLIENTS.get(role, f"pdserve {role}")
        b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(end)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        _write(paths[role], b.sign(ca_key, hashes.SHA256()), paths[f"{role}-key"], key)
    if worker_ids:
        assert cluster is not None  # _check_common_names above refused worker_ids without a cluster
        _issue_workers(ca_cert, ca_key, cluster, worker_ids, workers, days)
    return paths | workers


def issue_worker_certs(ca_dir: str | os.PathLike, cluster: str, worker_ids: list[str] | tuple[str, ...], *,
                       days: int = 30, force: bool = False) -> dict[str, Path]:
    """An etcd client certificate per worker id (CN `worker/<cluster>/<worker_id>`, client use
    only), signed by the CA in `ca_dir` (ca.pem, ca-key.pem), under `ca_dir`/etcd-workers/.
    Existing ones are kept unless `force` (a renewal); returns {name: path} of those written."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_dir = Path(ca_dir)
    try:
        ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((ca_dir / "ca-key.pem").read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{ca_dir}: cannot load the CA (ca.pem, ca-key.pem): {exc}") from None
    _check_common_names(cluster, worker_ids)
    todo = [w for w in worker_ids if force or not _worker_paths(ca_dir, [w])[f"{WORKERS_DIR}/{w}"].exists()]
    paths = _worker_paths(ca_dir, todo)
    _issue_workers(ca_cert, ca_key, cluster, todo, paths, days)
    return paths


def _worker_paths(out: Path, worker_ids) -> dict[str, Path]:
    return {f"{WORKERS_DIR}/{w}{suffix}": out / WORKERS_DIR / f"{w}{suffix}.pem"
            for w in worker_ids for suffix in ("", "-key")}


def _check_common_names(cluster: str | None, worker_ids) -> None:
    if not cluster:
        raise ValueError("per-worker etcd certificates need the cluster's name (their CN is worker/<cluster>/<id>)")
    for w in worker_ids:
        cn = worker_user(cluster, w)
        if len(cn) > MAX_COMMON_NAME:
            raise ValueError(f"the etcd user {cn!r} of worker {w} is {len(cn)} characters; a certificate's common "
                             f"name holds at most {MAX_COMMON_NAME}: use a shorter cluster name")


def _issue_workers(ca_cert, ca_key, cluster: str, worker_ids, paths: dict[str, Path], days: int) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    start, end = _validity(days)
    if worker_ids:
        (next(iter(paths.values())).parent).mkdir(parents=True, exist_ok=True)
    for w in worker_ids:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(worker_user(cluster, w))).issuer_name(ca_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(paths[f"{WORKERS_DIR}/{w}"], cert, paths[f"{WORKERS_DIR}/{w}-key"], key)


def _validity(days: int):
    now = datetime.datetime.now(datetime.timezone.utc)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve (throw-away)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write(cert_path: Path, cert, key_path: Path, key) -> None:
    from cryptography.hazmat.primitives import serialization

    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private keys: owner only
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(key_path, 0o600)


def new_key() -> str:
    """A random API key (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def append_key(keys_file: str | os.PathLike, key: str, operator: bool = False) -> None:
    """Add `key`'s line to a keys file (created owner-only)."""
    fd = os.open(keys_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(key_line(key, operator) + "\n")


# -- the command ------------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> None:
    certs = subparsers.add_parser(
        "certs", help="throw-away TLS certificates and API keys for tests and demos",
        description="Make a private CA and per-role certificates, and API keys in the form the "
        "keys file holds (docs/security.md).")
    certs.set_defaults(func=lambda args: (certs.print_help(), 2)[1])
    sub = certs.add_subparsers(dest="certs_command", metavar="SUBCOMMAND")
    make = sub.add_parser("make", help="a CA and decode/prefill/etcd/queue/client certificates in DIR",
                          description="Write ca.pem, and <role>.pem + <role>-key.pem for the roles "
                          f"{', '.join(SERVER_ROLES)} (server and client use) and {CLIENT_ROLE} (client use "
                          "only), all signed by the CA, valid for the hosts given; and the etcd client "
                          f"certificates {', '.join(n + '.pem' for n in ETCD_CLIENTS)} whose common names "
                          "are the etcd users pdserve's processes act as (docs/security.md).")
    make.add_argument("dir")
    make.add_argument("--hosts", default=",".join(DEFAULT_HOSTS),
                      help="comma-separated DNS names and IP addresses the server certificates name "
                           "(default: %(default)s)")
    make.add_argument("--days", type=int, default=30, help="validity in days (default: %(default)s)")
    make.add_argument("--force", action="store_true", help="replace existing files")
    make.add_argument("--topology", metavar="FILE", default=None,
                      help="also an etcd client certificate per worker slot of this topology (etcd.tls.workers), "
                           f"in DIR/{WORKERS_DIR}/<worker_id>.pem, CN worker/<cluster>/<worker_id>")
    make.set_defaults(func=_make)
    workers = sub.add_parser("workers", help="per-worker etcd certificates of a topology, from the CA in DIR",
                             description="Issue an etcd client certificate for each worker slot of the topology "
                             f"(etcd.tls.workers) into DIR/{WORKERS_DIR}/, signed by DIR/ca.pem with "
                             "DIR/ca-key.pem: after raising the slots, or to renew (--force). Existing ones are "
                             "kept without --force; nothing else in DIR changes.")
    workers.add_argument("dir")
    workers.add_argument("--topology", metavar="FILE", required=True, help="the topology whose slots get one")
    workers.add_argument("--days", type=int, default=30, help="validity in days (default: %(default)s)")
    workers.add_argument("--force", action="store_true", help="replace existing worker certificates")
    workers.set_defaults(func=_workers)
    hashk = sub.add_parser("hash-key", help="print the keys-file line of an API key read on stdin",
                           description="Reads one key on stdin (so it stays out of shell history) and prints "
                           "its line for the keys file: the SHA-256 in hex, and `operator` with --operator.")
    hashk.add_argument("--operator", action="store_true", help="mark it an operator key")
    hashk.set_defaults(func=_hash_key)
    new = sub.add_parser("new-key", help="make a random API key, add it to a keys file, print it",
                         description="Appends the new key's line to KEYS_FILE (created owner-only) and prints "
                         "the key on stdout: the only time it is shown.")
    new.add_argument("keys_file")
    new.add_argument("--operator", action="store_true", help="mark it an operator key")
    new.set_defaults(func=_new_key)


def _make(args: argparse.Namespace) -> int:
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    cluster, ids = _topology_slots(args.topology) if args.topology else (None, [])
    try:
        paths = make_certs(args.dir, hosts, days=args.days, force=args.force, cluster=cluster, worker_ids=ids)
    except FileExistsError as exc:
        raise ValueError(str(exc)) from None
    print(f"CA and certificates for {', '.join(hosts)} in {args.dir} (valid {args.days} days):")
    for n, p in paths.items():
        print(f"  {n:12s} {p}")
    return 0


def _workers(args: argparse.Namespace) -> int:
    cluster, ids = _topology_slots(args.topology)
    paths = issue_worker_certs(args.dir, cluster, ids, days=args.days, force=args.force)
    written = sorted({p.name.removesuffix("-key.pem").removesuffix(".pem") for p in paths.values()})
    print(f"etcd certificates of cluster {cluster}'s {len(ids)} worker slots in {Path(args.dir) / WORKERS_DIR}: "
          f"{len(written)} written ({', '.join(written) or 'none'}), {len(ids) - len(written)} kept")
    return 0


def _topology_slots(path: str) -> tuple[str, list[str]]:
    """(cluster, worker ids) of the slots of the topology at `path` (etcd.tls.workers)."""
    from pdserve.cluster.topology import TopologyError, load_topology
    from pdserve.cluster.worker_config import worker_slots
    from pdserve.cluster.planner.policy import autoscale_max_replicas

    try:
        topo = load_topology(path, check_files=False)  # its certificates may not exist yet
    except TopologyError as exc:
        raise ValueError(f"--topology {exc}") from None
    if topo.etcd_worker_certs() is None:
        raise ValueError(f"--topology {path}: etcd.tls.workers is not set; per-worker etcd certificates are for "
                         f"its slots (set etcd.tls.workers.dir, e.g. to the {WORKERS_DIR} directory beside ca.pem)")
    try:
        max_replicas = autoscale_max_replicas(topo)
    except OSError as exc:
        raise ValueError(f"--topology {path}: autoscale_policy: cannot read {exc.filename}: {exc.strerror}") from None
    return topo.cluster, [wid for _, wid in worker_slots(topo, max_replicas)]


def _hash_key(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().rstrip("\r\n")
    print(key_line(key, args.operator))
    return 0


def _new_key(args: argparse.Namespace) -> int:
    key = new_key()
    append_key(args.keys_file, key, args.operator)
    print(key)
    return 0
