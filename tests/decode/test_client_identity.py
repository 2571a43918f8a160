"""Who a client is while API keys are off (api/security.py `Client`): its address, as the
gRPC peer or the HTTP client names it, or the tenant a trusted proxy names for it. Pure: no
worker (tests/decode/test_tenant_limits.py serves through one)."""

from __future__ import annotations

import pytest

from pdserve.certs import append_key, new_key
from pdserve.api.security import Forbidden, ServerSecurity, TrustedProxies, client_address, grpc_peer_host
from pdserve.decode.worker import DecodeWorkerConfig


@pytest.mark.parametrize("peer, tenant", [
    ("ipv4:10.0.0.7:40000", "addr:10.0.0.7"),
    ("ipv6:[::1]:40000", "addr:::1"),
    ("ipv6:%5B::ffff:10.0.0.7%5D:40000", "addr:10.0.0.7"),  # IPv4 on a dual-stack socket
    ("ipv6:[2001:db8:1:2:aaaa::5]:40000", "addr:2001:db8:1:2::/64"),  # one /64, one client
    ("unix:/run/pdserve.sock", None),  # no address: the one anonymous tenant, as before
])
def test_a_grpc_peer_names_its_client(peer, tenant):
    caller = ServerSecurity(trusted_proxies=TrustedProxies("")).caller_of_metadata([], peer)
    assert (caller.tenant if caller else None) == tenant
    if caller:
        assert caller.operator and caller.identity is None  # keys off: nothing checked, one id namespace


def test_only_a_trusted_proxy_names_the_tenant_without_keys():
    sec = ServerSecurity(trusted_proxies=TrustedProxies("127.0.0.1,10.1.0.0/16"))
    forwarded = [("x-pdserve-tenant", "addr:203.0.113.9")]
    assert sec.caller_of_metadata(forwarded, "ipv4:10.1.2.3:5000").tenant == "addr:203.0.113.9"  # a gateway
    assert sec.caller_of_metadata(forwarded, "ipv4:10.2.0.1:5000").tenant == "addr:10.2.0.1"  # anyone else
    assert sec.caller_of_metadata([("x-pdserve-tenant", "bad value!")], "ipv4:127.0.0.1:1").tenant == "addr:127.0.0.1"
    assert client_address(grpc_peer_host("ipv4:127.0.0.2:9")) == "127.0.0.2"


def test_with_keys_a_plain_key_forwarding_an_address_is_ignored_and_an_operator_key_is_honoured(tmp_path):
    """What a gateway without keys of its own forwards (addr:...) makes no one's key its own:
    from a plain worker key it is ignored (such a gateway keeps working), from an operator key
    it is the request's tenant; a plain key naming a key identity is still refused."""
    plain, operator = new_key(), new_key()
    append_key(tmp_path / "keys", plain)
    append_key(tmp_path / "keys", operator, operator=True)
    sec = ServerSecurity.from_config(DecodeWorkerConfig(model="m", api_keys_file=str(tmp_path / "keys")))
    user = sec.authenticate(f"Bearer {plain}")
    assert sec.on_behalf_of(user, "addr:203.0.113.9") is user
    with pytest.raises(Forbidden):
        sec.on_behalf_of(user, "key:0123456789ab")
    assert sec.on_behalf_of(sec.authenticate(f"Bearer {operator}"), "addr:203.0.113.9").identity == "addr:203.0.113.9"
