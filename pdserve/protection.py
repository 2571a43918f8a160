"""What a topology protects, surface by surface (docs/security.md, "What is protected").

`surfaces(topology)` says, for each way into the cluster, whether the topology protects it
and how: `pdserve status` prints it. Every socket a process of the cluster listens on belongs
to one of them, Ray's own included (tests/e2e/test_listening_sockets.py lists a running
cluster's listeners and fails on one that no surface names; docs/security.md, "Every
listening socket"). `exposure_warnings(topology, ...)` lists what is reachable from other
hosts without protection: `pdserve up` and `pdserve worker` print each at start. Both read
only the topology (pure: no socket, no file read), so they say what is configured, not what
a running process does; the workers enforce it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass

from pdserve.cluster.netaddr import LOOPBACK

YES, PARTLY, NO = "yes", "partly", "no"


@dataclass(frozen=True)
class Surface:
    """One way into the cluster: `protected` is yes/partly/no, `how` says by what (or what
    is open), `setting` what to set to protect it further ("" when nothing can)."""

    name: str
    protected: str
    how: str
    setting: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def surfaces(topology) -> list[Surface]:
    """Every surface of `topology`, in the order docs/security.md lists them."""
    gate = [_etcd_gate(topology)] if topology.etcd.gate is not None else []
    return [_decode(topology), _etcd(topology), *gate, _queue(topology), _ray(topology), _nixl(topology),
            *_kv_events(topology), *_metrics(topology), _ray_metrics(topology)]


def exposure_warnings(topology, ray_address: str | None = None) -> list[str]:
    """One line per surface served to other hosts without protection: the servers bind a
    non-loopback address (`network.bind`), or etcd / Ray are reached at another host."""
    out = []
    bind = topology.network.bind
    remote = not is_loopback(bind)
    where = f"network.bind {bind!r}"
    if remote and topology.security.tls is None:
        out.append(f"decode workers serve gRPC and HTTP on {where} without TLS: prompts, completions and API "
                   "keys cross the network in clear text; set security.tls (docs/security.md)")
    etcd_remote = remote if topology.embedded_etcd else not all(is_loopback(e.rpartition(":")[0])
                                                                for e in topology.etcd.endpoints)
    if etcd_remote and topology.etcd.tls is None:
        at = where if topology.embedded_etcd else f"etcd.endpoints {','.join(topology.etcd.endpoints)}"
        out.append(f"etcd is reachable at {at} without TLS or authentication: anyone who reaches it can drain "
                   "workers, rewrite the router policy and register fake workers; set etcd.tls")
    ray_host = (ray_address or topology.ray.address or "").rpartition(":")[0]
    ray_remote = remote or (ray_host not in ("", "auto") and not is_loopback(ray_host))
    if ray_remote and topology.ray.auth != "token":
        out.append("Ray runs across hosts without token authentication: whoever reaches its ports can run code "
                   "in every worker; set ray.auth: token")
    if topology.queue.wire == "node" and getattr(topology.queue, "tls", None) is None:
        out.append("the prefill queue serves its wire on the Ray head's address in clear text (its token and "
                   "the tasks' token ids); set queue.tls")
    return out


def is_loopback(host_or_bind: str) -> bool:
    """A bind setting or host that only this host reaches: loopback, localhost, 127.x, ::1."""
    host = host_or_bind.strip("[]")
    if host in (LOOPBACK, "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _decode(t) -> Surface:
    tls, keys = t.security.tls, t.security.api_keys
    parts = []
    if tls is not None:
        parts.append("TLS with client certificates (mutual TLS)" if tls.client_ca else "TLS")
    if keys is not None:
        parts.append(f"API keys ({keys.file})")
    if not parts:
        return Surface("decode gRPC/HTTP", NO, "plaintext, no authentication: anyone who reaches the ports",
                       "security.tls, security.api_keys")
    if keys is not None:
        opened = [*t.security.open_paths, *t.security.open_grpc_services]
        parts.append(f"open without a key: {', '.join(opened) if opened else 'nothing'}")
    missing = [s for s, v in (("security.tls", tls), ("security.api_keys", keys)) if v is None]
    full = tls is not None and (keys is not None or tls.client_ca)
    return Surface("decode gRPC/HTTP", YES if full else PARTLY, "; ".join(parts), ", ".join(missing))


def _etcd(t) -> Surface:
    # The embedded etcd (`pdserve up`) has two listeners on network.bind, protected alike.
    where = f"; its client and peer listeners on network.bind {t.network.bind}" if t.embedded_etcd else ""
    if t.etcd.tls is None:
        return Surface("etcd", NO, "plaintext, no authentication: anyone who reaches it can drain workers and "
                       f"rewrite policies{where}", "etcd.tls")
    ids = [i for i in ("root", "operator", "worker", "reader") if getattr(t.etcd.tls, i) is not None]
    if t.etcd.tls.workers is not None:
        ids.append("one per worker")
    how = f"TLS, client certificates, RBAC (identities here: {', '.join(ids) or 'none'}){where}"
    if t.etcd.gate is not None:
        return Surface("etcd", YES, f"{how}; workers and the reader have no grants here: they reach it through the "
                       "etcd gate (etcd itself still renews any lease for any certificate of its CA that reaches it)")
    return Surface("etcd", PARTLY, f"{how}; etcd's RBAC covers keys, not leases: any identity may keep alive or "
                   "read any lease and compact the store", "etcd.gate")


def _etcd_gate(t) -> Surface:
    where = (f"at {', '.join(t.etcd.gate.endpoints)} (etcd.gate.endpoints: yours)" if t.etcd.gate.endpoints else
             f"supervised by `pdserve up` (restarted if it dies), on network.bind {t.network.bind}")
    return Surface("etcd gate", YES, "mutual TLS (the etcd CA); serves worker identities and the reader only, each "
                   f"scoped to its own keys and leases, no compaction or lease listing (cluster/etcd_gate.py); {where}")


def _queue(t) -> Surface:
    q = t.queue
    if q.wire == "off":
        return Surface("prefill queue wire", YES if t.ray.auth == "token" else NO,
                       "no wire: queue calls go through Ray (as protected as Ray)",
                       "" if t.ray.auth == "token" else "ray.auth")
    tls = getattr(q, "tls", None)
    if tls is None:
        return Surface("prefill queue wire", PARTLY, f"plaintext on {q.wire}, token only (sent in clear text)",
                       "queue.tls")
    return Surface("prefill queue wire", YES,
                   f"{'mutual TLS' if tls.client_ca else 'TLS'} on {q.wire}, token")


# Ray's own listeners: what every Ray node serves, whatever the topology says.
RAY_LISTENERS = ("GCS, raylet, object manager, runtime-env agent, Ray client server (head, port 10001) "
                 "and each worker's and actor's port")
RAY_BINDS = "on every interface (or the node's address), whatever network.bind says"


def _ray(t) -> Surface:
    if t.ray.auth == "token":
        src = f"token from ray.token_file ({t.ray.token_file})" if t.ray.token_file else \
            "token from RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token"
        return Surface("Ray", YES, f"token authentication, {src}, on {RAY_LISTENERS}; not encrypted; "
                       f"they listen {RAY_BINDS}")
    return Surface("Ray", NO, f"no authentication on {RAY_LISTENERS}, which listen {RAY_BINDS}: whoever "
                   "reaches them runs code in every worker", "ray.auth: token")


def _nixl(t) -> Surface:
    transport = getattr(t.network, "kv_transport", None)
    devices = f", devices {transport.devices}" if transport is not None and hasattr(transport, "devices") else ""
    return Surface("NIXL data plane (KV pages)", NO,
                   f"each worker's UCX listeners (the main one's port is in the worker's NIXL metadata in "
                   f"etcd; a prefill worker's posting threads' are its record's ucx_* endpoints): no "
                   f"authentication or encryption by design: keep its network private "
                   f"(network.bind {t.network.bind}{devices})")


def _kv_events(t) -> list[Surface]:
    """Workers whose engine records KV events (engine arg kv_events) publish them."""
    if not any(getattr(t.roles, r).engine.get("kv_events") for r in ("prefill", "decode")):
        return []
    return [Surface("KV events", NO, f"each worker's PUB and replay sockets (its record's kv_events endpoints) on "
                    f"network.bind {t.network.bind}: no authentication; they carry the token ids of cached "
                    "prompts: keep them on a private network (docs/kvindex.md)")]


def _metrics(t) -> list[Surface]:
    """The Prometheus endpoints that no security setting covers (scrapers connect without
    credentials): what they expose and where they listen, so an operator can firewall them."""
    queue_at = "the Ray head's address" if t.queue.wire == "node" else "loopback on the Ray head"
    return [
        Surface("prefill /metrics", NO, f"plaintext and open on network.bind {t.network.bind} "
                "(load and counters only)"),
        Surface("queue /metrics", NO, f"plaintext and open on {queue_at} (depth, waits, counters; no token ids)"),
        Surface("planner /metrics", NO, f"plaintext and open on network.bind {t.network.bind} "
                "(desired and actual replicas, decisions)"),
    ]


def _ray_metrics(t) -> Surface:
    """The Prometheus endpoint of Ray's autoscaler monitor, a process of every Ray head: no
    pdserve or Ray setting protects it (Ray's AUTOSCALER_METRIC_PORT only moves it)."""
    head = f"the Ray head ({t.ray.address})" if t.ray.address else "the Ray head"
    return Surface("Ray autoscaler /metrics", NO,
                   f"plaintext and open on {head}, port 44217 (AUTOSCALER_METRIC_PORT), every interface whatever "
                   "network.bind says (node counts, pending and failed nodes, resources; no tokens): firewall it")
