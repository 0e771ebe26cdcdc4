"""Fuzzed request bodies through real HTTP (issue 20): any JSON in any field the gateway reads
on ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` and ``/v1/responses``,
and bytes that are not JSON or not valid text, sent to a gateway under uvicorn over two
simulated vLLM servers. Each answer is relayed or a clear OpenAI-shaped 4xx
(:mod:`tests.fuzz.oracle`); afterwards nothing is held and everything still runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.budget import examples
from tests.fuzz.conftest import AUTH, SimRig
from tests.fuzz.oracle import WAIT_S, assert_settled, check_answer, no_slot_held
from tests.fuzz.strategies import bodies, encode, raw_bodies


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=WAIT_S, headers=AUTH) as c:
        yield c


def post(client: httpx.Client, url: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` as JSON; the status, headers and the whole body (a stream read to its
    end)."""
    with client.stream("POST", url, content=body,
                       headers={"content-type": "application/json"}) as r:
        data = r.read()
        return r.status_code, dict(r.headers), data


def check(rig: SimRig, client: httpx.Client, endpoint: str, body: bytes) -> None:
    status, headers, data = post(client, rig.url + endpoint, body)
    check_answer(status, headers, data, relayed=rig.relayed)
    # one admission slot: a leaked one would have made this request wait, then 429
    assert status != 429, data[:300]
    no_slot_held(client, rig.url)


@given(case=bodies(), ascii_only=st.booleans())
@examples(100)
# found by this test: a stream whose text holds a lone surrogate was the gateway's 500
# (its continuable first attempt re-encoded as UTF-8: gateway/core/wire_json.py)
@example(case=("/v1/chat/completions", {"model": "m1", "messages": [
    {"role": "user", "content": "\ud800"}], "max_tokens": 4, "stream": True}), ascii_only=True)
@example(case=("/v1/completions", {"model": "m1", "prompt": "a", "user": "\udfff",
                                   "max_tokens": 4, "stream": True}), ascii_only=False)
def test_json_bodies(sim_rig: SimRig, client: httpx.Client,
                     case: tuple[str, Any], ascii_only: bool) -> None:
    endpoint, value = case
    check(sim_rig, client, endpoint, encode(value, ascii_only))


@given(case=raw_bodies())
@examples(40)
# found by the long profile: n=1e30 (forwarded as is) held a simulator's event loop for
# good, both backends then judged hung: the gateway now refuses n above proxy.max_n
@example(case=("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", '
               b'"content": "hi"}], "max_tokens": 4, "n": 1000000000000000000000000000000}'))
@example(case=("/v1/completions", b'{"model": "m1", "prompt": "a", "best_of": "1e30"}'))
def test_raw_bodies(sim_rig: SimRig, client: httpx.Client, case: tuple[str, bytes]) -> None:
    endpoint, body = case
    check(sim_rig, client, endpoint, body)


def test_settled_after_bodies(sim_rig: SimRig, client: httpx.Client) -> None:
    """After the fuzzed bodies (this module's tests run first): no slot held, both
    simulators routable, the control loops running, a plain request served."""
    assert_settled(client, sim_rig.url, sim_rig.plain)
