"""The request fields of JSON log lines (gateway/logs.py): on the lines of the request's own
task, never on those of a task it started (the batcher's merged request, a background
probe), nor on another request's; every line one JSON object."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from gateway import logs


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """A JSON handler as ``setup_logging(..., "json")`` makes it, on a private logger."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.json_formatter())
    handler.addFilter(logs.RequestFields())
    log = logging.getLogger("test.log_fields")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield out
    log.removeHandler(handler)


def test_a_requests_lines_carry_its_id_and_backend_and_its_spawned_tasks_do_not(
    lines: io.StringIO,
) -> None:
    log = logging.getLogger("test.log_fields")

    async def request(rid: str, backend: str, gate: asyncio.Event) -> None:
        logs.bind_request(rid)
        log.info("before the attempt")
        logs.BACKEND.set(backend)
        await gate.wait()  # the two requests interleave
        log.info("after the attempt", extra={"tokens": 3})
        await asyncio.get_running_loop().create_task(spawned())

    async def spawned() -> None:
        log.info("in a task the request started")

    async def main() -> None:
        gate = asyncio.Event()
        tasks = [asyncio.create_task(request("r1", "a", gate)),
                 asyncio.create_task(request("r2", "b", gate))]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*tasks)
        log.info("outside any request")

    asyncio.run(main())
    records = [json.loads(line) for line in lines.getvalue().splitlines()]
    got = [(r["message"], r.get("request_id"), r.get("backend")) for r in records]
    assert sorted(got, key=str) == sorted([
        ("before the attempt", "r1", None), ("before the attempt", "r2", None),
        ("after the attempt", "r1", "a"), ("after the attempt", "r2", "b"),
        ("in a task the request started", None, None),
        ("in a task the request started", None, None),
        ("outside any request", None, None),
    ], key=str)
    after = [r for r in records if r["message"] == "after the attempt"]
    assert all(r["tokens"] == 3 and r["logger"] == "test.log_fields" and r["level"] == "INFO"
               for r in after)


def test_setup_logging_json_then_text() -> None:
    """``json`` turns the request fields on and writes JSON; ``text`` turns them off."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        out = io.StringIO()
        logs.setup_logging("info", "json", stream=out)
        assert logs.FIELDS_ON
        logging.getLogger("gateway.x").warning("hello %s", "there")
        (line,) = out.getvalue().splitlines()
        assert json.loads(line)["message"] == "hello there"
        root.handlers.clear()
        logs.setup_logging("info", "text", stream=out)
        assert not logs.FIELDS_ON
    finally:  # pytest's own capture handlers back
        root.handlers[:] = handlers
        root.setLevel(level)
        logs.setup_logging("info", "text")  # FIELDS_ON off again (a no-op on the handlers)
