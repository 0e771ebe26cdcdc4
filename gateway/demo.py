"""``llm-gateway demo``: simulated vLLM backends plus the gateway, on localhost.

Every backend of the config with a ``sim`` block (a :class:`gateway.sim.config.SimConfig`)
gets a simulator on its URL's host and port; then the gateway serves the config. No GPU
and no other service is needed. Ctrl-C (or SIGTERM) stops everything cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from urllib.parse import urlsplit

import uvicorn

from gateway.app import create_app
from gateway.config import ConfigError, GatewayConfig


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its host program."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def,override]
        yield


def banner(cfg: GatewayConfig, model: str) -> str:
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    base = f"http://{host}:{cfg.server.port}"
    return f"""\
llm-gateway demo: {len([b for b in cfg.backends if b.sim])} simulated vLLM backends behind {base}

  curl {base}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "stream": true}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\
[print(x.choices[0].delta.content or '', end='', flush=True) for x in \\
c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello'}}], stream=True)]"

  backends: curl {base}/admin/backends     metrics: curl {base}/metrics
Ctrl-C stops everything.
"""


async def serve_demo(cfg: GatewayConfig) -> None:
    """Start the simulators, then serve the gateway until a signal arrives."""
    from gateway.sim.config import SimConfig
    from gateway.sim.runner import run_sim_server

    sims = [(b, SimConfig(**b.sim)) for b in cfg.backends if b.sim is not None]
    if not sims:
        raise ConfigError("demo: no backend has a 'sim' block to simulate")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        for b, sc in sims:
            u = urlsplit(b.base_url)
            await stack.enter_async_context(
                run_sim_server(sc, host=u.hostname or "127.0.0.1", port=u.port or 80)
            )
        from gateway.cli import uvicorn_config

        server = EmbeddedServer(uvicorn_config(create_app(cfg), cfg))
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn has no event)
            await asyncio.sleep(0.05)
        if task.done():
            task.result()
            return
        print(banner(cfg, sims[0][1].model), flush=True)
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        waiter.cancel()
        await task


def run_demo(cfg: GatewayConfig, fast_cycles: bool = False) -> int:
    """Blocking entry point of ``llm-gateway demo``; returns the exit status."""
    asyncio.run(serve_demo(cfg))
    return 0
