"""A URL as logs and views show it: its user info's secret part hidden (pure).

A backend's URL (``backends[].url``) or the store's (``coordination.redis_url``) may carry
credentials in its user info (``http://user:password@host``, RFC 3986 section 3.2.1;
``https://token@host``). Every place that shows one (``/admin/backends``, ``/admin/fleet``,
``check-config``, the logs) goes through :func:`redacted_url`, so a password is never
shown in one view while hidden in another.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from gateway.core.listening import url_host

REDACTED = "***"


def redacted_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (the user name kept:
    ``http://u:***@host:8000``), or, when the user info has no password (a token alone:
    ``https://tok@host``), the whole user info; a URL without user info (or one that does
    not parse) as it is."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return url
    if "@" not in parts.netloc:
        return url
    user = f"{parts.username or ''}:{REDACTED}" if parts.password is not None else REDACTED
    netloc = f"{user}@{url_host(parts.hostname or '')}"
    if port is not None:
        netloc += f":{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def failure_detail(what: str, e: BaseException) -> str:
    """An operator's one-line account of a failed control-plane call: ``"{what}:
    {ExceptionType}: {message} ({METHOD} {redacted url})"``. httpx's transport errors name
    no address (``ConnectError: All connection attempts failed``), so the request's URL,
    passwords hidden (:func:`redacted_url`), is added when the exception carries one (an
    ``httpx.RequestError`` or ``HTTPStatusError``); an empty message is left out. For logs
    and ``/admin/backends``' ``last_error``, never for clients (issue 20)."""
    text = f"{what}: {type(e).__name__}: {e}".rstrip(": ")
    try:
        request = getattr(e, "request", None)  # httpx raises RuntimeError when unset
    except RuntimeError:
        request = None
    url = getattr(request, "url", None)
    method = getattr(request, "method", None)
    if url is not None and method is not None:
        text += f" ({method} {redacted_url(str(url))})"
    return text
