#!/usr/bin/env python3
"""The image's HEALTHCHECK: exit 0 when ``GET /health/live`` answers 200, else 1.

Liveness never touches the device, so this check stays cheap on an NPU host. It reads the same
settings the service does: ``MOEGRAD_PORT`` (default 8000) and, when ``MOEGRAD_TLS_CERTFILE`` is set,
speaks HTTPS without verifying the certificate (the check only asks whether this very process
answers). It always asks the loopback interface: the service binds 0.0.0.0 in a container.
Standard library only, so no curl is needed in the image.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def main() -> int:
    port = os.environ.get("MOEGRAD_PORT", "8000")
    context = None
    scheme = "http"
    if os.environ.get("MOEGRAD_TLS_CERTFILE"):
        scheme = "https"
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    url = f"{scheme}://127.0.0.1:{port}/health/live"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as response:
            ok = response.status == 200
    except (OSError, urllib.error.URLError) as exc:
        print(f"moegrad-healthcheck: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
