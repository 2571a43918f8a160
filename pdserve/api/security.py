"""Who may use a decode worker's or a gateway's surfaces: TLS (optionally mutual) for gRPC and HTTP, API
keys as ``Authorization: Bearer <key>`` (HTTP) or ``authorization`` metadata (gRPC).

`ServerSecurity` is built from the worker's config; `ApiKeyAuth` (ASGI middleware) and
`ApiKeyInterceptor` (grpc.aio) refuse a missing or unknown key (401 / UNAUTHENTICATED)
before any body is read, except on the open paths and services, and hand the caller's
`ApiKey` on (HTTP: ``request.state.caller``; gRPC: `caller_of` reads the metadata again).
Privileges (route overrides, raised priority, whose requests Abort may end) follow from
that key in the frontend. Nothing here logs or echoes a presented key.

An operator key may act for a tenant: ``x-pdserve-tenant: <identity>`` (a gateway sends its
client's key identity, ``key:<12 hex>``) makes that the request's identity (per-key fairness
in the scheduler, the per-key sequence share, request-id namespaces) while the privileges
stay the operator key's. A plain key that sends it is refused (403 / PERMISSION_DENIED): it
could otherwise pose as another tenant; one naming a client address (``addr:...``, what a
gateway without keys forwards) is ignored instead, so that such a gateway keeps working with a
plain worker key.

With keys off every caller has every privilege, as before, but is still a tenant of its own
for the per-tenant caps and the scheduler's turns: a `Client`, named by its network address
(`client_address`: gRPC ``context.peer()``, HTTP the ASGI client, which uvicorn takes from
``X-Forwarded-For`` only when a trusted proxy sent it). ``x-pdserve-tenant`` is then honoured
only from the same trusted proxies (`TrustedProxies`, uvicorn's ``FORWARDED_ALLOW_IPS``,
loopback by default): there is no key to trust, so the caller's address is what is trusted.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.cluster.security import ANONYMOUS, DEFAULT_OPEN_GRPC_SERVICES, DEFAULT_OPEN_PATHS, ApiKey, KeyRing

from .http_guard import openai_error, send_json

log = logging.getLogger(__name__)

BEARER = "bearer"
WWW_AUTHENTICATE = 'Bearer realm="pdserve"'
TENANT_HEADER = "x-pdserve-tenant"  # an operator key acting for a tenant (module docstring)
# A key identity (key:<12 hex>) or a client address (addr:10.0.0.7, addr:2001:db8::/64).
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._@/-]{0,63}$")
ADDRESS_TENANT = "addr:"  # the prefix of a tenant that is a client's address (`Client`)
# uvicorn's setting and default: whose X-Forwarded-For it believes (HTTP); here also whose
# x-pdserve-tenant is believed while API keys are off (both APIs)
FORWARDED_ALLOW_IPS = "FORWARDED_ALLOW_IPS"
DEFAULT_TRUSTED_PROXIES = "127.0.0.1,::1"
# IPv6 clients are grouped by their /64: one host (a home router's, a VM's) gets a whole /64 and
# privacy addressing rotates through it, so a /128 would let one client be many tenants.
IPV6_CLIENT_PREFIX = 64


def client_address(host: str | None) -> str | None:
    """The address that identifies a client while API keys are off: an IPv4 address (an
    IPv4-mapped IPv6 one as IPv4), an IPv6 address's /64 (its loopback as itself); None for
    what is not an IP address (a Unix socket, a test client without one)."""
    if not host:
        return None
    host = host.strip().strip("[]").split("%", 1)[0]  # brackets of a URL form, an IPv6 zone
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6 and not ip.is_loopback:
        return str(ipaddress.ip_network(f"{ip}/{IPV6_CLIENT_PREFIX}", strict=False))
    return str(ip)


def grpc_peer_host(peer: str | None) -> str | None:
    """The host part of a gRPC ``context.peer()``: ``ipv4:10.0.0.7:5000`` -> ``10.0.0.7``,
    ``ipv6:[::1]:5000`` (or its percent-encoded form) -> ``::1``; None for ``unix:`` and the like."""
    if not peer:
        return None
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]") if rest.startswith("[") else rest
    return None


@dataclass(frozen=True)
class Client:
    """A caller while API keys are off. Nothing is checked then (every caller may do what an
    operator key may, as before), but each client is a tenant of its own: ``tenant`` is
    ``addr:<its address>`` (`client_address`), or what a trusted proxy named for it
    (``x-pdserve-tenant``). Request ids stay in the one namespace of a keys-off worker
    (``identity`` None), so any client may still abort any request by its id."""

    tenant: str
    operator: bool = True
    identity = None  # whose request-id namespace: the keys-off one (api/surface.py `identity`)


class TrustedProxies:
    """The peers whose word on who their client is counts (``x-pdserve-tenant`` while keys are
    off): uvicorn's ``FORWARDED_ALLOW_IPS`` (comma-separated addresses and networks, ``*`` for
    any), the same list by which uvicorn believes ``X-Forwarded-For``; loopback by default."""

    def __init__(self, spec: str | None = None):
        spec = os.environ.get(FORWARDED_ALLOW_IPS, DEFAULT_TRUSTED_PROXIES) if spec is None else spec
        self.spec = spec
        self.any = False
        self.networks: list = []
        for item in (x.strip() for x in spec.split(",")):
            if item == "*":
                self.any = True
            elif item:
                try:
                    self.networks.append(ipaddress.ip_network(item, strict=False))
                except ValueError:  # a host name or a socket path (uvicorn's literals): never an IP peer
                    continue

    def __contains__(self, host: str | None) -> bool:
        if self.any:
            return True
        try:
            ip = ipaddress.ip_address((host or "").strip("[]").split("%", 1)[0])
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.networks)


class Unauthenticated(Exception):
    """A request without a valid key; the message says what to send, never what was sent."""


class Forbidden(Exception):
    """A valid key asking for what it may not (a plain key sending ``x-pdserve-tenant``), or a
    malformed tenant; ``status`` is the HTTP code (403 or 400)."""

    def __init__(self, message: str, status: int = 403):
        super().__init__(message)
        self.status = status

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return grpc.StatusCode.PERMISSION_DENIED if self.status == 403 else grpc.StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate chain and key, and the CA its clients' certificates must
    chain to (mutual TLS) when set."""

    cert: str
    key: str
    client_ca: str | None = None


@dataclass
class ServerSecurity:
    """One worker's security settings, loaded and checked at start."""

    tls: TlsFiles | None = None
    keys: KeyRing | None = None
    open_paths: frozenset[str] = frozenset(DEFAULT_OPEN_PATHS)
    open_grpc_services: frozenset[str] = field(default_factory=lambda: frozenset(DEFAULT_OPEN_GRPC_SERVICES))
    # Keys off: whose x-pdserve-tenant counts (read from the environment when the worker starts)
    trusted_proxies: TrustedProxies = field(default_factory=TrustedProxies)

    @classmethod
    def from_config(cls, cfg) -> "ServerSecurity":
        """From a DecodeWorkerConfig's tls_* / api_keys_file / open_* fields (files are read
        now: a missing or bad one fails the start, naming the setting)."""
        tls = None
        if cfg.tls_cert or cfg.tls_key:
            if not (cfg.tls_cert and cfg.tls_key):
                raise ValueError("tls_cert and tls_key: set both (security.tls.cert and .key) or neither")
            for name in ("tls_cert", "tls_key", "tls_client_ca"):
                path = getattr(cfg, name)
                if path and not Path(path).is_file():
                    raise FileNotFoundError(f"{name}: {path}: no such file")
            tls = TlsFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        elif cfg.tls_client_ca:
            raise ValueError("tls_client_ca: needs tls_cert and tls_key (mutual TLS is TLS first)")
        keys = KeyRing(cfg.api_keys_file) if cfg.api_keys_file else None
        return cls(tls, keys, frozenset(cfg.open_paths), frozenset(cfg.open_grpc_services))

    # -- keys -------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The caller an ``Authorization`` value names; None when keys are off;
        Unauthenticated when keys are on and it names none."""
        if self.keys is None:
            return None
        if not authorization:
            raise Unauthenticated("Authorization: missing; send 'Authorization: Bearer <API key>'")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != BEARER or not token:
            raise Unauthenticated("Authorization: expected 'Bearer <API key>'")
        key = self.keys.identify(token)
        if key is None:
            raise Unauthenticated("Authorization: the API key is not valid for this server")
        return key

    def on_behalf_of(self, key: ApiKey | None, tenant: str | None) -> ApiKey | None:
        """``key`` acting for ``tenant`` (the ``x-pdserve-tenant`` value; None: not sent).
        Forbidden for a plain key or a malformed value; keys off: the header is ignored."""
        if key is None or tenant is None:
            return key
        if not key.operator and tenant.startswith(ADDRESS_TENANT):
            # What a gateway without keys of its own forwards (its client's address): it poses
            # as nobody's key, and refusing it would break such a gateway with a plain worker key.
            return key
        if not key.operator:
            raise Forbidden(f"{TENANT_HEADER}: only an operator API key may act for a tenant; send the request "
                            "without this header (a gateway sends it: give it an operator --worker-api-key, or "
                            "start it with --no-forward-tenant)")
        if not _TENANT.match(tenant):
            raise Forbidden(f"{TENANT_HEADER}: expected 1-64 characters of letters, digits and ':._@-' "
                            "(a key identity such as key:0123456789ab)", 400)
        return dataclasses.replace(key, on_behalf_of=tenant)

    def client(self, host: str | None, tenant: str | None = None) -> Client | None:
        """The caller while keys are off: the client at ``host`` (its address, `client_address`),
        or the tenant a trusted proxy at ``host`` names (``x-pdserve-tenant``; a malformed one is
        ignored). None when the address is unknown: the one anonymous tenant of before."""
        if tenant is not None and _TENANT.match(tenant) and host in self.trusted_proxies:
            return Client(tenant)
        address = client_address(host)
        return None if address is None else Client(ADDRESS_TENANT + address)

    def caller_of_metadata(self, metadata, peer: str | None = None) -> ApiKey | Client | None:
        """The caller of a gRPC call whose key the interceptor already checked
        (ANONYMOUS on an open service without a valid key), acting for the tenant it names.
        Keys off: the client at ``peer`` (``context.peer()``), see `client`."""
        md = first_values(metadata)
        if self.keys is None:
            return self.client(grpc_peer_host(peer), md.get(TENANT_HEADER))
        try:
            return self.on_behalf_of(self.authenticate(md.get("authorization")), md.get(TENANT_HEADER))
        except (Unauthenticated, Forbidden):
            return ANONYMOUS

    # -- TLS --------------------------------------------------------------------------
    def grpc_credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        t = self.tls
        return grpc.ssl_server_credentials(
            [(Path(t.key).read_bytes(), Path(t.cert).read_bytes())],
            root_certificates=Path(t.client_ca).read_bytes() if t.client_ca else None,
            require_client_auth=t.client_ca is not None)

    def uvicorn_ssl(self) -> dict:
        """uvicorn.Config keywords: TLS, and client certificates required under mutual TLS."""
        if self.tls is None:
            return {}
        t = self.tls
        return {"ssl_certfile": t.cert, "ssl_keyfile": t.key, "ssl_ca_certs": t.client_ca,
                "ssl_cert_reqs": ssl.CERT_REQUIRED if t.client_ca else ssl.CERT_NONE}

    def warn_if_plaintext(self, host: str, worker_id: str) -> bool:
        """Log once (per start) that a non-loopback address is served without TLS."""
        if self.tls is not None or _is_loopback(host):
            return False
        log.warning("decode worker %s serves gRPC and HTTP on %s without TLS: prompts, completions%s cross the "
                    "network in clear text; set security.tls in the topology (serve-decode: --tls-cert/--tls-key)",
                    worker_id, host, " and API keys" if self.keys is not None else "")
        return True


def first_values(pairs) -> dict[str, str]:
    """Metadata or header (key, value) pairs as a dict, the first value of a repeated key winning."""
    out: dict[str, str] = {}
    for k, v in pairs or ():
        out.setdefault(k, v)
    return out


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiKeyAuth:
    """ASGI middleware: a request without a valid API key gets 401 before its body is read
    (open paths pass, as ANONYMOUS unless they carry a valid key); the caller's `ApiKey`
    goes to ``request.state.caller`` (keys off: its `Client`)."""

    def __init__(self, app, security: ServerSecurity):
        self.app = app
        self.security = security

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = first_values((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                               if k in (b"authorization", TENANT_HEADER.encode()))
        if self.security.keys is None:  # no key to check: the client is its address (`ServerSecurity.client`)
            peer = scope.get("client")
            scope.setdefault("state", {})["caller"] = self.security.client(peer[0] if peer else None,
                                                                           headers.get(TENANT_HEADER))
            return await self.app(scope, receive, send)
        try:
            caller = self.security.authenticate(headers.get("authorization"))
        except Unauthenticated as exc:
            if scope["path"] not in self.security.open_paths:
                return await send_json(send, openai_error(401, str(exc), headers={
                    "WWW-Authenticate": WWW_AUTHENTICATE}))
            caller = ANONYMOUS
        try:
            caller = self.security.on_behalf_of(caller, headers.get(TENANT_HEADER))
        except Forbidden as exc:
            return await send_json(send, openai_error(exc.status, str(exc), param=TENANT_HEADER))
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call without a valid ``authorization: Bearer <key>`` with UNAUTHENTICATED
    before its request is parsed; open services (health by default) pass."""

    def __init__(self, security: ServerSecurity):
        self.security = security

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        service = details.method.lstrip("/").split("/", 1)[0]
        if handler is None or self.security.keys is None or service in self.security.open_grpc_services:
            return handler
        md = first_values(details.invocation_metadata)
        try:
            self.security.on_behalf_of(self.security.authenticate(md.get("authorization")), md.get(TENANT_HEADER))
        except Unauthenticated as exc:
            return _refusal(handler, str(exc))
        except Forbidden as exc:
            return _refusal(handler, str(exc), exc.grpc_code)
        return handler


def _refusal(handler: grpc.RpcMethodHandler, message: str,
             code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers ``code``; requests are left as
    bytes (no deserializer): nothing of a refused call is parsed."""

    async def refuse(request_or_iterator, context):
        await context.abort(code, message)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](
        refuse, request_deserializer=None, response_serializer=handler.response_serializer)
