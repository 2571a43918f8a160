"""Credentials of the client-facing surfaces: the API keys file, and how internal callers
(the launcher's health check, `pdserve demo`) reach a worker that serves TLS.

The keys file holds the SHA-256 of each key, never the key itself (docs/security.md):

    # pdserve API keys: <sha256 of the key, 64 hex digits> [operator]   (# starts a comment)
    4c1f0e6a9d2b7c3e5f8a1b0d6e9c2f4a7b3d8e1c5f0a9b6d2e7c4f1a8b5d3e0c  operator  # ops team
    b7e2d9c4a1f6e3b8d5c0a7f2e9b4d1c6a3f8e5b2d7c4a9f6e1b3d8c5a2f7e0b9            # web frontend

`operator` marks a key allowed to override routing and raise priority. Make a line
with `pdserve certs hash-key` (reads the key on stdin) or `pdserve certs new-key`.
A plain SHA-256 suffices because keys are random and long (new-key makes 256-bit
ones; hash-key refuses short ones): there is no dictionary to try.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.cluster.topology_security import SecuritySpec

log = logging.getLogger(__name__)

DEFAULT_OPEN_PATHS = ("/health", "/metrics")  # HTTP paths served without a key
DEFAULT_OPEN_GRPC_SERVICES = ("grpc.health.v1.Health",)  # gRPC services served without a key
OPERATOR = "operator"
MIN_KEY_CHARS = 16  # hash-key refuses shorter keys: a fast hash is only safe for random, long keys
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def hash_key(key: str) -> str:
    """The keys file's form of `key`: SHA-256 of its UTF-8 bytes, lowercase hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_line(key: str, operator: bool = False) -> str:
    """One keys-file line for `key` (ValueError for a key too short to be random)."""
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"the key has {len(key)} characters; use a random one of at least {MIN_KEY_CHARS} "
                         "(pdserve certs new-key makes one)")
    return f"{hash_key(key)}{'  ' + OPERATOR if operator else ''}"


@dataclass(frozen=True)
class ApiKey:
    """One accepted key: its hash, whether it is an operator's, where it was declared.

    `identity` names the key's holder in ownership checks and logs without revealing the key."""

    digest: str
    operator: bool = False
    line: int = 0
    _digest_bytes: bytes = field(default=b"", repr=False, compare=False)
    # The tenant an operator key acts for (a gateway forwarding its client's identity,
    # ``x-pdserve-tenant``): the request's identity is then that tenant's, its privileges
    # still the operator key's (api/security.py `ServerSecurity.on_behalf_of`).
    on_behalf_of: str = ""

    @property
    def identity(self) -> str:
        if self.on_behalf_of:
            return self.on_behalf_of
        return f"key:{self.digest[:12]}" if self.digest else "anonymous"


# A request on an open path or service that sent no valid key while keys are configured:
# it has no privileges.
ANONYMOUS = ApiKey(digest="", operator=False)


def parse_keys(text: str, source: str) -> list[ApiKey]:
    """The keys a keys file declares; ValueError naming `source:line` for a bad line."""
    keys: list[ApiKey] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        digest = words[0].lower()
        if not _HEX64.match(digest):
            raise ValueError(f"{source}:{n}: expected the key's SHA-256 as 64 hex digits (pdserve certs hash-key), "
                             f"got {len(words[0])} characters")
        if words[1:] not in ([], [OPERATOR]):
            raise ValueError(f"{source}:{n}: after the hash only the word {OPERATOR!r} may follow, got {words[1]!r}")
        if digest in seen:
            raise ValueError(f"{source}:{n}: the same key is already on line {seen[digest]}")
        seen[digest] = n
        keys.append(ApiKey(digest, len(words) > 1, n, bytes.fromhex(digest)))
    if not keys:
        raise ValueError(f"{source}: no keys (every request would be refused); add a line with "
                         "pdserve certs hash-key")
    return keys


class KeyRing:
    """The API keys a server accepts, from its keys file; re-read when the file changes
    (checked at most every `reload_s`), so keys are added and revoked without a restart.
    A changed file that does not parse is logged and the keys in force stay."""

    def __init__(self, path: str | os.PathLike, reload_s: float = 1.0):
        self.path = Path(path)
        self.reload_s = reload_s
        self._stamp = self._stat()
        self.keys = parse_keys(self.path.read_text(), str(self.path))
        self._checked = time.monotonic()

    def identify(self, presented: str) -> ApiKey | None:
        """The key `presented` is, or None. Compares hashes in constant time against every
        key (no early exit), so timing says nothing about which digits matched."""
        self._maybe_reload()
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for key in self.keys:
            if hmac.compare_digest(key._digest_bytes, digest):
                found = key
        return found

    def _stat(self) -> tuple[int, int]:
        st = self.path.stat()
        return st.st_mtime_ns, st.st_size

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_s:
            return
        self._checked = now
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            keys = parse_keys(self.path.read_text(), str(self.path))
        except (OSError, ValueError) as exc:
            log.error("API keys file %s: %s; keeping the %d keys in force", self.path, exc, len(self.keys))
            return
        log.info("API keys file %s reloaded: %d keys (%d operator)", self.path, len(keys),
                 sum(k.operator for k in keys))
        self.keys = keys


@dataclass(frozen=True)
class ClientTLS:
    """What an internal caller (launcher, demo) needs to reach a worker serving TLS: the CA
    to verify the worker with (None: the system's trust store) and, when the worker
    requires client certificates, the certificate to present."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # the name the server's certificate must carry (None: the address dialled)


def internal_client_tls(security: "SecuritySpec | None", resolve=lambda p: p) -> ClientTLS | None:
    """How the cluster's own tools connect to its decode workers; None: plaintext.

    They verify the workers with `tls.ca` (default `tls.client_ca`) and, under mutual TLS,
    present the workers' own certificate (it must allow client authentication, as the
    ones `pdserve certs make` writes do). `resolve` maps a topology path to a file."""
    tls = security.tls if security is not None else None
    if tls is None:
        return None
    ca = tls.ca or tls.client_ca
    mutual = tls.client_ca is not None
    return ClientTLS(ca_file=str(resolve(ca)) if ca else None,
                     cert_file=str(resolve(tls.cert)) if mutual else None,
                     key_file=str(resolve(tls.key)) if mutual else None, server_name=tls.server_name)


def grpc_channel(target: str, tls: ClientTLS | None):
    """A blocking gRPC channel to `target`, over TLS when `tls` is set (for health checks)."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(target)
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(root_certificates=read(tls.ca_file), private_key=read(tls.key_file),
                                         certificate_chain=read(tls.cert_file))
    return grpc.secure_channel(target, creds, options=server_name_options(tls.server_name))


def server_name_options(server_name: str | None) -> list[tuple[str, str]]:
    """gRPC channel options that check the server's certificate for `server_name` instead of
    the address dialled (none for None)."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []
