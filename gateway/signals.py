"""The operator signals of issue 19 that :class:`gateway.metrics.GatewayMetrics` exports
beside its own metrics: cost (:class:`CostCollector`), the build's identity
(:func:`build_labels`) and an exposition without ``_created`` series
(:func:`exposition`). Layer 0, next to ``gateway.metrics``: it names what it reads of a
backend as a protocol (:class:`CostSource`), never the fleet's types.

Names follow https://prometheus.io/docs/practices/naming/ (base units, ``_total``
counters, 0-1 ratios in ``_ratio``).
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from typing import Protocol

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gateway.core.cost import COST_WINDOW_S, TokenWindow, accrued_cost, cost_per_million

# TTFT (seconds) of a stream as the client sees it: fine below a second, where SLOs sit
TTFT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)
# ITL (seconds) between two content events: 5 ms to 2 s finely (a decode step is ~10-50 ms);
# 0: events written to the client together
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06,
    0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0,
)


class _Priced(Protocol):
    @property
    def gpu_hour_price(self) -> float | None: ...
    @property
    def gpus(self) -> int: ...


class CostSource(Protocol):
    """What :class:`CostSource` reads of one backend (``gateway.fleet.backend.Backend`` has
    it): its id, its config's price (``gpu_hour_price`` per GPU-hour, ``gpus``), the
    models it serves and when it joined the fleet (monotonic seconds; None: unknown)."""

    @property
    def id(self) -> str: ...
    @property
    def config(self) -> _Priced: ...
    @property
    def models(self) -> tuple[str, ...]: ...
    @property
    def joined_at(self) -> float | None: ...


class CostCollector(Collector):
    """The cost signals, computed at scrape time from each priced backend's
    ``gpu_hour_price`` x ``gpus`` (:func:`gateway.core.cost.accrued_cost`, accrued over
    each interval between two scrapes at that interval's price, so a live price change
    applies from then on, since the backend joined the fleet, ``joined_at``, or since it
    was first collected without one):

    * ``gateway_backend_cost_total{backend}``: currency units the backend's GPUs cost;
    * ``gateway_model_cost_total{model,backend}``: the same split evenly between the
      models the backend serves (at each interval's models);
    * ``gateway_cost_per_million_tokens{model}`` (only with ``per_million``: one process,
      not fleet mode): the model's backends' cost over the last
      :data:`gateway.core.cost.COST_WINDOW_S` seconds over the completion tokens those
      priced backends generated in that window (``tokens``: only priced backends' tokens
      are added to it), x 1e6.

    Both counters are facts about the backend, the same on every replica of a fleet (a
    dashboard takes ``max by (backend)`` of them); the tokens are counted per replica
    (``gateway_backend_generated_tokens_total``, summed over replicas), so the fleet's
    cost per million tokens is the ratio of the two in PromQL (:mod:`gateway.ops.dashboard`).
    Backends without ``gpu_hour_price`` are left out of both counters and of the ratio's
    denominator (their tokens are the dashboard's "unpriced" series); a model without
    priced backends or without their tokens in the window has no gauge sample."""

    def __init__(
        self,
        fleet: Iterable[CostSource],
        tokens: TokenWindow,
        clock: Callable[[], float] = time.monotonic,
        per_million: bool = True,
    ) -> None:
        self._fleet = fleet
        self._tokens = tokens
        self._clock = clock
        self._per_million = per_million
        # backend id -> (cost accrued, monotonic s it was accrued to)
        self._accrued: dict[str, tuple[float, float]] = {}
        # (model, backend id) -> cost accrued to the model on that backend
        self._by_model: dict[tuple[str, str], float] = {}

    def collect(self) -> Iterator[Metric]:
        total = CounterMetricFamily(
            "gateway_backend_cost",
            "Currency units the backend's GPUs cost since it joined the fleet "
            "(backends[].gpu_hour_price x gpus x hours; only backends with a price; the "
            "same on every replica: take max by (backend))",
            labels=["backend"],
        )
        by_model = CounterMetricFamily(
            "gateway_model_cost",
            "gateway_backend_cost_total split evenly between the models the backend serves "
            "(currency units; the same on every replica: take max by (model, backend))",
            labels=["model", "backend"],
        )
        per_m = GaugeMetricFamily(
            "gateway_cost_per_million_tokens",
            "DEPRECATED (one process's view; not exported in fleet mode): cost of the "
            "model's priced backends over the last 5 minutes per million tokens they "
            "generated in them (currency units; absent without a price or without tokens)",
            labels=["model"],
        )
        now = self._clock()
        window_cost: dict[str, float] = {}
        accrued: dict[str, tuple[float, float]] = {}
        split: dict[tuple[str, str], float] = {}
        for b in self._fleet:
            price = b.config.gpu_hour_price
            if price is None:
                continue
            since = b.joined_at if b.joined_at is not None else now
            cost, last = self._accrued.get(b.id, (0.0, since))
            # accrued at the price of each interval: a live price change never lowers it
            step = accrued_cost(price, b.config.gpus, now - last)
            accrued[b.id] = (cost + step, max(now, last))
            total.add_metric([b.id], cost + step)
            models = b.models
            for m in models:
                key = (m, b.id)
                split[key] = self._by_model.get(key, 0.0) + step / len(models)
            if models:
                share = accrued_cost(price, b.config.gpus, min(COST_WINDOW_S, now - since))
                for m in models:
                    window_cost[m] = window_cost.get(m, 0.0) + share / len(models)
        # a backend that left (or lost its price) starts afresh; so does a model it dropped
        self._accrued, self._by_model = accrued, split
        for (model, bid), share in sorted(split.items()):
            by_model.add_metric([model, bid], share)
        if self._per_million:
            for model in sorted(window_cost):
                value = cost_per_million(window_cost[model], self._tokens.total(model, now))
                if value is not None:
                    per_m.add_metric([model], value)
        yield total
        yield by_model
        if self._per_million:
            yield per_m


def gateway_version() -> str:
    """The installed ``llm-gateway`` distribution's version
    (``importlib.metadata.version``: ``pyproject.toml``'s as installed, never a string in
    the code), "unknown" when it is not installed as a distribution. What
    ``gateway_build_info``, the spans' ``service.version`` and the app report."""
    try:
        return metadata.version("llm-gateway")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_labels() -> dict[str, str]:
    """``gateway_build_info``'s labels: :func:`gateway_version`, the Python version and the
    platform (``sys.platform``-``machine``)."""
    return {
        "version": gateway_version(),
        "python": platform.python_version(),
        "platform": f"{sys.platform}-{platform.machine()}",
    }


class _NoCreated:
    """A registry view without the ``_created`` samples of counters, histograms and
    summaries (prometheus_client writes one per series; the gateway's counters start
    with the process, so they say nothing ``process_start_time_seconds`` does not)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.type in ("counter", "histogram", "summary", "gaugehistogram"):
                created = family.name + "_created"
                family.samples = [s for s in family.samples if s.name != created]
            yield family


def exposition(registry: CollectorRegistry) -> bytes:
    """``registry`` in the Prometheus text format, without ``_created`` series
    (:class:`_NoCreated`): what ``GET /metrics`` serves."""
    return generate_latest(_NoCreated(registry))
