"""``gateway.api.forms.form_fields``: what the gateway reads of a multipart form."""

from __future__ import annotations

from gateway.api.forms import form_fields

BOUNDARY = b"XyZ"


def form(*parts: tuple[bytes, bytes]) -> bytes:
    """A multipart body of (content-disposition parameters, data) parts."""
    out = b""
    for disposition, data in parts:
        out += (b"--" + BOUNDARY + b"\r\ncontent-disposition: form-data; " + disposition
                + b"\r\n\r\n" + data + b"\r\n")
    return out + b"--" + BOUNDARY + b"--\r\n"


def test_a_file_named_with_filename_star_is_not_a_field() -> None:
    """RFC 7578 4.2 / RFC 6266 4.3: a file part may name its file with ``filename*`` only;
    its bytes are the file's, not a text field (nor text tokens to charge)."""
    body = form(
        (b'name="model"', b"whisper"),
        (b"name=\"file\"; filename*=UTF-8''a%20b.wav", b"RIFF" + b"\x00" * 10_000),
        (b'name="other"; filename="c.wav"', b"RIFF"),
    )
    fields = form_fields(body, b"multipart/form-data; boundary=" + BOUNDARY)
    assert fields == {"model": "whisper"}
