"""Who may use ``/admin/*`` and see the status page's backend details (issue 20).

The rule, decided once here and applied to every path under ``/admin`` by
:class:`gateway.app.GatewayApp` before any route runs (so an admin route added later is
covered without remembering to call anything):

* **With an admin key** (``auth.admin_key``, ``admin_key_env`` or ``admin_key_file``): the
  request must carry ``Authorization: Bearer <key>``, compared in constant time
  (:func:`gateway.core.keys.key_matches`: :func:`hmac.compare_digest` over SHA-256
  digests, so neither the key's bytes nor its length show in the time taken); otherwise
  401 ``invalid_api_key``. Loopback gets no exemption: a key is a key.
* **Without one**: only a loopback client (``127.0.0.0/8``, ``::1``, and
  ``::ffff:127.x.x.x``, the IPv4-mapped form a dual-stack listener reports) is answered;
  anyone else gets 403 ``permission_error`` / ``admin_loopback_only``, whose message says
  how to set a key. ``kubectl port-forward`` and ``docker compose exec ... curl
  localhost`` arrive on the loopback, so an operator on the host or in the pod still has a
  way in; a client of a published port does not.

**Proxies**: a request that carries a forwarding header (``Forwarded`` (RFC 7239),
``X-Forwarded-For``, ``X-Real-IP``, ``Via``) is never treated as loopback, whatever its TCP
peer: it came through something. This also makes uvicorn's own ``X-Forwarded-For`` handling
(``--forwarded-allow-ips`` / ``FORWARDED_ALLOW_IPS``, which rewrites the ASGI ``client``
from the header) unable to open the admin API: a rewritten ``client`` only exists when the
header is there. A reverse proxy on the same host that forwards *without* any such header
makes every client look like loopback: behind a local proxy, set an admin key (README,
"Security").
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.core.keys import key_matches
from gateway.core.outcomes import Refusal

PERMISSION_ERROR = "permission_error"
"""The OpenAI error type of a 403 (openai-python raises ``PermissionDeniedError``)."""

FORWARDING_HEADERS = frozenset({b"forwarded", b"x-forwarded-for", b"x-real-ip", b"via"})
"""Request headers (lower case, raw ASGI) that mark a request as relayed by a proxy."""

NO_KEY_HINT = (
    "set an admin key (auth.admin_key_file: a file holding it, e.g. a mounted secret; or "
    "auth.admin_key_env: the environment variable holding it) and send it as "
    "'Authorization: Bearer <key>'"
)


def is_admin_path(path: str) -> bool:
    """Whether ``path`` (the ASGI ``path``, percent-decoded) is under ``/admin``."""
    return path == "/admin" or path.startswith("/admin/")


def is_loopback_host(host: str | None) -> bool:
    """Whether ``host`` (an ASGI ``client`` host: an IP literal) is a loopback address,
    IPv4-mapped IPv6 (``::ffff:127.0.0.1``) included. Anything that is not an IP literal
    (None, a Unix socket, a test client's name) is not."""
    if not host:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def direct_loopback(scope: Mapping[str, Any]) -> bool:
    """Whether the ASGI request ``scope`` comes from a loopback peer directly: its client
    is loopback and it carries none of :data:`FORWARDING_HEADERS` (module docstring)."""
    client = scope.get("client")
    if not client or not is_loopback_host(client[0]):
        return False
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers") or ()
    return not any(name.lower() in FORWARDING_HEADERS for name, _ in headers)


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first ``Authorization: Bearer <token>`` header, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            return token.strip()
    return None


def admin_refusal(admin_key: str | None, scope: Mapping[str, Any]) -> Refusal | None:
    """Why the admin request ``scope`` is refused (module docstring), or None to serve it.
    ``admin_key``: the resolved key, None when none is configured."""
    headers = scope.get("headers") or ()
    if admin_key is not None:
        if key_matches(bearer_token(headers), admin_key):
            return None
        return Refusal(401, "Admin API: missing or wrong admin key (send 'Authorization: "
                       "Bearer <admin key>').", code="invalid_api_key", retryable=False)
    if direct_loopback(scope):
        return None
    return Refusal(
        403,
        "Admin API: no admin key is configured, so it answers loopback clients only "
        "(requests relayed by a proxy count as remote). To reach it from this address, "
        f"{NO_KEY_HINT}.",
        PERMISSION_ERROR,
        "admin_loopback_only",
        retryable=False,
    )


def sees_details(admin_key: str | None, public: bool, scope: Mapping[str, Any]) -> bool:
    """Whether the status page shows backend details to the request ``scope``:
    ``status.public_details`` (``public``), a direct loopback client, or the admin key's
    holder."""
    if public or direct_loopback(scope):
        return True
    return admin_key is not None and key_matches(bearer_token(scope.get("headers") or ()),
                                                 admin_key)
