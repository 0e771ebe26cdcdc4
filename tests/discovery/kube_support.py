"""What the Kubernetes discovery tests share: the API DOUBLE (``tests/support/kube_api.py``,
standing in for a cluster's API server), a sink that records what a source reports, and a
running :class:`~gateway.fleet.kube_source.KubeSource` against the double."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.config import KubernetesDiscoveryConfig
from gateway.fleet.discovery import Endpoint, NodeInfo, SpotNotice
from gateway.fleet.kube_source import KubeSource
from tests.support.kube_api import KubeApiDouble


class RecordingSink:
    """A :class:`~gateway.fleet.discovery.DiscoverySink` that records every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def endpoints(self, snapshot: Sequence[Endpoint]) -> None:
        self.calls.append(("endpoints", list(snapshot)))

    def outage(self, reason: str) -> None:
        self.calls.append(("outage", reason))

    def nodes(self, nodes: Mapping[str, NodeInfo]) -> None:
        self.calls.append(("nodes", dict(nodes)))

    def spot_notice(self, notice: SpotNotice) -> None:
        self.calls.append(("spot_notice", notice))

    def of(self, kind: str) -> list[Any]:
        return [v for k, v in self.calls if k == kind]

    @property
    def fleet(self) -> dict[str, Endpoint]:
        """The last endpoint set reported, by id ({} before any)."""
        snaps = self.of("endpoints")
        return {e.id: e for e in snaps[-1]} if snaps else {}


async def until(pred: Callable[[], bool], within_s: float = 15.0) -> bool:
    """Poll ``pred`` on the running loop until true or ``within_s`` seconds (generous: the
    test machine is shared)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return pred()


@contextlib.asynccontextmanager
async def running_source(kube: KubeApiDouble, tmp_path: Path,
                         **cfg: Any) -> AsyncIterator[tuple[KubeSource, RecordingSink]]:
    """A KubeSource against the double (its kubeconfig written under ``tmp_path``), fast
    retries, nodes not watched unless asked; cancelled on exit."""
    config = KubernetesDiscoveryConfig(**{
        "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        "namespace": "default", "retry_s": 0.2, "watch_nodes": False, **cfg})
    source, sink = KubeSource(config), RecordingSink()
    task = asyncio.create_task(source.run(sink))
    try:
        yield source, sink
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
