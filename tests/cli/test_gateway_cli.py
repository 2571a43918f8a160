"""`pdserve gateway` arguments: checked before anything starts, errors naming the option."""

from __future__ import annotations

import pytest

from pdserve.cli import main


@pytest.mark.parametrize("extra,needle", [
    (["--etcd", "127.0.0.1:2379"], "--etcd needs --cluster"),
    (["--etcd", "127.0.0.1:2379", "--cluster", "c", "--model", "/no/such/dir"], "--model /no/such/dir"),
    (["--etcd", "127.0.0.1:2379", "--cluster", "c", "--model", "{tmp}", "--grpc-port", "70000"], "--grpc-port"),
    (["--etcd", "127.0.0.1:2379", "--cluster", "c", "--model", "{tmp}", "--race-fraction", "2"], "--race-fraction"),
    (["--etcd", "127.0.0.1:2379", "--cluster", "c", "--model", "{tmp}", "--tls-cert", "/no/cert", "--tls-key",
      "/no/key"], "tls_cert: /no/cert"),
])
def test_bad_arguments_are_refused_naming_the_option(extra, needle, tmp_path, capsys):
    argv = ["gateway", *[a.replace("{tmp}", str(tmp_path)) for a in extra], "--check"]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_check_accepts_good_arguments_and_starts_nothing(tmp_path, capsys):
    assert main(["gateway", "--etcd", "10.0.0.5:2379", "--cluster", "c", "--model", str(tmp_path), "--check"]) == 0
    assert "gateway arguments OK: cluster c, etcd 10.0.0.5:2379" in capsys.readouterr().out


def test_explain_without_a_gateway_says_what_to_start(capsys):
    assert main(["gateway", "explain", "--url", "http://127.0.0.1:9", "--prompt", "hi"]) == 2
    assert "is `pdserve gateway` running?" in capsys.readouterr().err
