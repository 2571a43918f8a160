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

from .etcd_auth import IDENTITIES as ETCD_IDENTITIES
from .security import key_line

SERVER_ROLES = ("decode", "prefill", "etcd", "queue")
CLIENT_ROLE = "client"
# etcd takes the user name from a client certificate's common name: CN = the identity.
ETCD_CLIENTS = {f"etcd-{identity}": identity for identity in ETCD_IDENTITIES}
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
KEY_PREFIX = "pds-"


def make_certs(out_dir: str | os.PathLike, hosts: list[str] | tuple[str, ...] = DEFAULT_HOSTS, *,
               days: int = 30, force: bool = False) -> dict[str, Path]:
    """A CA and per-role certificates under `out_dir`; returns {name: path}. Refuses to
    overwrite existing files unless `force` (a CA replaced by mistake breaks every peer)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out_dir)
    names = ["ca", *SERVER_ROLES, CLIENT_ROLE, *ETCD_CLIENTS]
    paths = {n: out / f"{n}.pem" for n in names} | {f"{n}-key": out / f"{n}-key.pem" for n in names}
    existing = sorted(str(p) for p in paths.values() if p.exists())
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists (and {len(existing) - 1} more); use --force to replace them")
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve (throw-away)"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(name("pdserve test CA")).issuer_name(name("pdserve test CA"))
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
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(end)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        _write(paths[role], b.sign(ca_key, hashes.SHA256()), paths[f"{role}-key"], key)
    return paths


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
    make.set_defaults(func=_make)
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
    try:
        paths = make_certs(args.dir, hosts, days=args.days, force=args.force)
    except FileExistsError as exc:
        raise ValueError(str(exc)) from None
    print(f"CA and certificates for {', '.join(hosts)} in {args.dir} (valid {args.days} days):")
    for n, p in paths.items():
        print(f"  {n:12s} {p}")
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().rstrip("\r\n")
    print(key_line(key, args.operator))
    return 0


def _new_key(args: argparse.Namespace) -> int:
    key = new_key()
    append_key(args.keys_file, key, args.operator)
    print(key)
    return 0
