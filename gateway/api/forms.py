"""Reading a ``multipart/form-data`` model request at the edge (RFC 7578): the routes that
take an upload (``/v1/audio/transcriptions``, ``/v1/audio/translations``: vLLM serves both,
as OpenAI does) carry ``model`` and ``stream`` as form fields next to the file.

The body is never loaded as JSON and never rewritten: the gateway reads the text fields
with python-multipart's streaming parser (the file part's bytes are skipped, not copied)
and forwards the raw body with its own ``content-type`` (its boundary) unchanged. Each
failure is a :class:`gateway.core.outcomes.Refusal` with the status OpenAI would use.
"""

from __future__ import annotations

import re
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.api.errors import INVALID_REQUEST, Refusal

# Routes whose body is a multipart form (OpenAI API reference, "Audio"; vLLM's
# ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` read ``Form()`` fields).
FORM_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")

MULTIPART = b"multipart/form-data"

# A form field read as a boolean the way vLLM's pydantic models read one (pydantic's
# lax-mode bool: https://docs.pydantic.dev/latest/api/standard_library_types/#booleans)
TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


def is_form(content_type: bytes | None) -> bool:
    """Whether ``content_type`` (a request's raw header value) is ``multipart/form-data``."""
    if not content_type or MULTIPART not in content_type.lower():  # the common case: JSON
        return False
    return parse_options_header(content_type)[0].lower() == MULTIPART


_FILENAME = re.compile(rb";\s*filename\*?\s*=", re.IGNORECASE)


def form_fields(body: bytes, content_type: bytes) -> dict[str, str]:
    """The text fields of a multipart form ``body`` (parts without a ``filename``), name ->
    value (UTF-8; a repeated name keeps its last value). File parts are passed over
    without copying their bytes. Raises a 400 :class:`Refusal` for a body that is not a
    well-formed form of that boundary."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise Refusal(
            400,
            "The multipart/form-data content-type has no boundary parameter.",
            code="invalid_multipart",
        )
    fields: dict[str, str] = {}
    header_name: list[bytes] = []
    header_value: list[bytes] = []
    name: bytes | None = None  # the part being read, when it is a text field
    value: list[bytes] = []

    def on_part_begin() -> None:
        nonlocal name
        name = None
        value.clear()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_name.append(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.append(data[start:end])

    def on_header_end() -> None:
        nonlocal name
        if b"".join(header_name).strip().lower() == b"content-disposition":
            raw = b"".join(header_value)
            _, disposition = parse_options_header(raw)
            field = disposition.get(b"name")
            # a file part names its file as ``filename`` or ``filename*`` (RFC 7578 4.2,
            # RFC 6266 4.3; python-multipart drops the latter): either way not a field
            if field is not None and _FILENAME.search(raw) is None:
                name = field
        header_name.clear()
        header_value.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if name is not None:  # a file part's bytes are never copied
            value.append(data[start:end])

    def on_part_end() -> None:
        if name is not None:
            fields[name.decode("utf-8", "replace")] = b"".join(value).decode("utf-8", "replace")

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as e:
        raise Refusal(
            400, f"Request body is not a valid multipart form: {e}", code="invalid_multipart"
        ) from None
    return fields


def form_payload(body: bytes, content_type: bytes | None, endpoint: str) -> dict[str, Any]:
    """What the gateway reads of a multipart model request, shaped like a JSON body's
    (:func:`gateway.api.parsing.check_payload`): the text fields, with ``model`` (required)
    and ``stream`` (a boolean; False when absent). 400 for a body that is not a form, a
    missing ``model`` or an unreadable ``stream``."""
    if not is_form(content_type):
        got = content_type.decode("latin-1") if content_type else "none"
        raise Refusal(
            400,
            f"'{endpoint}' takes a multipart/form-data body (the audio 'file' and a 'model' "
            f"field); got content-type '{got}'.",
            INVALID_REQUEST,
            "invalid_content_type",
        )
    assert content_type is not None
    payload: dict[str, Any] = dict(form_fields(body, content_type))
    model = payload.get("model")
    if not model:
        raise Refusal(
            400,
            "'model' is a required form field.",
            code="missing_required_parameter",
            param="model",
        )
    raw = payload.get("stream")
    if raw is None:
        payload["stream"] = False
    else:
        flag = raw.strip().lower()
        if flag not in TRUE_WORDS and flag not in FALSE_WORDS:
            raise Refusal(
                400, "'stream' must be a boolean.", code="invalid_type", param="stream"
            )
        payload["stream"] = flag in TRUE_WORDS
    return payload
