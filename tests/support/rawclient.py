"""A raw-socket HTTP/1.1 client for tests that must control exactly when a client hangs up."""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit


class RawClient:
    """Send one request on a fresh TCP connection and read as much as the test wants."""

    def __init__(self, base_url: str) -> None:
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.sock: socket.socket | None = None
        self.buf = b""

    def send(self, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body else b"")
        h = {"host": f"{self.host}:{self.port}", "content-type": "application/json",
             "content-length": str(len(data)), **(headers or {})}
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items())
        self.sock = socket.create_connection((self.host, self.port))
        self.sock.sendall(head.encode() + b"\r\n" + data)

    def read_until(self, marker: bytes, count: int = 1, timeout: float = 10) -> bytes:
        """Read until ``marker`` has appeared ``count`` times in everything read so far."""
        assert self.sock is not None
        deadline = time.monotonic() + timeout
        while self.buf.count(marker) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"only {self.buf.count(marker)} x {marker!r}: {self.buf!r}")
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"server closed; got {self.buf!r}")
            self.buf += chunk
        return self.buf

    def read_for(self, seconds: float) -> bytes:
        """Read whatever arrives within ``seconds``."""
        assert self.sock is not None
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            self.buf += chunk
        return self.buf

    def close(self) -> float:
        """Close the connection; returns the monotonic time of the close."""
        assert self.sock is not None
        self.sock.close()
        return time.monotonic()
