"""An OpenAI-shaped 400 for a request uvicorn cannot parse.

A request line or head that uvicorn's HTTP parser (httptools, or h11) refuses never reaches
the app: a header name or value with a NUL, CR or LF, a duplicate ``Content-Length``, a
bad chunk size. uvicorn answers it itself with ``400`` and the plain text ``Invalid HTTP
request received.``, which an OpenAI SDK cannot read as an error (found by the fuzz tests,
issue 20, tests/fuzz/test_request_wire.py). :func:`openai_400_protocol` gives uvicorn an
HTTP protocol class that answers the same 400 in OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` (code ``invalid_http_request``), then
closes the connection as uvicorn does (the parser's state is lost, RFC 9112 section 2.2).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol

MESSAGE = (
    "Invalid HTTP request: the request line or headers could not be parsed (a control "
    "character such as NUL, CR or LF in a header, a repeated Content-Length, a bad chunk "
    "size?)."
)
BODY = json.dumps(
    {"error": {"message": MESSAGE, "type": "invalid_request_error", "param": None,
               "code": "invalid_http_request"}},
    separators=(",", ":"),
).encode()
RESPONSE = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + BODY
)


class _OpenAI400(asyncio.Protocol):
    """Mixin over a uvicorn HTTP protocol: its parse-error answer in OpenAI's shape."""

    transport: asyncio.Transport

    def send_400_response(self, msg: str) -> None:
        """uvicorn's hook for a request it cannot parse (``msg``: its own text, not sent)."""
        self.transport.write(RESPONSE)
        self.transport.close()


def openai_400_protocol(base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``base`` (default: the one ``http="auto"`` picks) whose
    answer to an unparsable request is :data:`RESPONSE`."""
    return type(f"OpenAI400{base.__name__}", (_OpenAI400, base), {})
