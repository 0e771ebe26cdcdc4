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

**Browsers** (loopback-only mode): a web page the operator visits can make the browser
send requests to ``http://127.0.0.1:PORT/admin/...`` (a cross-site ``text/plain`` POST needs
no CORS preflight), and DNS rebinding (a name of the attacker's that resolves to
127.0.0.1) lets its script read the answers too. So, without an admin key, a request is
also refused (403 ``admin_cross_site``, :func:`browser_problem`) when its
``Sec-Fetch-Site`` is ``cross-site`` or ``same-site`` (Fetch Metadata, OWASP's "Cross-Site
Request Forgery Prevention Cheat Sheet"), when it carries an ``Origin`` that is not a
loopback host (OWASP: verifying origin with standard headers), or when its ``Host`` is not
a loopback name or IP literal (``localhost``, ``*.localhost``, ``127.x.x.x``, ``[::1]``,
any port: the Host allow-list that Jupyter and Vite's dev servers use against DNS
rebinding). With an admin key none of this is needed: browsers never attach an
``Authorization: Bearer`` header cross-site on their own. In both modes an admin request
with a body must say it is JSON or YAML (:data:`BODY_TYPES`; 415
``unsupported_media_type`` otherwise, :func:`body_type_refusal`): an HTML form can only
send ``application/x-www-form-urlencoded``, ``multipart/form-data`` or ``text/plain``.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
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


BODY_TYPES = frozenset({"application/json", "application/yaml", "application/x-yaml",
                        "text/yaml"})
"""The media types an admin request body may have (the parameters, ``; charset=...``,
aside). Not one of them is a type an HTML form or a CORS-simple request can send."""

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
"""The methods whose admin requests' bodies are checked by :func:`body_type_refusal`."""


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


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header ``name`` (lower case) as Latin-1 text, or None."""
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def is_loopback_name(host: str) -> bool:
    """Whether ``host`` (a URL's or ``Host`` header's host, without port; IPv6 without
    brackets) names the loopback: ``localhost``, ``*.localhost`` (RFC 6761 §6.3: always
    the loopback), or a loopback IP literal."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    return is_loopback_host(host)


def _host_of(authority: str) -> str | None:
    """The host of a ``Host`` header value (``name[:port]``, ``[v6][:port]``), or None
    when it cannot be read."""
    try:
        return urllib.parse.urlsplit("//" + authority).hostname
    except ValueError:
        return None


def browser_problem(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why the request with these ``headers`` (raw ASGI) looks driven by another site's
    page (module docstring, "Browsers"), or None when it does not."""
    headers = list(headers)
    site = _header(headers, b"sec-fetch-site")
    if site is not None and site.strip().lower() in ("cross-site", "same-site"):
        return f"it was sent by a browser from another site (Sec-Fetch-Site: {site.strip()})"
    origin = _header(headers, b"origin")
    if origin is not None:
        try:
            origin_host = urllib.parse.urlsplit(origin.strip()).hostname
        except ValueError:
            origin_host = None
        if not origin_host or not is_loopback_name(origin_host):
            return "its Origin is not a loopback host"
    host = _header(headers, b"host")
    if host is not None:
        name = _host_of(host.strip())
        if not name or not is_loopback_name(name):
            return "its Host is not a loopback name (a DNS-rebinding defence)"
    return None


def has_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request with these ``headers`` has a body: ``Content-Length`` above 0 or
    any ``Transfer-Encoding`` (chunked)."""
    for name, value in headers:
        name = name.lower()
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
    return False


def body_type_refusal(scope: Mapping[str, Any]) -> Refusal | None:
    """415 when the admin request ``scope`` has a body (:func:`has_body`) whose
    ``Content-Type`` is not one of :data:`BODY_TYPES` (module docstring); else None."""
    if scope.get("method") not in BODY_METHODS:
        return None
    headers = list(scope.get("headers") or ())
    if not has_body(headers):
        return None
    ctype = (_header(headers, b"content-type") or "").split(";", 1)[0].strip().lower()
    if ctype in BODY_TYPES:
        return None
    shown = f"'{ctype}'" if ctype else "none"
    return Refusal(415, f"Admin API: a request body must be JSON or YAML (Content-Type "
                   f"application/json or application/yaml; got {shown}), so that a web "
                   "page's form cannot post one.", code="unsupported_media_type",
                   param="content-type", retryable=False)


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
        problem = browser_problem(headers)
        if problem is None:
            return None
        return Refusal(
            403,
            f"Admin API: refused because {problem}. Without an admin key it answers "
            "loopback clients that are not driven by a web page from another site (a "
            "cross-site request or DNS rebinding could otherwise drain the fleet or "
            f"replace its config). To use it from a browser or another host, {NO_KEY_HINT}.",
            PERMISSION_ERROR,
            "admin_cross_site",
            retryable=False,
        )
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
    ``status.public_details`` (``public``), a direct loopback client not driven by another
    site's page (:func:`browser_problem`: DNS rebinding could read it), or the admin key's
    holder."""
    if public:
        return True
    if direct_loopback(scope) and browser_problem(scope.get("headers") or ()) is None:
        return True
    return admin_key is not None and key_matches(bearer_token(scope.get("headers") or ()),
                                                 admin_key)
