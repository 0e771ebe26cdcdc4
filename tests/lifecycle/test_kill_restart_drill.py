"""The kill/restart drill: backends are killed (port closed) and restarted on the same port
under a steady mixed load (streams and non-streams from several client threads); every
client request still gets exactly one well-formed answer (case BUG-19's promise, under the
lifecycle: detection, failover before the first byte, recovery through warm-up and slow
start)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx

from tests.lifecycle.support import StreamResult, admin, chat_body, stream_chat, wait_state


@dataclass
class Outcome:
    """One client request: which client thread sent it, kind, monotonic start/end, what was
    wrong (None: a complete answer), whether it ended with an error event, and who served
    it."""

    client: int
    stream: bool
    start: float
    end: float
    problem: str | None
    error_event: str | None = None
    finish: str | None = None
    served_by: str | None = None


def test_kill_restart_drill_every_request_one_well_formed_answer(sims, lc_gateway):
    """Three simulated backends, warm-up and slow start on, cycles off; 4 client threads
    alternate streaming and non-streaming requests for ~7.5 s. A is killed at 1 s and
    restarted at 3 s; B is killed at 4.5 s and restarted at 6.5 s.

    * Every request gets exactly one answer, and it is well-formed: a non-stream is a 200
      ``chat.completion`` with one choice (failover before any byte: never a 5xx while
      other backends are up); a stream is a 200 event stream ending with exactly one
      ``[DONE]``, with at most one OpenAI-shaped error event right before it.
    * Answers ended early (a stream's error event, or ``finish_reason`` ``abort`` from the
      simulator's own shutdown, as vLLM aborts its requests when stopped) only when they were
      in flight at a kill, never otherwise.
    * The load is steady through both outages: requests are in flight at each kill, and
      every client thread sends requests, streams and non-streams among them, while each
      backend is down.
    * Both killed backends come back (``warm``) and serve again.
    The counts are printed (``-s``)."""
    sim = {n: sims(n, itl_s=0.01) for n in ("A", "B", "C")}
    gw = lc_gateway({n.lower(): s.url for n, s in sim.items()},
                    lifecycle={"warmup_batch_shapes": [1, 2, 4, 8], "slow_start_s": 1.0})
    url = gw.url
    fp = {s.fingerprint: n for n, s in sim.items()}
    outcomes: list[Outcome] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(i: int) -> None:
        stream = i % 2 == 0
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                if stream:
                    r: StreamResult = stream_chat(url, chat_body(20, stream=True))
                    o = Outcome(i, True, r.started, r.ended, r.problem(),
                                r.errors[0]["code"] if r.errors else None, r.finish_reason,
                                fp.get(r.fingerprint or ""))
                else:
                    t0 = time.monotonic()
                    try:
                        resp = c.post(url + "/v1/chat/completions", json=chat_body(20))
                        body = resp.json()
                        ok = (resp.status_code == 200 and body.get("object") == "chat.completion"
                              and len(body["choices"]) == 1)
                        o = Outcome(i, False, t0, time.monotonic(),
                                    None if ok else f"{resp.status_code} {resp.text[:200]}",
                                    finish=body["choices"][0]["finish_reason"] if ok else None,
                                    served_by=fp.get(body.get("system_fingerprint", "")))
                    except (httpx.HTTPError, ValueError) as e:
                        o = Outcome(i, False, t0, time.monotonic(),
                                    f"{type(e).__name__}: {e}")
                with lock:
                    outcomes.append(o)
                stream = not stream
                time.sleep(0.02)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    kills: list[tuple[float, float]] = []  # (kill started, port closed)
    restarts: list[float] = []  # restart done (serving on its port again)

    def at(t: float) -> None:
        time.sleep(max(0.0, t0 + t - time.monotonic()))

    def kill(name: str) -> None:
        k = time.monotonic()
        sim[name].kill()
        kills.append((k, time.monotonic()))

    at(1.0)
    kill("A")
    at(3.0)
    sim["A"].restart()
    restarts.append(time.monotonic())
    at(4.5)
    kill("B")
    at(6.5)
    sim["B"].restart()
    restarts.append(time.monotonic())
    at(7.5)
    stop.set()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)

    def at_kill(o: Outcome) -> bool:
        return any(o.start - 0.05 <= k_end and k_start <= o.end + 0.05
                   for k_start, k_end in kills)

    # the requests started while A, then B, was down (port closed, until its restart)
    down = [[o for o in outcomes if k_end <= o.start < back]
            for (_, k_end), back in zip(kills, restarts, strict=True)]
    bad = [o for o in outcomes if o.problem is not None]
    early = [o for o in outcomes if o.error_event or o.finish == "abort"]
    streams = [o for o in outcomes if o.stream]
    summary = {
        "requests": len(outcomes),
        "streams": len(streams),
        "non_streams": len(outcomes) - len(streams),
        "complete": len([o for o in outcomes if o.problem is None and o not in early]),
        "ended_early_at_a_kill": len([o for o in early if at_kill(o)]),
        "malformed": len(bad),
        "started_while_down": [len(w) for w in down],
    }
    print("drill:", summary)
    assert not bad, [(o.stream, o.problem) for o in bad[:5]]
    assert [o for o in early if not at_kill(o)] == [], [
        (round(o.start - t0, 2), round(o.end - t0, 2), o.error_event, o.finish)
        for o in early if not at_kill(o)]
    # The load was steady through both outages (checked per client thread, not as a total
    # against the clock: a slow machine serves fewer requests, yet each of its threads
    # still sends some during each 2 s outage).
    for k_start, k_end in kills:
        assert any(o.start <= k_end and k_start <= o.end for o in outcomes), summary
    for w in down:
        sent = sorted((o.client, o.stream) for o in w)
        assert {o.client for o in w} == set(range(len(threads))), (sent, summary)
        assert {o.stream for o in w} == {True, False}, (sent, summary)
    for name in ("a", "b"):
        wait_state(url, name, "warm", timeout=10)
        assert any(t["to"] == "unhealthy" for t in admin(url, name)["history"])
    served_late = {o.served_by for o in outcomes if o.start > t0 + 4.5}
    assert "A" in served_late, served_late  # A is back in rotation after its restart
