"""One default TLS context per trust store for every httpx client the test process makes.

httpx (0.28) and httpx2 (pydantic's fork, which the ``openai`` SDK uses) build a new
``ssl.SSLContext`` for every client and every top-level call (``httpx.get``,
``httpx.post``, ``httpx.stream``), parsing the CA bundle each time: 30-45 ms of CPU on this
machine kind under OpenSSL 3 (encode/httpx#3627 and #2298, pydantic/httpx2#907;
python/cpython#95031, "load_verify_locations about 5x slower" with OpenSSL 3). The suite's
helpers make such calls by the thousand (readiness and state polls, metric reads, an
``openai`` SDK client per test), and the gateway under test builds two clients per start,
all in one process on 2 shared cores. :func:`share_default_context` makes the default case
(``verify=True``, no client certificate) return one context per trust store (the library's
own choice from ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` or its bundled default), built by the
library once; every other case goes to the library unchanged. requests does the same in
its own code (psf/requests#6667: a module-level context with the default bundle loaded),
and aiohttp keeps one default context per process (``aiohttp/connector.py``). The tests
speak plain HTTP, so no test's outcome depends on this; only the time. Measured on 2
cores (one scripted backend): a gateway start, ready and stop took ~190 ms of CPU before,
~47 ms after; ``httpx.get`` ~45 ms before, ~3 ms after.
"""

from __future__ import annotations

import importlib
import os
import ssl
from collections.abc import Callable
from typing import Any

MODULES = ("httpx._transports.default", "httpx2._transports.default")
"""Where each library's transports look up ``create_ssl_context`` (imported by name)."""


def _sharing(make: Callable[..., ssl.SSLContext]) -> Callable[..., ssl.SSLContext]:
    shared: dict[tuple[str, str], ssl.SSLContext] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None,
                           trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        env = os.environ if trust_env else {}
        key = (env.get("SSL_CERT_FILE", ""), env.get("SSL_CERT_DIR", ""))
        if key not in shared:
            shared[key] = make(verify=True, cert=None, trust_env=trust_env)
        return shared[key]

    create_ssl_context.shares_default = True  # type: ignore[attr-defined]
    return create_ssl_context


def share_default_context() -> None:
    """Install the shared default contexts in the transports of :data:`MODULES` that are
    installed (idempotent)."""
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        make = module.create_ssl_context
        if not getattr(make, "shares_default", False):
            module.create_ssl_context = _sharing(make)
