"""`python3 -m pdserve.cluster.health_probe URL [--cert F --key F] [--ca F]`: an exec probe for
a decode worker whose HTTP port requires mutual TLS.

Kubernetes' own probes cannot reach such a worker: the kubelet's gRPC probe speaks no TLS,
and its HTTPS probe presents no client certificate, so the handshake fails. The chart
(deploy/helm/pdserve) runs this instead: GET URL (the worker's open `/health`), presenting
`--cert`/`--key`; exit 0 on a 2xx answer, 1 on anything else (a 503 while draining or when
the engine died, a refused connection, a failed handshake), with one line on stderr.

Like the kubelet's HTTPS probe it does not check the server's name: it dials 127.0.0.1
inside the pod, which the worker's certificate need not name. `--ca` still verifies the
chain. Standard library only, and nothing else of pdserve is imported: it runs every few
seconds in every decode pod and must start in tens of milliseconds.
"""

from __future__ import annotations

import argparse
import http.client
import ssl
import sys
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_TIMEOUT_S = 3.0


def probe(url: str, cert: str | None = None, key: str | None = None, ca: str | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """(healthy, what happened) for one GET of `url`."""
    parts = urlsplit(url)
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False  # 127.0.0.1 inside the pod: the certificate names the Service
    if ca is None:
        ctx.verify_mode = ssl.CERT_NONE
    if cert:
        ctx.load_cert_chain(cert, key)
    if parts.hostname is None:  # the TypeError HTTPSConnection raised on a None host, named
        raise TypeError(f"url {url!r} names no host: expected https://HOST:PORT/PATH")
    conn = http.client.HTTPSConnection(parts.hostname, parts.port or 443, timeout=timeout_s, context=ctx)
    try:
        conn.request("GET", parts.path or "/")
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        return False, f"{url}: {exc.__class__.__name__}: {exc}"
    finally:
        conn.close()
    return 200 <= status < 300, f"{url}: HTTP {status}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m pdserve.cluster.health_probe",
                                description="GET an HTTPS health URL with a client certificate; exit 0 on 2xx.")
    p.add_argument("url", help="e.g. https://127.0.0.1:8000/health")
    p.add_argument("--cert", default=None, help="client certificate chain (PEM), for mutual TLS")
    p.add_argument("--key", default=None, help="its private key (PEM)")
    p.add_argument("--ca", default=None, help="verify the server's chain with this CA (default: not verified)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="validate the arguments and files, probe nothing")
    args = p.parse_args(argv)
    parts = urlsplit(args.url)
    if parts.scheme != "https" or not parts.hostname:
        p.error(f"url {args.url!r}: expected https://HOST:PORT/PATH")
    if (args.cert is None) != (args.key is None):
        p.error("--cert and --key go together")
    missing = [f"{flag} {path}" for flag, path in (("--cert", args.cert), ("--key", args.key), ("--ca", args.ca))
               if path is not None and not Path(path).is_file()]
    if missing:
        p.error(f"no such file: {', '.join(missing)}")
    if args.check:
        print(f"OK: GET {args.url}{' with a client certificate' if args.cert else ''}")
        return 0
    healthy, what = probe(args.url, args.cert, args.key, args.ca, args.timeout)
    print(what, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
