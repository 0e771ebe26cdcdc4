"""One default TLS context for every httpx client the test process makes.

httpx (0.28) builds a new ``ssl.SSLContext`` for every client and every top-level call
(``httpx.get``, ``httpx.post``, ``httpx.stream``), loading certifi's CA bundle each time:
about 30 ms of CPU on this machine kind under OpenSSL 3 (encode/httpx#3627 and #2298;
python/cpython#95031, "load_verify_locations about 5x slower" with OpenSSL 3). The suite's
helpers make such calls by the thousand (readiness and state polls, metric reads, one
``openai`` SDK client per test), and the gateway under test builds two clients per start,
all in one process sharing 2 cores, so that parsing cost about a tenth of the suite's time.
:func:`share_default_context` makes the default case (``verify=True``, no client
certificate, no ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``) return one context built the same
way, once; every other case goes to httpx unchanged. requests does the same in its own
code (psf/requests#6667: a module-level context with the default bundle loaded), and
aiohttp keeps one default context per process (``aiohttp/connector.py``). The tests speak
plain HTTP, so no test's outcome depends on this; only the time.
"""

from __future__ import annotations

import os
import ssl
from typing import Any

from httpx._transports import default as httpx_transports


def share_default_context() -> None:
    """Install the shared default context in httpx's transports (idempotent)."""
    make = httpx_transports.create_ssl_context
    if getattr(make, "shares_default", False):
        return
    shared: list[ssl.SSLContext] = []

    def create_ssl_context(verify: Any = True, cert: Any = None,
                           trust_env: bool = True) -> ssl.SSLContext:
        env = trust_env and (os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR"))
        if verify is not True or cert is not None or env:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        if not shared:
            shared.append(make(verify=True, cert=None, trust_env=trust_env))
        return shared[0]

    create_ssl_context.shares_default = True  # type: ignore[attr-defined]
    httpx_transports.create_ssl_context = create_ssl_context
