"""Kubernetes discovery (``discovery.source: kubernetes``): the backends are the endpoints of
the EndpointSlices matching a label selector, and (``watch_nodes``) the nodes say where
they run and when a spot node is about to be reclaimed. Official async client
(``kubernetes_asyncio``); what the objects mean is pure code in
:mod:`gateway.fleet.kube_objects`.

**The watch protocol** (kubernetes.io/docs/reference/using-api/api-concepts/, "Efficient
detection of changes"), one :class:`Reflector` per collection: list, keep the objects by
name, then watch from the list's ``resourceVersion`` with ``allowWatchBookmarks`` and
``timeoutSeconds`` = ``watch_timeout_s``; each event (ADDED, MODIFIED, DELETED) updates the
objects and its ``resourceVersion`` becomes the one to resume from, as does a BOOKMARK's.

* a watch that ends (its timeout): watch again from the last ``resourceVersion``, no list;
* **410 Gone** (an ERROR event with code 410, or a 410 answer: that version is older than
  the server keeps): list again at once (after ``retry_s`` when it happens twice in a row);
* any other failure (connection refused or dropped, a silent connection, a 5xx, 401/403,
  bad config): the source reports :meth:`~gateway.fleet.discovery.DiscoverySink.outage`
  (EndpointSlices only: the node watch's failures are logged), waits ``retry_s`` and lists
  again. Nothing is reported as gone during an outage: the sink keeps the last fleet, and
  the next list's snapshot ends the outage.

After the list and after every change of the merged endpoint set the sink gets the
**whole** set (:meth:`~gateway.fleet.discovery.DiscoverySink.endpoints`); likewise the
nodes (:meth:`~gateway.fleet.discovery.DiscoverySink.nodes`), and each spot interruption
notice once per node and reason (:meth:`~gateway.fleet.discovery.DiscoverySink.spot_notice`;
again only after the taint or condition went away and came back).

**RBAC** the gateway's service account needs: ``endpointslices`` (API group
``discovery.k8s.io``) get, list, watch in the namespace (a Role); with ``watch_nodes``,
``nodes`` (core group) get, list, watch (a ClusterRole: nodes are cluster-scoped).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import ApiClient, ApiException, CoreV1Api, DiscoveryV1Api
from kubernetes_asyncio.config import ConfigException

from gateway.config import KubernetesDiscoveryConfig
from gateway.fleet.discovery import DiscoverySink, Endpoint, NodeInfo, SpotNotice
from gateway.fleet.kube_client import api_client, api_error, default_namespace
from gateway.fleet.kube_objects import (
    Obj,
    merge_slices,
    node_info,
    notice_reasons,
    without_port,
)

log = logging.getLogger("gateway.discovery")

CONNECT_TIMEOUT_S = 10.0
"""Connecting to the API server (seconds)."""
LIST_READ_TIMEOUT_S = 30.0
"""Waiting for a list's answer (seconds)."""
WATCH_SILENCE_MARGIN_S = 30.0
"""A watch silent for ``watch_timeout_s`` plus this (seconds) is dead: the server ends every
watch at its ``timeoutSeconds``, so a longer silence is a lost connection."""

FAILURES: tuple[type[BaseException], ...] = (
    ApiException, aiohttp.ClientError, asyncio.TimeoutError, OSError, ConfigException,
    ValueError,
)
"""What one list or watch is expected to fail with (ValueError: an answer that is not the
API's JSON). Anything else (``kubernetes_asyncio``'s Watch raises a plain ``Exception`` for
a line without ``type`` / ``object``) is logged with its traceback and handled the same
way: the source never stops."""


class Gone(Exception):
    """The API server no longer has the ``resourceVersion`` a watch asked for (410)."""


def _reason(e: BaseException) -> str:
    """One line for a failure (``ApiException``'s own text spans lines)."""
    if isinstance(e, ApiException):
        return api_error(e)
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


ListCall = Callable[..., Awaitable[Any]]


class Reflector:
    """List + watch of one collection (``list_call`` with ``kwargs``: a
    ``kubernetes_asyncio`` list method and its namespace / selector), keeping its objects
    by name (the API's JSON). ``on_sync(objects, listed)`` runs after every list
    (``listed`` True) and every event that changed an object; ``on_failure(reason)`` after a
    failure, before the wait of ``retry_s`` seconds and the next list."""

    def __init__(
        self,
        what: str,
        client: ApiClient,
        list_call: ListCall,
        kwargs: Mapping[str, Any],
        *,
        watch_timeout_s: int,
        retry_s: float,
        on_sync: Callable[[Mapping[str, Obj], bool], None],
        on_failure: Callable[[str], None],
    ) -> None:
        self.what = what
        self.client = client
        self.list_call = list_call
        self.kwargs = dict(kwargs)
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.on_sync = on_sync
        self.on_failure = on_failure
        self.objects: dict[str, Obj] = {}
        self.resource_version: str | None = None
        self.lists = 0
        """Lists made (the first and every relist)."""

    async def run(self) -> None:
        """List and watch until cancelled; never raises but ``CancelledError``."""
        gone_in_a_row = 0
        while True:
            try:
                await self._list()
                self.on_sync(self.objects, True)
                while True:
                    await self._watch()
                    gone_in_a_row = 0
            except Gone as e:
                gone_in_a_row += 1
                log.info("%s watch: %s; listing again", self.what, e)
                if gone_in_a_row > 1:
                    await asyncio.sleep(self.retry_s)
            except Exception as e:
                if not isinstance(e, FAILURES):
                    log.exception("%s list/watch: unexpected failure", self.what)
                gone_in_a_row = 0
                self.on_failure(_reason(e))
                await asyncio.sleep(self.retry_s)

    async def _list(self) -> None:
        result = await self.list_call(
            **self.kwargs, _request_timeout=(CONNECT_TIMEOUT_S, LIST_READ_TIMEOUT_S)
        )
        body = self.client.sanitize_for_serialization(result)
        if not isinstance(body, dict):
            raise ValueError(f"{self.what} list: not an object")
        self.lists += 1
        self.objects = {
            str(item["metadata"]["name"]): item for item in body.get("items") or ()
        }
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        log.debug("%s: listed %d at resourceVersion %s",
                  self.what, len(self.objects), self.resource_version)

    async def _watch(self) -> None:
        """One watch call from :attr:`resource_version` until the server ends it."""
        w = watch.Watch(return_type="object")  # events' objects stay the API's JSON
        try:
            stream = w.stream(
                self.list_call,
                **self.kwargs,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_s,
                _request_timeout=(
                    CONNECT_TIMEOUT_S, self.watch_timeout_s + WATCH_SILENCE_MARGIN_S
                ),
            )
            async for event in stream:
                if not isinstance(event, dict) or "type" not in event:
                    raise ValueError(f"{self.what} watch: unexpected line {str(event)[:80]!r}")
                if w.resource_version:
                    self.resource_version = str(w.resource_version)
                kind = event["type"]
                obj = event.get("raw_object") or {}
                name = str((obj.get("metadata") or {}).get("name", ""))
                if kind in ("ADDED", "MODIFIED"):
                    self.objects[name] = obj
                elif kind == "DELETED":
                    self.objects.pop(name, None)
                else:  # BOOKMARK: only its resourceVersion (taken above)
                    continue
                self.on_sync(self.objects, False)
        except ApiException as e:
            if e.status == 410:
                raise Gone(_reason(e)) from e
            raise
        finally:
            await w.close()


class KubeSource:
    """The ``kubernetes`` discovery source (a
    :class:`~gateway.fleet.discovery.DiscoverySource`) for ``cfg``: the EndpointSlices
    matching ``cfg.label_selector`` in ``cfg.namespace`` (None: the gateway pod's own, else
    ``default``), and with ``cfg.watch_nodes`` every node. See the module's docstring for
    the protocol and the RBAC it needs."""

    name = "kubernetes"

    def __init__(self, cfg: KubernetesDiscoveryConfig) -> None:
        self.cfg = cfg
        self.namespace = cfg.namespace or default_namespace()
        self.slices: Reflector | None = None
        self.nodes: Reflector | None = None
        self._sink: DiscoverySink | None = None
        self._reported: list[Endpoint] | None = None
        self._node_infos: dict[str, NodeInfo] | None = None
        self._noticed: set[tuple[str, str]] = set()
        self._last_failure: dict[str, str] = {}

    async def run(self, sink: DiscoverySink) -> None:
        """Report to ``sink`` until cancelled (never raises but ``CancelledError``)."""
        self._sink = sink
        while True:
            try:
                client = await api_client(self.cfg.kubeconfig)
            except FAILURES as e:
                self._slices_failed(f"kubernetes client config: {_reason(e)}")
                await asyncio.sleep(self.cfg.retry_s)
                continue
            try:
                await self._run_with(client, sink)
            finally:
                await client.close()

    async def _run_with(self, client: ApiClient, sink: DiscoverySink) -> None:
        cfg = self.cfg
        self.slices = Reflector(
            "EndpointSlices", client, DiscoveryV1Api(client).list_namespaced_endpoint_slice,
            {"namespace": self.namespace, "label_selector": cfg.label_selector},
            watch_timeout_s=cfg.watch_timeout_s, retry_s=cfg.retry_s,
            on_sync=self._slices_synced, on_failure=self._slices_failed,
        )
        runs = [self.slices.run()]
        if cfg.watch_nodes:
            self.nodes = Reflector(
                "nodes", client, CoreV1Api(client).list_node, {},
                watch_timeout_s=cfg.watch_timeout_s, retry_s=cfg.retry_s,
                on_sync=self._nodes_synced, on_failure=self._nodes_failed,
            )
            runs.append(self.nodes.run())
        async with asyncio.TaskGroup() as tg:
            for r in runs:
                tg.create_task(r)

    # ---- EndpointSlices ---------------------------------------------------------------------

    def _slices_synced(self, slices: Mapping[str, Obj], listed: bool) -> None:
        if listed:
            self._warn_if_misconfigured(slices)
        endpoints = merge_slices(slices, self.cfg.port_name, self.cfg.scheme)
        if listed or endpoints != self._reported:
            self._reported = endpoints
            self._last_failure.pop("slices", None)
            assert self._sink is not None
            self._sink.endpoints(endpoints)

    def _warn_if_misconfigured(self, slices: Mapping[str, Obj]) -> None:
        """After a list: say (once per distinct problem) when no EndpointSlice matches the
        selector (a Service always has one, even without pods: none at all means a wrong
        ``label_selector`` or ``namespace``), or when matching slices lack ``port_name``
        (their endpoints are skipped)."""
        cfg = self.cfg
        if not slices:
            line = (f"no EndpointSlice in namespace {self.namespace} matches label_selector "
                    f"{cfg.label_selector!r} (a Service has one even with no pods: check "
                    "discovery.kubernetes.label_selector and namespace)")
        else:
            names = without_port(slices, cfg.port_name)
            line = (f"EndpointSlices {', '.join(names)} have no port named {cfg.port_name!r}: "
                    "their endpoints are skipped (check discovery.kubernetes.port_name)"
                    ) if names else ""
        if line and self._last_failure.get("config") != line:
            log.warning("kubernetes discovery: %s", line)
        self._last_failure["config"] = line

    def _slices_failed(self, reason: str) -> None:
        self._log_failure("slices", f"EndpointSlices in {self.namespace}: {reason}")
        if self._sink is not None:
            self._sink.outage(reason)

    # ---- nodes -------------------------------------------------------------------------------

    def _nodes_synced(self, nodes: Mapping[str, Obj], listed: bool) -> None:
        assert self._sink is not None
        infos = {name: node_info(obj) for name, obj in nodes.items()}
        if listed or infos != self._node_infos:
            self._node_infos = infos
            self._last_failure.pop("nodes", None)
            self._sink.nodes(infos)
        seen: set[tuple[str, str]] = set()
        for name, obj in nodes.items():
            for reason in notice_reasons(obj):
                seen.add((name, reason))
                if (name, reason) in self._noticed:
                    continue
                info = infos[name]
                log.warning("node %s (zone %s, %s): spot interruption notice (%s)",
                            name, info.zone, info.instance_type, reason)
                self._sink.spot_notice(SpotNotice(
                    zone=info.zone, node=name, instance_type=info.instance_type, reason=reason,
                    capacity_type=info.capacity_type,
                ))
        self._noticed = seen

    def _nodes_failed(self, reason: str) -> None:
        self._log_failure("nodes", f"nodes: {reason} (placement and spot notices wait)")

    def _log_failure(self, what: str, line: str) -> None:
        """Each distinct failure logged once as a warning, repeats at debug."""
        if self._last_failure.get(what) != line:
            self._last_failure[what] = line
            log.warning("kubernetes discovery: %s; retrying every %gs", line, self.cfg.retry_s)
        else:
            log.debug("kubernetes discovery: %s", line)


__all__ = ["FAILURES", "Gone", "KubeSource", "Reflector"]
