"""`pdserve certs` (pdserve/certs.py), the API keys file and key ring (cluster/security.py),
and the topology's `security:` section down to a decode worker's launch config."""

from __future__ import annotations

import io
import os
import textwrap
import time

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdserve.certs import append_key, make_certs, new_key
from pdserve.cli import main
from pdserve.cluster.security import (
    DEFAULT_OPEN_GRPC_SERVICES,
    DEFAULT_OPEN_PATHS,
    KeyRing,
    hash_key,
    internal_client_tls,
    parse_keys,
)
from pdserve.cluster.topology import TopologyError, load_topology
from pdserve.cluster.worker_config import launch_config

KEY = "pds-an-example-key-that-is-long-enough"


# -- certificates -----------------------------------------------------------------------
def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(open(path, "rb").read())


def test_make_certs_signs_every_role_with_one_ca_for_the_hosts(tmp_path):
    paths = make_certs(tmp_path, ["localhost", "127.0.0.1", "10.1.2.3"])
    ca = _cert(paths["ca"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for role in ("decode", "prefill", "etcd", "client"):
        cert = _cert(paths[role])
        cert.verify_directly_issued_by(ca)  # raises when not signed by the CA
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
        assert (ExtendedKeyUsageOID.SERVER_AUTH in usages) == (role != "client")
        assert oct(os.stat(paths[f"{role}-key"]).st_mode & 0o777) == "0o600"
    sans = _cert(paths["decode"]).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.1.2.3"]


def test_make_certs_does_not_replace_a_ca_unless_forced(tmp_path, capsys):
    assert main(["certs", "make", str(tmp_path), "--hosts", "127.0.0.1"]) == 0
    before = (tmp_path / "ca.pem").read_bytes()
    assert main(["certs", "make", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err and (tmp_path / "ca.pem").read_bytes() == before
    assert main(["certs", "make", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "ca.pem").read_bytes() != before


# -- API keys ---------------------------------------------------------------------------
def test_hash_key_reads_stdin_and_prints_the_keys_file_line(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(KEY + "\n"))
    assert main(["certs", "hash-key", "--operator"]) == 0
    out = capsys.readouterr().out
    assert out == f"{hash_key(KEY)}  operator\n" and KEY not in out
    assert parse_keys(out, "x")[0].operator


def test_hash_key_refuses_a_short_key(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hunter2\n"))
    assert main(["certs", "hash-key"]) == 2
    assert "at least 16" in capsys.readouterr().err


def test_new_key_appends_its_hash_and_prints_the_key_once(tmp_path, capsys):
    keys = tmp_path / "keys.txt"
    assert main(["certs", "new-key", str(keys)]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("pds-") and len(key) > 40
    assert keys.read_text() == hash_key(key) + "\n" and oct(keys.stat().st_mode & 0o777) == "0o600"
    assert KeyRing(keys).identify(key) is not None


def test_keys_file_format(tmp_path):
    text = f"""\
    # the ops team
    {hash_key('a' * 20).upper()}  operator   # case does not matter

    {hash_key('b' * 20)}
    """
    keys = parse_keys(textwrap.dedent(text), "keys.txt")
    assert [(k.line, k.operator) for k in keys] == [(2, True), (4, False)]
    assert keys[0].identity == f"key:{hash_key('a' * 20)[:12]}"


@pytest.mark.parametrize("text, message", [
    ("", "no keys"),
    ("# only a comment\n", "no keys"),
    ("sk-plaintext-key-by-mistake\n", "keys.txt:1: expected the key's SHA-256"),
    (f"{hash_key(KEY)} admin\n", "keys.txt:1: after the hash only the word 'operator'"),
    (f"{hash_key(KEY)}\n{hash_key(KEY)} operator\n", "keys.txt:2: the same key is already on line 1"),
])
def test_keys_file_errors_name_the_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_keys(text, "keys.txt")


def test_key_ring_identifies_only_listed_keys(tmp_path):
    append_key(tmp_path / "k", KEY, operator=True)
    ring = KeyRing(tmp_path / "k")
    assert ring.identify(KEY).operator
    assert ring.identify(KEY + "x") is None and ring.identify("") is None and ring.identify(hash_key(KEY)) is None


def test_key_ring_follows_the_file_and_keeps_its_keys_when_it_breaks(tmp_path, caplog):
    path, old, new = tmp_path / "keys.txt", new_key(), new_key()
    append_key(path, old)
    ring = KeyRing(path, reload_s=0.0)
    path.write_text(hash_key(new) + "\n")  # rotation: the new key in, the old one out
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a distinct mtime even on coarse clocks
    assert ring.identify(new) is not None and ring.identify(old) is None
    path.write_text("not a hash\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert ring.identify(new) is not None  # a broken file keeps the keys in force
    assert "keeping the 1 keys in force" in caplog.text and new not in caplog.text


# -- topology -> launch config ----------------------------------------------------------
TOPOLOGY = """\
cluster: sec
model:
  path: auto
roles:
  prefill:
    replicas: 0
  decode:
    replicas: 1
"""


def test_security_is_off_by_default(tmp_path):
    (tmp_path / "t.yaml").write_text(TOPOLOGY)
    topo = load_topology(tmp_path / "t.yaml")
    cfg = launch_config(topo, "decode", 0, model="/m", etcd_endpoints=[])
    assert cfg["tls_cert"] is None and cfg["tls_client_ca"] is None and cfg["api_keys_file"] is None
    assert cfg["open_paths"] == list(DEFAULT_OPEN_PATHS)
    assert cfg["open_grpc_services"] == list(DEFAULT_OPEN_GRPC_SERVICES)
    assert internal_client_tls(topo.security) is None
    assert "tls_cert" not in launch_config(topo, "prefill", 0, model="/m", etcd_endpoints=[])


def test_security_section_reaches_the_decode_config_with_resolved_paths(tmp_path):
    make_certs(tmp_path / "pki")
    append_key(tmp_path / "keys.txt", KEY)
    (tmp_path / "t.yaml").write_text(TOPOLOGY + textwrap.dedent("""\
    security:
      tls: {cert: pki/decode.pem, key: pki/decode-key.pem, client_ca: pki/ca.pem}
      api_keys: {file: keys.txt}
      open_paths: [/health]
    """))
    topo = load_topology(tmp_path / "t.yaml")
    cfg = launch_config(topo, "decode", 0, model="/m", etcd_endpoints=[])
    assert cfg["tls_cert"] == str(tmp_path / "pki" / "decode.pem")
    assert cfg["tls_client_ca"] == str(tmp_path / "pki" / "ca.pem")
    assert cfg["api_keys_file"] == str(tmp_path / "keys.txt") and cfg["open_paths"] == ["/health"]
    own = internal_client_tls(topo.security, topo.resolve)  # launcher and demo: the CA, and the worker's cert
    assert (own.ca_file, own.cert_file) == (str(tmp_path / "pki" / "ca.pem"), str(tmp_path / "pki" / "decode.pem"))


@pytest.mark.parametrize("section, where, message", [
    ("security:\n  tls: {cert: nope.pem, key: nope-key.pem}\n", "security.tls.cert", "not found"),
    ("security:\n  api_keys: {file: missing.txt}\n", "security.api_keys.file", "not found"),
    ("security:\n  tls: {cert: a.pem}\n", "security.tls.key", "Field required"),
    ("security:\n  tls: {cert: a.pem, key: b.pem, verify: true}\n", "security.tls.verify", "unknown key"),
    ("security:\n  open_paths: [health]\n", "security.open_paths", "must start with '/'"),
])
def test_bad_security_settings_name_the_key_and_line(tmp_path, section, where, message):
    (tmp_path / "t.yaml").write_text(TOPOLOGY + section)
    with pytest.raises(TopologyError) as exc:
        load_topology(tmp_path / "t.yaml")
    issue = exc.value.issues[0]
    assert issue.path == where and message in issue.message
    assert issue.line is not None and issue.line > TOPOLOGY.count("\n") and issue.column is not None


def test_the_documented_keys_file_example_parses():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    block = doc.split("The keys file holds the SHA-256 of each key, never the key:\n\n```\n", 1)[1].split("```")[0]
    assert [k.operator for k in parse_keys(block, "docs/security.md")] == [True, False]


def test_queue_tls_reaches_the_queue_actor_and_every_worker_with_resolved_paths(tmp_path):
    make_certs(tmp_path / "pki")
    (tmp_path / "t.yaml").write_text(TOPOLOGY + textwrap.dedent("""\
    queue:
      tls: {cert: pki/queue.pem, key: pki/queue-key.pem, ca: pki/ca.pem, client_ca: pki/ca.pem,
            client_cert: pki/client.pem, client_key: pki/client-key.pem}
    """))
    topo = load_topology(tmp_path / "t.yaml")
    pki = tmp_path / "pki"
    assert topo.queue.server_tls(topo.resolve) == {"cert": str(pki / "queue.pem"), "key": str(pki / "queue-key.pem"),
                                                   "client_ca": str(pki / "ca.pem")}
    for role in ("prefill", "decode"):
        assert launch_config(topo, role, 0, model="/m", etcd_endpoints=[])["queue_tls"] == {
            "ca_file": str(pki / "ca.pem"), "cert_file": str(pki / "client.pem"), "key_file": str(pki / "client-key.pem")}
    (tmp_path / "plain.yaml").write_text(TOPOLOGY)
    plain = load_topology(tmp_path / "plain.yaml")
    assert plain.queue.server_tls(plain.resolve) is None
    assert launch_config(plain, "prefill", 0, model="/m", etcd_endpoints=[])["queue_tls"] is None


def test_queue_tls_server_name_checks_the_certificate_for_a_name_instead_of_the_address_dialled(tmp_path):
    """On Kubernetes the wire advertises the Ray head pod's IP, which no certificate can name
    in advance: the workers check it for the head's Service name (queue.tls.server_name)."""
    import asyncio
    import ssl

    from pdserve.cluster.security import ClientTLS
    from pdserve.cluster.queue.client import QueueClient

    pki = make_certs(tmp_path / "pki", ["pd-ray-head"])
    (tmp_path / "t.yaml").write_text(TOPOLOGY + "queue: {wire: node, tls: {cert: pki/queue.pem, "
                                                "key: pki/queue-key.pem, ca: pki/ca.pem, server_name: pd-ray-head}}\n")
    tls = ClientTLS(**launch_config(load_topology(tmp_path / "t.yaml"), "decode", 0, model="/m",
                                    etcd_endpoints=[])["queue_tls"])
    assert tls.server_name == "pd-ray-head"

    async def handshake(client_tls: ClientTLS) -> None:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(pki["queue"], pki["queue-key"])
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            endpoint = {"host": "127.0.0.1", "port": port, "tls": True}
            _, writer = await asyncio.open_connection("127.0.0.1", port, **QueueClient(None, "wire", client_tls)
                                                      ._tls_for(endpoint))
            writer.close()
        finally:
            server.close()

    asyncio.run(handshake(tls))
    with pytest.raises(ssl.SSLCertVerificationError, match="127.0.0.1"):  # the address dialled is not named
        asyncio.run(handshake(ClientTLS(ca_file=tls.ca_file)))


@pytest.mark.parametrize("queue, message", [
    ("{wire: 'off', tls: {cert: pki/queue.pem, key: pki/queue-key.pem}}", "tls: the queue serves no wire (wire: off)"),
    ("{tls: {cert: pki/queue.pem, key: pki/queue-key.pem, client_ca: pki/ca.pem}}", "needs client_cert and client_key"),
    ("{tls: {cert: pki/nope.pem, key: pki/queue-key.pem}}", "queue.tls.cert: file 'pki/nope.pem' not found"),
])
def test_a_bad_queue_tls_section_is_refused_naming_the_key(tmp_path, queue, message):
    make_certs(tmp_path / "pki")
    (tmp_path / "t.yaml").write_text(TOPOLOGY + f"queue: {queue}\n")
    with pytest.raises(TopologyError) as err:
        load_topology(tmp_path / "t.yaml")
    assert message in str(err.value)


# -- per-worker etcd certificates ---------------------------------------------------------
WORKERS_TOPOLOGY = """\
cluster: edge
model: {path: auto}
roles: {prefill: {replicas: 2}, decode: {replicas: 1}}
etcd:
  endpoints: [127.0.0.1:2379]
  tls:
    ca: pki/ca.pem
    root: {cert: pki/etcd-root.pem, key: pki/etcd-root-key.pem}
    workers: {dir: pki/etcd-workers, slots: {prefill: SLOTS}}
"""


def test_certs_make_and_certs_workers_issue_one_etcd_certificate_per_worker_slot(tmp_path, capsys):
    from cryptography.x509.oid import NameOID

    topo = tmp_path / "t.yaml"
    topo.write_text(WORKERS_TOPOLOGY.replace("SLOTS", "2"))
    assert main(["certs", "make", str(tmp_path / "pki"), "--topology", str(topo)]) == 0
    ca, workers = _cert(tmp_path / "pki/ca.pem"), tmp_path / "pki/etcd-workers"
    assert sorted(p.name for p in workers.iterdir()) == [f"{w}{s}.pem" for w in ("decode-0", "prefill-0", "prefill-1")
                                                         for s in ("-key", "")]
    for wid in ("prefill-0", "decode-0"):
        cert = _cert(workers / f"{wid}.pem")
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"worker/edge/{wid}"  # etcd user
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == \
            [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert oct(os.stat(workers / f"{wid}-key.pem").st_mode & 0o777) == "0o600"
    # More slots later: only the new ids are issued, from the same CA; --force renews them all.
    before = (workers / "prefill-0.pem").read_bytes(), (tmp_path / "pki/ca.pem").read_bytes()
    topo.write_text(WORKERS_TOPOLOGY.replace("SLOTS", "3"))
    capsys.readouterr()
    assert main(["certs", "workers", str(tmp_path / "pki"), "--topology", str(topo)]) == 0
    assert "1 written (prefill-2), 3 kept" in capsys.readouterr().out
    assert ((workers / "prefill-0.pem").read_bytes(), (tmp_path / "pki/ca.pem").read_bytes()) == before
    _cert(workers / "prefill-2.pem").verify_directly_issued_by(ca)
    assert main(["certs", "workers", str(tmp_path / "pki"), "--topology", str(topo), "--force"]) == 0
    assert (workers / "prefill-0.pem").read_bytes() != before[0]
    # What `pdserve etcd-auth` would set up for it, without an etcd.
    assert main(["etcd-auth", "--topology", str(topo), "--check"]) == 0
    assert "worker (no grant in cluster edge) and 4 per-worker users" in capsys.readouterr().out


def test_per_worker_certificates_refuse_a_common_name_etcd_could_not_read(tmp_path, capsys):
    topo = tmp_path / "t.yaml"
    topo.write_text(WORKERS_TOPOLOGY.replace("SLOTS", "2").replace("cluster: edge", "cluster: " + "e" * 60))
    assert main(["certs", "make", str(tmp_path / "pki"), "--topology", str(topo)]) == 2
    assert "at most 64: use a shorter cluster name" in capsys.readouterr().err
    assert not (tmp_path / "pki").exists()
    topo.write_text(WORKERS_TOPOLOGY.replace("    workers: {dir: pki/etcd-workers, slots: {prefill: SLOTS}}\n", ""))
    assert main(["certs", "make", str(tmp_path / "pki"), "--topology", str(topo)]) == 2
    assert "etcd.tls.workers is not set" in capsys.readouterr().err
