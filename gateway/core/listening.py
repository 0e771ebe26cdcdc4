"""Why a server could not listen on its address, said in one line that names the address
and what to change: ``cannot listen on 127.0.0.1:8000: address already in use (another
process listens there; pick --port)``.

The gateway (:mod:`gateway.serving`), the demo and the simulator bind their own sockets
and raise :class:`CannotListen` from the ``OSError`` of ``bind``; the command line prints
it as one line and exits 3, instead of a traceback or a bare ``[Errno 98] Address already
in use``. Pure: the errno decides the words.
"""

from __future__ import annotations

import errno


def url_host(host: str) -> str:
    """``host`` as the host part of a URL: an IPv6 address in brackets (``[::1]``, RFC 3986
    section 3.2.2); a name, an IPv4 address or an already bracketed one as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:8000``, RFC 3986 section 3.2.2)."""
    return f"{url_host(host)}:{port}"


class CannotListen(Exception):
    """Binding ``host``:``port`` failed with ``error`` (the ``OSError`` of ``bind``).

    ``port_hint`` / ``host_hint``: what the user changes to pick another port or address
    (default: the command line's ``--port`` / ``--host``). ``subject``: who wanted to listen,
    prefixed to the message when given (e.g. "simulated backend sim-1"). ``str()`` is the
    one-line message: the address, the reason, and for the usual reasons (errno
    ``EADDRINUSE``, ``EACCES``, ``EADDRNOTAVAIL``) the likely cause and what to change.
    """

    def __init__(
        self,
        host: str,
        port: int,
        error: OSError,
        *,
        port_hint: str = "pick --port",
        host_hint: str = "pick --host",
        subject: str = "",
    ) -> None:
        self.host = host
        self.port = port
        self.error = error
        self.port_hint = port_hint
        self.host_hint = host_hint
        self.subject = subject
        super().__init__(self.message())

    def reason(self) -> str:
        """The reason and, in parentheses, its likely cause and the remedy."""
        code = self.error.errno
        if code == errno.EADDRINUSE:
            return f"address already in use (another process listens there; {self.port_hint})"
        if code == errno.EACCES:
            return (
                "permission denied (ports below 1024 need privileges on most systems; "
                f"{self.port_hint})"
            )
        if code == errno.EADDRNOTAVAIL:
            return f"address not available (not an address of this machine; {self.host_hint})"
        text = self.error.strerror or str(self.error)
        return text[:1].lower() + text[1:]

    def message(self) -> str:
        """The whole line: ``[subject: ]cannot listen on host:port: reason``."""
        prefix = f"{self.subject}: " if self.subject else ""
        return f"{prefix}cannot listen on {host_port(self.host, self.port)}: {self.reason()}"

    def elsewhere(self, **hints: str) -> CannotListen:
        """The same failure with other hints or subject (keyword arguments of the
        constructor), for a caller that knows better what the user should change."""
        fields = {
            "port_hint": self.port_hint,
            "host_hint": self.host_hint,
            "subject": self.subject,
            **hints,
        }
        return CannotListen(self.host, self.port, self.error, **fields)
