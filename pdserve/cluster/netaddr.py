"""Which address a pdserve server binds and advertises, and which UCX settings go with it.

A topology's `network.bind` says where every server of a worker (gRPC, HTTP,
metrics, the queue wire, embedded etcd) listens, and so which address is
written to etcd for peers to reach:

    loopback        127.0.0.1: a one-host cluster (the default)
    node            this Ray node's address (what `ray start --node-ip-address` set)
    <interface>     the IPv4 address of that interface, e.g. eth0
    <CIDR>          this host's address inside that network, e.g. 10.0.0.0/8
    <IPv4>          exactly that address (it must be one of this host's)

`ucx_env` builds the UCX settings of a NIXL agent from the topology's
`network.kv_transport` and the same choice: devices `auto` keeps UCX on `lo`
on loopback and otherwise on the interface that holds the bound address
(UCX_NET_DEVICES), so the KV pages take the network the operator chose;
`rdma: false` (the default) excludes UCX's InfiniBand modules; `transports`
sets UCX_TLS. The topology's `network.ucx` is applied last. An empty value
removes a setting from the agent's environment, inherited ones included.
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct

LOOPBACK = "loopback"
NODE = "node"
LOOPBACK_ADDRESS = "127.0.0.1"
# UCX_MODULES without RDMA (kv_transport.rdma false): a process can segfault at exit (rc 139)
# where RDMA libraries are installed but no RDMA device is used.
NO_RDMA_MODULES = "^ib"
_SIOCGIFADDR = 0x8915
_INTERFACE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


class BindError(ValueError):
    """A bind setting this host cannot satisfy (the message says what it has)."""


def check_bind(spec: str) -> str:
    """Validate the form of a bind setting (not whether this host has it); returns it."""
    if spec in (LOOPBACK, NODE):
        return spec
    try:
        if "/" in spec:
            ipaddress.IPv4Network(spec, strict=False)
        else:
            ipaddress.IPv4Address(spec)
        return spec
    except ValueError:
        pass
    if _INTERFACE.match(spec) and not spec[0].isdigit():
        return spec
    raise BindError(f"bind {spec!r}: use loopback, node, an interface name (eth0), a CIDR (10.0.0.0/8) "
                    "or an IPv4 address of this host")


def interface_addresses() -> dict[str, str]:
    """IPv4 address of every interface of this host (network namespace) that has one."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


def route_address(peer: str) -> str:
    """The local address this host uses to reach ``peer`` ("ip" or "ip:port"); no packet is sent."""
    host = peer.rsplit(":", 1)[0] if peer.count(":") == 1 else peer
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def resolve_bind(spec: str, *, ray_address: str | None = None) -> str:
    """The address to bind for ``spec`` on this host. ``node`` is Ray's node address when
    this process is connected to Ray, else the address that routes to ``ray_address``."""
    check_bind(spec)
    if spec == LOOPBACK:
        return LOOPBACK_ADDRESS
    addrs = interface_addresses()
    if spec == NODE:
        try:
            import ray

            if ray.is_initialized():
                return ray.util.get_node_ip_address()
        except ImportError:
            pass
        if ray_address:
            return route_address(ray_address)
        raise BindError("bind 'node': not connected to Ray and no Ray address to route to; "
                        f"name an interface or a CIDR instead (this host has {_describe(addrs)})")
    if "/" in spec:
        net = ipaddress.IPv4Network(spec, strict=False)
        inside = [a for a in addrs.values() if ipaddress.IPv4Address(a) in net]
        if not inside:
            raise BindError(f"bind {spec!r}: no address of this host is inside it ({_describe(addrs)})")
        return inside[0]
    if spec in addrs:
        return addrs[spec]
    if spec in addrs.values():
        return spec
    raise BindError(f"bind {spec!r}: not an interface or address of this host ({_describe(addrs)})")


def interface_of(address: str) -> str | None:
    """The interface holding ``address`` on this host."""
    return next((name for name, a in interface_addresses().items() if a == address), None)


def ucx_env(address: str, overrides: dict[str, str] | None = None, *, rdma: bool = False,
            devices: str = "auto", transports: str | None = None) -> dict[str, str]:
    """UCX settings for a NIXL agent whose worker is bound to ``address`` (module docstring).
    A value "" means: remove that variable from the agent's environment."""
    env = {"UCX_MODULES": "" if rdma else NO_RDMA_MODULES}
    if devices == "auto":
        device = "lo" if address == LOOPBACK_ADDRESS else interface_of(address)
        if device:
            env["UCX_NET_DEVICES"] = device
    else:
        env["UCX_NET_DEVICES"] = "" if devices == "all" else devices
    if transports:
        env["UCX_TLS"] = transports
    env.update(overrides or {})
    return env


def _describe(addrs: dict[str, str]) -> str:
    return ", ".join(f"{n} {a}" for n, a in sorted(addrs.items())) or "no IPv4 interface"
