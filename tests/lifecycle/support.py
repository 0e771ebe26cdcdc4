"""Helpers of the lifecycle tests: simulated backends that can be killed and restarted on
their port, a raw SSE reader that keeps every event (so ``[DONE]`` and error events are
seen exactly as a client sees them), admin and metrics readers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim import SimConfig, SimServerThread
from gateway.sim.engine import EngineParams
from tests.support.scripted import wait_for

MODEL = "m1"
LINES = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


def chat_body(max_tokens: int = 8, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """A chat request for ``m1`` producing exactly ``max_tokens`` tokens (``ignore_eos``)."""
    body: dict[str, Any] = {"model": MODEL, "messages": LINES, "max_tokens": max_tokens,
                            "ignore_eos": True, "temperature": 0}
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def sdk(base_url: str) -> openai.OpenAI:
    """The openai SDK pointed at the gateway (no retries: every error is seen)."""
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=30)


def sdk_kwargs(max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    """:func:`chat_body` as ``openai`` SDK keyword arguments (vLLM fields in ``extra_body``)."""
    body = chat_body(max_tokens, stream)
    return {**{k: v for k, v in body.items() if k != "ignore_eos"},
            "extra_body": {"ignore_eos": True}}


# ---- simulated backends -----------------------------------------------------------------------

class Sim:
    """One simulated vLLM serving ``m1`` (``engine_label`` = its name, so its
    ``system_fingerprint`` differs from its peers'). ``itl_s`` is the decode step (seconds
    per token of a lone stream). ``kill()`` stops it (port closed: connection refused);
    ``restart()`` serves a fresh one with the same config on the same port. ``host`` /
    ``port``: where it listens (default a free port on 127.0.0.1)."""

    def __init__(self, name: str, itl_s: float = 0.01, max_num_seqs: int = 16,
                 host: str = "127.0.0.1", port: int = 0, **config: Any) -> None:
        self.name = name
        self.host = host
        engine = EngineParams(itl_base_s=itl_s, itl_per_seq_s=0.0, max_num_seqs=max_num_seqs)
        self.config = SimConfig(model=MODEL, engine_label=name, engine=engine, **config)
        self.server = SimServerThread(self.config, host=host, port=port)
        self.url = self.server.start()
        self.port = int(self.url.rsplit(":", 1)[1])
        self.alive = True

    @property
    def fingerprint(self) -> str:
        return self.server.state.fingerprint

    def kill(self) -> None:
        self.server.stop()
        self.alive = False

    def restart(self) -> None:
        self.server = SimServerThread(self.config, host=self.host, port=self.port)
        assert self.server.start() == self.url
        self.alive = True

    def stop(self) -> None:
        if self.alive:
            self.kill()

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/sim/stats", timeout=5).json()  # type: ignore[no-any-return]

    def chat_requests(self) -> int:
        return int(self.stats()["requests_by_path"].get("/v1/chat/completions", 0))

    def recent_ids(self) -> set[str]:
        """``x-request-id`` of the recent generation requests it received."""
        return {r["headers"].get("x-request-id", "") for r in self.stats()["recent_requests"]}


# ---- a client's view of one stream --------------------------------------------------------

@dataclass
class StreamResult:
    """Everything a client saw of one streaming request. Times are ``time.monotonic()``."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""  # the whole body for a non-SSE answer
    events: list[str] = field(default_factory=list)  # each event's data payload, in order
    started: float = 0.0
    first_event_at: float | None = None
    ended: float = 0.0
    transport_error: str | None = None

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [c["error"] for c in self.chunks if "error" in c]

    @property
    def done_count(self) -> int:
        return self.events.count("[DONE]")

    @property
    def content(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in self.chunks if c.get("choices"))

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0].get("finish_reason") for c in self.chunks if c.get("choices")]
        return next((r for r in reversed(reasons) if r), None)

    @property
    def fingerprint(self) -> str | None:
        return next((c["system_fingerprint"] for c in self.chunks
                     if c.get("system_fingerprint")), None)

    def problem(self) -> str | None:
        """Why this is not one well-formed OpenAI stream answer (None when it is): a 200
        ``text/event-stream`` whose events are JSON chunks, ending with exactly one
        ``[DONE]`` as the last event; an error, if any, is one OpenAI-shaped error event
        right before ``[DONE]`` (never a silent cut)."""
        if self.transport_error:
            return f"transport error: {self.transport_error}"
        if self.status != 200:
            return f"status {self.status}: {self.body[:200]!r}"
        if not self.headers.get("content-type", "").startswith("text/event-stream"):
            return f"content-type {self.headers.get('content-type')}"
        if self.done_count != 1 or self.events[-1] != "[DONE]":
            return f"[DONE] x{self.done_count}, last event {self.events[-1:]!r} (cut stream)"
        try:
            chunks = self.chunks
        except ValueError as e:
            return f"event is not JSON: {e}"
        errs = [i for i, c in enumerate(chunks) if "error" in c]
        if errs:
            if errs != [len(chunks) - 1]:
                return f"error event not last before [DONE]: {errs} of {len(chunks)}"
            err = chunks[-1]["error"]
            if not {"message", "type", "code"} <= set(err) or not err["message"]:
                return f"error event not OpenAI-shaped: {err}"
        return None


def stream_chat(base_url: str, body: dict[str, Any], request_id: str | None = None,
                timeout: float = 60, on_first_event: Callable[[], None] | None = None,
                headers: dict[str, str] | None = None) -> StreamResult:
    """POST a streaming chat request (with ``headers``) and read it to its end, keeping
    every event."""
    res = StreamResult(started=time.monotonic())
    headers = dict(headers or {})
    if request_id:
        headers["x-request-id"] = request_id
    buf = b""
    try:
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body,
                          headers=headers, timeout=timeout) as r:
            res.status = r.status_code
            res.headers = {k.lower(): v for k, v in r.headers.items()}
            if not res.headers.get("content-type", "").startswith("text/event-stream"):
                res.body = r.read()
            else:
                for data in r.iter_raw():
                    buf += data
                    while b"\n\n" in buf:
                        raw, buf = buf.split(b"\n\n", 1)
                        lines = [ln for ln in raw.split(b"\n") if not ln.startswith(b":")]
                        if not lines:
                            continue
                        payload = b"\n".join(ln[6:] if ln.startswith(b"data: ") else ln
                                             for ln in lines)
                        res.events.append(payload.decode())
                        if res.first_event_at is None:
                            res.first_event_at = time.monotonic()
                            if on_first_event is not None:
                                on_first_event()
                if buf.strip():
                    res.events.append("<partial>" + buf.decode(errors="replace"))
    except httpx.HTTPError as e:
        res.transport_error = f"{type(e).__name__}: {e}"
    res.ended = time.monotonic()
    return res


class Background:
    """Run ``fn`` in a daemon thread; ``result()`` joins and returns (or re-raises)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._err: list[BaseException] = []

        def run() -> None:
            try:
                self._out.append(fn())
            except BaseException as e:
                self._err.append(e)

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()

    def result(self, timeout: float = 60) -> Any:
        self._t.join(timeout)
        assert not self._t.is_alive(), "background call did not finish"
        if self._err:
            raise self._err[0]
        return self._out[0]


# ---- admin API and metrics ------------------------------------------------------------------

def admin(base_url: str, backend: str | None = None) -> Any:
    """``GET /admin/backends`` (a list) or ``GET /admin/backends/{id}`` (one, with history)."""
    if backend is None:
        return httpx.get(base_url + "/admin/backends", timeout=5).json()["backends"]
    return httpx.get(f"{base_url}/admin/backends/{backend}", timeout=5).json()


def post_admin(base_url: str, backend: str, action: str, body: Any = None) -> httpx.Response:
    return httpx.post(f"{base_url}/admin/backends/{backend}/{action}", json=body, timeout=5)


def history(base_url: str, backend: str) -> list[tuple[str, str, str]]:
    """A backend's transitions as ``(from, to, reason)``, oldest first."""
    return [(t["from"], t["to"], t["reason"]) for t in admin(base_url, backend)["history"]]


def wait_state(base_url: str, backend: str, state: str, timeout: float = 10,
               **fields: Any) -> dict[str, Any]:
    """Poll ``GET /admin/backends/{id}`` until its state is ``state`` (and ``fields`` match)."""
    seen: list[dict[str, Any]] = []

    def reached() -> bool:
        seen.append(admin(base_url, backend))
        b = seen[-1]
        return b["state"] == state and all(b.get(k) == v for k, v in fields.items())

    if not wait_for(reached, timeout):
        raise AssertionError(f"{backend} not {state} {fields} in {timeout} s: {seen[-1]}")
    return seen[-1]


class Monitor:
    """Samples ``GET /admin/backends`` every ~30 ms in a thread: a list of
    ``(monotonic time, {backend id: its summary})``."""

    def __init__(self, base_url: str, every_s: float = 0.03) -> None:
        self.samples: list[tuple[float, dict[str, dict[str, Any]]]] = []
        self._stop = threading.Event()

        def run() -> None:
            with httpx.Client(timeout=5) as c:
                while not self._stop.is_set():
                    try:
                        bs = c.get(base_url + "/admin/backends").json()["backends"]
                    except httpx.HTTPError:
                        return  # the gateway stopped (a failed test's teardown)
                    self.samples.append((time.monotonic(), {b["id"]: b for b in bs}))
                    time.sleep(every_s)

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()

    def wait_latest(self, pred: Callable[[dict[str, dict[str, Any]]], bool],
                    timeout: float = 5) -> bool:
        """Wait until the latest sample (``{backend id: its summary}``) satisfies ``pred``."""
        return wait_for(lambda: bool(self.samples) and pred(self.samples[-1][1]), timeout)

    def stop(self) -> list[tuple[float, dict[str, dict[str, Any]]]]:
        self._stop.set()
        self._t.join(5)
        return self.samples


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric_samples(base_url: str) -> Samples:
    """``GET /metrics`` as ``{(sample name, sorted labels): value}``."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of one sample (labels must match exactly), or None when absent."""
    return samples.get((name, tuple(sorted(labels.items()))))


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (summed
    over the others, e.g. ``gateway_requests_total`` by model and version); 0 when none."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= set(lbl))


def out_intervals(hist: Iterable[dict[str, Any]], end: float) -> list[tuple[float, float]]:
    """Wall-clock intervals during which a backend was out of rotation (not ``warm``),
    from its transition history (``at`` unix seconds); an open one ends at ``end``."""
    out: list[tuple[float, float]] = []
    start: float | None = None
    for t in hist:
        if t["to"] != "warm" and start is None:
            start = t["at"]
        elif t["to"] == "warm" and start is not None:
            out.append((start, t["at"]))
            start = None
    if start is not None:
        out.append((start, end))
    return out


def pin_on_a(url: str, start: list[Any], expect_in_flight: int) -> list[Background]:
    """Start ``start`` (callables) while only ``a`` is routable, so they all land on ``a``:
    ``b`` is drained (idle, so at once), the requests start and reach ``a``, then ``b`` is
    undrained. Returns the running calls."""
    assert post_admin(url, "b", "drain").status_code == 202
    wait_state(url, "b", "draining", drained=True)
    running = [Background(fn) for fn in start]
    assert wait_for(lambda: admin(url, "a")["in_flight"] >= expect_in_flight, 10, 0.01), (
        admin(url, "a"))
    assert post_admin(url, "b", "undrain").status_code == 200
    wait_state(url, "b", "warm")
    return running
