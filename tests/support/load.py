"""Client load for tests: threads streaming chat completions through the ``openai`` SDK."""

from __future__ import annotations

import threading

from tests.lifecycle.support import sdk, sdk_kwargs


class StreamLoad:
    """``workers`` threads streaming chats (20 tokens each) through ``url`` until
    :meth:`stop`; ``ok`` counts the streams that ended well, ``failures`` says the others."""

    def __init__(self, url: str, workers: int = 6) -> None:
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(url,), daemon=True) for _ in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _run(self, url: str) -> None:
        client = sdk(url)
        while not self._stop.is_set():
            try:
                list(client.chat.completions.create(**sdk_kwargs(20, True)))
                self.ok += 1
            except Exception as e:
                self.failures.append(f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        """End the streams (each thread finishes its current one, 30 s at most)."""
        self._stop.set()
        for t in self._threads:
            t.join(30)
