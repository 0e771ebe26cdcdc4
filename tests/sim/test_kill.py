"""``SimServerThread.kill()``: the simulator goes away as a SIGKILLed vLLM does (the lifecycle
drill's ``--kill-every``): an open stream is cut where it is, with no ``finish_reason`` and no
``[DONE]`` (``stop()``, by contrast, ends it in-band with ``finish_reason`` ``abort``, as
vLLM's own shutdown does); new connections are refused; a restart on the same port serves
again."""

from __future__ import annotations

import httpx
import pytest

from gateway.sim import SimConfig, SimServerThread
from gateway.sim.engine import EngineParams
from tests.lifecycle.support import Background, chat_body, stream_chat
from tests.support.scripted import wait_for


def _sim(port: int = 0) -> SimServerThread:
    engine = EngineParams(itl_base_s=0.02, itl_per_seq_s=0.0)  # 200 tokens: ~4 s
    return SimServerThread(SimConfig(model="m1", engine=engine), port=port)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_kill_cuts_open_streams_where_stop_ends_them_in_band(how: str) -> None:
    sim = _sim()
    url = sim.start()
    started: list[bool] = []
    try:
        bg = Background(lambda: stream_chat(url, chat_body(200, stream=True), timeout=30,
                                            on_first_event=lambda: started.append(True)))
        assert wait_for(lambda: bool(started), 15), "the stream did not start"
        sim.kill() if how == "kill" else sim.stop()
        res = bg.result(30)
    finally:
        sim.stop()
    if how == "stop":  # vLLM's shutdown: aborted in-band, a whole SSE stream
        assert res.problem() is None and res.finish_reason == "abort"
        return
    assert res.done_count == 0, res.events[-3:]  # cut: no [DONE] ...
    assert res.finish_reason is None  # ... and no finish_reason, "abort" or other
    assert 0 < len(res.chunks) < 200
    assert res.transport_error, "the body ended without its chunked terminator"
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)


def test_a_killed_sim_restarts_on_its_port() -> None:
    sim = _sim()
    url = sim.start()
    sim.kill()
    sim.kill()  # idempotent
    again = _sim(int(url.rsplit(":", 1)[1]))
    try:
        assert again.start() == url
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        again.stop()
