"""A decode worker's security settings without a server: `pdserve serve-decode` flags, the
checks made before the engine loads, and the warning for a non-loopback address without TLS."""

from __future__ import annotations

import logging

import pytest

from pdserve.certs import append_key, make_certs, new_key
from pdserve.cli import build_parser
from pdserve.cluster.security import DEFAULT_OPEN_PATHS
from pdserve.decode.cli import _names
from pdserve.api.security import ServerSecurity, Unauthenticated
from pdserve.decode.worker import DecodeWorkerConfig


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return {k: str(v) for k, v in make_certs(d).items()}


def test_serve_decode_takes_the_security_flags():
    args = build_parser().parse_args([
        "serve-decode", "--model", "m", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
        "--api-keys-file", "keys.txt", "--open-paths", "/health, /metrics,/v1/models"])
    assert (args.tls_cert, args.tls_key, args.tls_client_ca, args.api_keys_file) == \
        ("c.pem", "k.pem", "ca.pem", "keys.txt")
    assert _names(args.open_paths) == ["/health", "/metrics", "/v1/models"]
    plain = build_parser().parse_args(["serve-decode", "--model", "m"])
    assert plain.tls_cert is None and plain.api_keys_file is None
    assert _names(plain.open_paths) == list(DEFAULT_OPEN_PATHS)


@pytest.mark.parametrize("fields, message", [
    ({"tls_cert": "x"}, "set both"),
    ({"tls_client_ca": "x"}, "needs tls_cert and tls_key"),
    ({"tls_cert": "/nonexistent/c.pem", "tls_key": "/nonexistent/k.pem"}, "tls_cert: /nonexistent/c.pem"),
])
def test_bad_tls_settings_fail_before_the_engine_loads(fields, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        ServerSecurity.from_config(DecodeWorkerConfig(model="m", **fields))


def test_security_off_accepts_everything():
    sec = ServerSecurity.from_config(DecodeWorkerConfig(model="m"))
    assert sec.tls is None and sec.keys is None and sec.grpc_credentials() is None and sec.uvicorn_ssl() == {}
    assert sec.authenticate(None) is None and sec.authenticate("Bearer anything") is None


def test_mutual_tls_requires_client_certificates(pki):
    import ssl

    sec = ServerSecurity.from_config(DecodeWorkerConfig(model="m", tls_cert=pki["decode"], tls_key=pki["decode-key"],
                                                        tls_client_ca=pki["ca"]))
    assert sec.uvicorn_ssl()["ssl_cert_reqs"] == ssl.CERT_REQUIRED and sec.grpc_credentials() is not None
    one_way = ServerSecurity.from_config(DecodeWorkerConfig(model="m", tls_cert=pki["decode"],
                                                            tls_key=pki["decode-key"]))
    assert one_way.uvicorn_ssl()["ssl_cert_reqs"] == ssl.CERT_NONE


def test_authorization_values(tmp_path):
    key = new_key()
    append_key(tmp_path / "keys", key)
    sec = ServerSecurity.from_config(DecodeWorkerConfig(model="m", api_keys_file=str(tmp_path / "keys")))
    assert sec.authenticate(f"Bearer {key}").operator is False
    assert sec.authenticate(f"bearer  {key} ") is not None  # the scheme is case-insensitive (RFC 6750)
    for value, message in ((None, "missing"), ("", "missing"), (key, "expected 'Bearer"),
                           (f"Basic {key}", "expected 'Bearer"), (f"Bearer {key}x", "not valid")):
        with pytest.raises(Unauthenticated, match=message) as exc:
            sec.authenticate(value)
        assert key not in str(exc.value)
    assert sec.caller_of_metadata([("authorization", "Bearer nope")]).identity == "anonymous"


@pytest.mark.parametrize("host, tls, warned", [("10.0.0.7", False, True), ("0.0.0.0", False, True),
                                               ("127.0.0.1", False, False), ("::1", False, False),
                                               ("localhost", False, False), ("10.0.0.7", True, False)])
def test_plaintext_on_a_non_loopback_address_is_warned_about(pki, caplog, host, tls, warned):
    fields = {"tls_cert": pki["decode"], "tls_key": pki["decode-key"]} if tls else {}
    sec = ServerSecurity.from_config(DecodeWorkerConfig(model="m", **fields))
    with caplog.at_level(logging.WARNING, logger="pdserve.api.security"):
        assert sec.warn_if_plaintext(host, "decode-7") is warned
    records = [r for r in caplog.records if r.name == "pdserve.api.security"]
    assert len(records) == int(warned)
    if warned:
        assert "without TLS" in records[0].getMessage() and "security.tls" in records[0].getMessage()
