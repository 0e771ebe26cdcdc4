"""The gateway's log lines: plain text (as always) or JSON, one object per line.

``server.log_format: json`` (or ``llm-gateway serve --log-format json``) writes every line
as one JSON object (python-json-logger's ``JsonFormatter``)::

    {"time": "2026-12-03T01:50:00.123456+00:00", "level": "INFO", "logger": "gateway.api",
     "message": "...", "request_id": "3f2a...", "backend": "vllm-a"}

``time`` is RFC 3339 in UTC (``record.created``, microseconds), ``level`` the level name,
``logger`` the logger's name; any ``extra=`` field of the call follows. A line logged while
the gateway serves a request carries that request's ``request_id`` and, once an attempt
has picked one, the ``backend`` of its latest attempt: the request path sets two context
variables (:func:`bind_request` in ``api/openai.py``, :data:`BACKEND` per attempt in
``flow/pipeline.py``; only while :data:`FIELDS_ON`), and a handler filter copies them
onto each record (asyncio gives every request task its own copy, so requests never see
each other's). The request id is
bound to the request's own task: a task or timer callback started while serving it (the
batcher's merged request, a background probe) inherits the variables but is not that
request, and its lines carry neither field. uvicorn's own loggers
(``uvicorn.error``, ``uvicorn.access``) are routed to the same handler
(:func:`uvicorn_log_config`); an access line also carries ``client``, ``method``, ``path``,
``http_version`` and ``status`` as fields.

``text`` keeps today's lines (``time LEVEL logger: message``, and uvicorn's own format for
its loggers).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from contextvars import ContextVar
from typing import Any, Literal, TextIO

REQUEST_ID: ContextVar[tuple[str, object] | None] = ContextVar("gateway_request_id",
                                                               default=None)
"""The request id being served and the asyncio task serving it (:func:`bind_request`);
None outside a request."""
BACKEND: ContextVar[str | None] = ContextVar("gateway_backend", default=None)
"""The backend id of the current request's latest attempt (None before one)."""

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")
# uvicorn adds a colourised copy of some messages as an extra: not for JSON lines
_SKIP_EXTRAS = ("color_message",)

LogFormat = Literal["text", "json"]
_json_lines = False  # setup_logging chose json: say() logs instead of printing
FIELDS_ON = False
"""Whether a handler shows the request fields (the JSON format is on): the request path
binds them only then (text lines do not show them), so text logging pays one bool check."""


def bind_request(request_id: str) -> None:
    """This task serves ``request_id``: its log lines carry it (one context-variable set and
    ``asyncio.current_task()``, about 0.2 us)."""
    REQUEST_ID.set((request_id, asyncio.current_task()))


def _current_task() -> object:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop running in this thread
        return None


class RequestFields(logging.Filter):
    """Copies the current request's id and backend (:data:`REQUEST_ID`, :data:`BACKEND`)
    onto each record as ``request_id`` / ``backend`` when set and logged from the request's
    own task, and an access line's
    arguments (uvicorn: client address, method, path, HTTP version, status) as fields.
    Never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = REQUEST_ID.get()
        if bound is not None and bound[1] is _current_task():
            record.request_id = bound[0]
            backend = BACKEND.get()
            if backend is not None:
                record.backend = backend
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(
            record.args
        ) == len(_ACCESS_FIELDS):
            for name, value in zip(_ACCESS_FIELDS, record.args, strict=True):
                setattr(record, name, value)
        return True


def json_formatter() -> logging.Formatter:
    """python-json-logger's formatter with the fields named in the module docstring."""
    from pythonjsonlogger.core import RESERVED_ATTRS
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "%(levelname)s %(name)s %(message)s",
        rename_fields={"levelname": "level", "name": "logger"},
        reserved_attrs=[*RESERVED_ATTRS, *_SKIP_EXTRAS],
        timestamp="time",
        json_ensure_ascii=False,
    )


def setup_logging(level: str, fmt: LogFormat = "text", stream: TextIO | None = None) -> None:
    """Configure the root logger: ``level`` (``debug`` .. ``error``), ``fmt`` (``text``:
    ``logging.basicConfig`` with :data:`TEXT_FORMAT`, a no-op when the root already has a
    handler, as before; ``json``: the root's handlers replaced by one writing JSON lines
    to ``stream``, default stderr). httpx's per-request INFO lines (probes, scrapes) are
    silenced either way."""
    global _json_lines, FIELDS_ON
    out = stream or sys.stderr
    _json_lines = FIELDS_ON = fmt == "json"
    if fmt == "json":
        handler = logging.StreamHandler(out)
        handler.setFormatter(json_formatter())
        handler.addFilter(RequestFields())
        logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    else:
        logging.basicConfig(level=level.upper(), format=TEXT_FORMAT, stream=out)
    # httpx logs every control-plane request (probes, scrapes) at INFO: too chatty.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def current_format() -> LogFormat:
    """The format :func:`setup_logging` last chose (``text`` before any call)."""
    return "json" if _json_lines else "text"


def say(text: str, level: int = logging.INFO, out: TextIO | None = None) -> None:
    """One line for the operator (the CLI's ``config: ...``, a fatal error): printed on
    ``out`` (default stderr) as it is, or, once :func:`setup_logging` chose ``json`` and
    ``out`` is stderr, a JSON line of logger ``gateway.cli`` at ``level``, so that every
    line of a JSON-logging process parses."""
    if _json_lines and out in (None, sys.stderr):
        logging.getLogger("gateway.cli").log(level, text)
    else:
        print(text, file=out or sys.stderr, flush=True)


def uvicorn_log_config(fmt: LogFormat) -> dict[str, Any] | None:
    """uvicorn's ``log_config`` for ``fmt``: None for ``text`` (uvicorn's own default
    config, ``uvicorn.config.LOGGING_CONFIG``, as before); for ``json`` a ``dictConfig``
    that gives uvicorn's loggers no handler of their own and lets them propagate to the
    root's JSON handler (:func:`setup_logging`). uvicorn still sets their levels from
    ``log_level`` and detaches ``uvicorn.access`` when ``access_log`` is off."""
    if fmt != "json":
        return None
    routed = {"handlers": [], "propagate": True}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {name: dict(routed) for name in ("uvicorn", "uvicorn.error",
                                                    "uvicorn.access")},
    }
