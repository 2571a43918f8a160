#!/usr/bin/env python3
"""The image's HEALTHCHECK: GET $PDSERVE_HEALTH_URL (a decode worker's /health, default
http://127.0.0.1:8000/health); exit 0 on a 2xx answer, 1 otherwise, with one line on stderr.
Standard library only: it runs every few seconds. A worker with mutual TLS on its HTTP port
is probed with `python3 -m pdserve.cluster.health_probe` instead (the Helm chart does)."""

import os
import sys
import urllib.error
import urllib.request

url = os.environ.get("PDSERVE_HEALTH_URL", "http://127.0.0.1:8000/health")
try:
    with urllib.request.urlopen(url, timeout=4) as r:
        ok = 200 <= r.status < 300
        print(f"{url}: {r.status}", file=sys.stderr)
except (urllib.error.URLError, OSError) as exc:
    print(f"{url}: {exc}", file=sys.stderr)
    ok = False
sys.exit(0 if ok else 1)
