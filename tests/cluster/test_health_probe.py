"""cluster/health_probe.py, the chart's exec probe for a decode worker under mutual TLS, against
a real TLS server that requires client certificates (as the decode worker's HTTP does)."""

from __future__ import annotations

import http.server
import ssl
import threading

import pytest

from pdserve.certs import make_certs
from pdserve.cluster.health_probe import main, probe


@pytest.fixture(scope="module")
def mutual_tls_server(tmp_path_factory):
    """HTTPS on loopback requiring a client certificate from the test CA: /health 200, /draining 503."""
    certs = make_certs(tmp_path_factory.mktemp("certs"), ["127.0.0.1", "localhost"])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs["ca"]))
    ctx.load_cert_chain(certs["decode"], certs["decode-key"])
    ctx.verify_mode = ssl.CERT_REQUIRED
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", certs
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_the_probe_passes_presenting_the_workers_certificate(mutual_tls_server):
    url, certs = mutual_tls_server
    assert main([f"{url}/health", "--cert", str(certs["decode"]), "--key", str(certs["decode-key"])]) == 0
    # --ca verifies the chain (the name is not checked: the probe dials 127.0.0.1).
    assert probe(f"{url}/health", str(certs["decode"]), str(certs["decode-key"]), ca=str(certs["ca"]))[0]


def test_the_probe_fails_on_a_503_and_without_a_client_certificate(mutual_tls_server, capsys):
    url, certs = mutual_tls_server
    assert main([f"{url}/draining", "--cert", str(certs["decode"]), "--key", str(certs["decode-key"])]) == 1
    assert "HTTP 503" in capsys.readouterr().err
    healthy, what = probe(f"{url}/health")
    assert not healthy and "Error" in what  # the handshake fails: no client certificate


def test_check_validates_the_arguments_without_probing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["http://127.0.0.1:8000/health", "--check"])  # not https
    with pytest.raises(SystemExit):
        main(["https://127.0.0.1:8000/health", "--cert", str(tmp_path / "missing.pem"), "--key", "k", "--check"])
    assert "no such file" in capsys.readouterr().err
