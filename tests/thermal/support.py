"""A stand-in for NVIDIA's dcgm-exporter: serves given DCGM readings as Prometheus text.

It is not the thing under test (the gateway's scrape, tiers and triggers are): it only
renders the exporter's format (one line per GPU with ``gpu``/``UUID`` labels) from values
the test sets, and counts scrapes so a test can wait for the gateway to have seen a change.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.scripted import wait_for


@dataclass
class Gpu:
    """One GPU's readings (°C, W, W, MHz, last Xid code, DBE counter)."""

    temp_c: float = 50.0
    power_w: float = 300.0
    power_limit_w: float = 700.0
    sm_clock_mhz: float = 1980.0
    xid: int = 0
    ecc_dbe: float = 0.0


FIELDS = (
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "temp_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "power_w"),
    ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "power_limit_w"),
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "sm_clock_mhz"),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "xid"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "ecc_dbe"),
)


def dcgm_text(gpus: list[Gpu]) -> str:
    """The exporter's exposition for ``gpus`` (labels as dcgm-exporter writes them)."""
    out: list[str] = []
    for name, kind, attr in FIELDS:
        out.append(f"# HELP {name} {attr}")
        out.append(f"# TYPE {name} {kind}")
        for i, g in enumerate(gpus):
            labels = (
                f'gpu="{i}",UUID="GPU-{i:04d}",device="nvidia{i}",'
                f'modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"'
            )
            out.append(f"{name}{{{labels}}} {getattr(g, attr)}")
    return "\n".join(out) + "\n"


@dataclass
class DcgmStub:
    """``url`` serves :func:`dcgm_text` of ``gpus``; ``status`` other than 200 answers an
    error instead. ``scrapes`` counts requests."""

    gpus: list[Gpu] = field(default_factory=lambda: [Gpu()])
    status: int = 200
    scrapes: int = 0
    url: str = ""

    def __post_init__(self) -> None:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub.scrapes += 1
                if stub.status != 200:
                    body = b"exporter error\n"
                    self.send_response(stub.status)
                else:
                    body = dcgm_text(stub.gpus).encode()
                    self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def set(self, **values: Any) -> None:
        """Set fields on every GPU."""
        for g in self.gpus:
            for k, v in values.items():
                setattr(g, k, v)

    def wait_scraped(self, times: int = 2, timeout: float = 10.0) -> None:
        """Wait until the gateway has scraped ``times`` more times (it saw the change)."""
        target = self.scrapes + times
        if not wait_for(lambda: self.scrapes >= target, timeout):
            raise TimeoutError("the gateway did not scrape the GPU metrics")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
