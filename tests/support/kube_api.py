"""A local DOUBLE of the Kubernetes API server: it stands in for the one thing that cannot run
here (a cluster's API server), at its protocol boundary, so that the gateway's Kubernetes
code runs with the real client library (``kubernetes_asyncio``) over real HTTP.

It speaks the list + watch protocol of the API concepts page
(kubernetes.io/docs/reference/using-api/api-concepts/) for two collections:

* ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`` and
* ``GET /api/v1/nodes``:

  - a list answers ``{"kind": ...List, "metadata": {"resourceVersion"}, "items"}``, every
    object with its own ``metadata.resourceVersion`` (one counter for the whole double, as
    etcd's revision);
  - ``labelSelector``: equality (``k=v``, ``k==v``, ``k!=v``) and existence (``k``,
    ``!k``) terms, comma-separated;
  - ``?watch=true&resourceVersion=N``: newline-delimited JSON events (``ADDED``,
    ``MODIFIED``, ``DELETED``; an object that stops or starts matching the selector is
    ``DELETED`` / ``ADDED``, as the API server's watch cache does) after ``N``, then live;
    ``BOOKMARK`` events (only ``metadata.resourceVersion``) to watches that asked
    ``allowWatchBookmarks=true``, when the test calls :meth:`KubeApiDouble.bookmark`;
    ``timeoutSeconds`` ends the stream cleanly; a ``resourceVersion`` older than the
    retained history (:meth:`KubeApiDouble.compact`) gets **410 Gone**: an ``ERROR`` event
    with a ``Status`` of code 410 (what API servers send today), or with
    ``gone_as_status=True`` a plain 410 answer;
* ``DELETE /api/v1/namespaces/{ns}/pods/{name}``: recorded (:attr:`deleted_pods`); 404 for
  a pod it does not know (:meth:`put_pod`, or a slice endpoint's ``targetRef``).

Its state (objects, resourceVersions, history, selectors) is ``tests/support/kube_store.py``.

Every request needs ``Authorization: Bearer <token>`` (401 otherwise; a collection in
:attr:`forbidden` answers 403, as without RBAC) and is logged in :attr:`requests`. The test
drives it: :meth:`put_slice`, :meth:`delete_slice`, :meth:`put_node`, :meth:`delete_node`,
:meth:`drop_watches` (connections cut mid-stream), :meth:`end_watches` (as a watch
timeout), :meth:`set_down` (every connection cut at once);
:meth:`write_kubeconfig` writes a kubeconfig file that points at it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.support.kube_store import (
    NODES,
    SLICES,
    Change,
    KubeStore,
    Obj,
    endpoint,
    node_object,
    slice_object,
)
from tests.support.servers import LoopThread, bound_socket


@dataclass(eq=False)
class _Watch:
    resource: str
    namespace: str | None
    selector: str
    bookmarks: bool
    request: web.Request
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (Go's ``strconv.ParseBool``:
    the client library sends Python's ``True``)."""
    return (value or "").lower() in ("1", "t", "true")


def _status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class KubeApiDouble:
    """The DOUBLE of the Kubernetes API server (see the module's docstring). ``url`` once
    started; use as a context manager or call :meth:`start` / :meth:`close`."""

    def __init__(self, token: str = "double-token", gone_as_status: bool = False) -> None:
        self.token = token
        self.gone_as_status = gone_as_status
        self.url = ""
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        """(method, path, query) of every request, in order."""
        self.deleted_pods: list[tuple[str, str]] = []
        """(namespace, name) of every pod deleted."""
        self._store = KubeStore()
        self._pods: set[tuple[str, str]] = set()
        self._watches: set[_Watch] = set()
        self._down = False
        self.forbidden: set[str] = set()
        """Collections (``SLICES``, ``NODES``) answered 403 Forbidden, as without RBAC."""
        self._lt: LoopThread | None = None
        self._runner: web.AppRunner | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> KubeApiDouble:
        self._lt = LoopThread("kube-api-double")
        self._lt.call(self._start())
        return self

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                           self._slices)
        app.router.add_get("/api/v1/nodes", self._nodes)
        app.router.add_delete("/api/v1/namespaces/{ns}/pods/{name}", self._delete_pod)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        sock = bound_socket()
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        if self._lt is None:
            return
        with contextlib.suppress(Exception):
            self._lt.call(self._stop(), timeout=10)
        self._lt.close()
        self._lt = None

    async def _stop(self) -> None:
        self._end_all("drop")
        if self._runner is not None:
            await self._runner.cleanup()

    def __enter__(self) -> KubeApiDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the double's loop (the one owner of its state)."""
        assert self._lt is not None, "start() the double first"

        async def call() -> Any:
            return fn(*args)

        return self._lt.call(call())

    # ---- what tests drive -------------------------------------------------------------------

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig file at ``path`` pointing at this double (token auth)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "double", "user": {"token": self.token}}],
            "contexts": [{"name": "double", "context": {
                "cluster": "double", "user": "double", "namespace": namespace}}],
            "current-context": "double",
        }))
        return path

    def put_slice(self, name: str, endpoints: Iterable[Obj], *,
                  ports: Iterable[Obj] = ({"name": "http", "port": 8000, "protocol": "TCP"},),
                  labels: Mapping[str, str] | None = None, namespace: str = "default",
                  address_type: str = "IPv4") -> int:
        """Create or replace an EndpointSlice (labels default to
        ``app.kubernetes.io/name=vllm``); its endpoints' Pod targets become known pods.
        Returns its resourceVersion."""
        obj = slice_object(name, endpoints, ports,
                           labels or {"app.kubernetes.io/name": "vllm"}, namespace,
                           address_type)
        for e in obj["endpoints"]:
            ref = e.get("targetRef") or {}
            if ref.get("kind") == "Pod":
                self.put_pod(ref["name"], ref.get("namespace", namespace))
        return int(self._run(self._put, SLICES, namespace, obj))

    def delete_slice(self, name: str, namespace: str = "default") -> int:
        return int(self._run(self._delete, SLICES, namespace, name))

    def put_node(self, name: str, *, labels: Mapping[str, str] | None = None,
                 taints: Iterable[Obj] = (), conditions: Iterable[Obj] = ()) -> int:
        """Create or replace a Node (a taint needs ``key`` and ``effect``; a condition
        ``type`` and ``status``). Returns its resourceVersion."""
        obj = node_object(name, labels or {}, taints, conditions)
        return int(self._run(self._put, NODES, None, obj))

    def delete_node(self, name: str) -> int:
        return int(self._run(self._delete, NODES, None, name))

    def put_pod(self, name: str, namespace: str = "default") -> None:
        """A pod that :meth:`_delete_pod` knows (nothing else is kept of it)."""
        self._run(self._pods.add, (namespace, name))

    @property
    def resource_version(self) -> int:
        return int(self._run(lambda: self._store.rv))

    def bookmark(self) -> None:
        """A BOOKMARK at the current resourceVersion to every watch that allows them."""
        self._run(self._bookmark)

    def compact(self) -> None:
        """Forget the history up to now: a watch from an older resourceVersion gets 410."""
        self._run(self._compact)

    def drop_watches(self) -> None:
        """Cut every open watch's connection mid-stream (no end of the chunked body)."""
        self._run(self._end_all, "drop")

    def end_watches(self) -> None:
        """End every open watch cleanly, as its ``timeoutSeconds`` would."""
        self._run(self._end_all, "end")

    def set_down(self, down: bool) -> None:
        """While down, every request's connection is cut at once (and open watches now)."""
        self._run(self._set_down, down)

    def open_watches(self, resource: str = SLICES) -> int:
        return int(self._run(lambda: sum(w.resource == resource for w in self._watches)))

    def calls(self, resource: str, *, watch: bool) -> list[dict[str, str]]:
        """The query of every list (``watch=False``) or watch request of ``resource``."""
        return [q for m, p, q in list(self.requests)
                if m == "GET" and p.endswith("/" + resource)
                and _flag(q.get("watch")) == watch]

    # ---- state (the double's loop only) -----------------------------------------------------

    def _put(self, resource: str, namespace: str | None, obj: Obj) -> int:
        return self._notify(self._store.put(resource, namespace, obj))

    def _delete(self, resource: str, namespace: str | None, name: str) -> int:
        return self._notify(self._store.delete(resource, namespace, name))

    def _notify(self, change: Change) -> int:
        for w in self._watches:
            if w.resource == change.resource:
                w.queue.put_nowait(change)
        return change.rv

    def _bookmark(self) -> None:
        for w in self._watches:
            if w.bookmarks:
                w.queue.put_nowait(("bookmark", self._store.rv))

    def _compact(self) -> None:
        self._store.compact()

    def _end_all(self, how: str) -> None:
        for w in list(self._watches):
            w.queue.put_nowait(how)

    def _set_down(self, down: bool) -> None:
        self._down = down
        if down:
            self._end_all("drop")

    # ---- the HTTP side ----------------------------------------------------------------------

    def _refuse(self, request: web.Request) -> web.StreamResponse | None:
        """Log the request; an answer when it gets no normal one (down, no token)."""
        self.requests.append((request.method, request.path, dict(request.query)))
        if self._down:
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=503)
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        return None

    async def _slices(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, SLICES, request.match_info["ns"],
                                      "EndpointSliceList", "discovery.k8s.io/v1")

    async def _nodes(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, NODES, None, "NodeList", "v1")

    async def _collection(self, request: web.Request, resource: str, namespace: str | None,
                          list_kind: str, api_version: str) -> web.StreamResponse:
        refused = self._refuse(request)
        if refused is not None:
            return refused
        if resource in self.forbidden:
            return web.json_response(_status(
                403, "Forbidden", f'{resource} is forbidden: User "system:serviceaccount:'
                f'default:llm-gateway" cannot list resource "{resource}"'), status=403)
        q = request.query
        selector = q.get("labelSelector", "")
        if _flag(q.get("watch")):
            return await self._watch(request, resource, namespace, selector)
        return web.json_response({"kind": list_kind, "apiVersion": api_version,
                                  "metadata": {"resourceVersion": str(self._store.rv)},
                                  "items": self._store.items(resource, namespace, selector)})

    @staticmethod
    def _event(kind: str, obj: Obj) -> bytes:
        return (json.dumps({"type": kind, "object": obj}) + "\n").encode()

    def _translate(self, w: _Watch, c: Change) -> bytes | None:
        """What ``w`` sees of ``c`` (a line of its stream), or None."""
        seen = self._store.seen_as(c, w.resource, w.namespace, w.selector)
        return None if seen is None else self._event(*seen)

    async def _watch(self, request: web.Request, resource: str, namespace: str | None,
                     selector: str) -> web.StreamResponse:
        q = request.query
        rv_text = q.get("resourceVersion", "")
        since = int(rv_text) if rv_text not in ("", "0") else None
        if since is not None and since < self._store.compacted_rv:
            msg = f"too old resource version: {since} ({self._store.compacted_rv})"
            if self.gone_as_status:
                return web.json_response(_status(410, "Expired", msg), status=410)
            resp = web.StreamResponse(headers={"content-type": "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(self._event("ERROR", _status(410, "Expired", msg)))
            await resp.write_eof()
            return resp
        w = _Watch(resource, namespace, selector,
                   _flag(q.get("allowWatchBookmarks")), request)
        # the backlog is taken and the watch registered with no await between: nothing
        # is missed or sent twice
        backlog = self._store.backlog(resource, since)
        self._watches.add(w)
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        resp.enable_chunked_encoding()
        timeout = float(q.get("timeoutSeconds", "1800"))
        try:
            await resp.prepare(request)
            for c in backlog:
                if (line := self._translate(w, c)) is not None:
                    await resp.write(line)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                try:
                    item = await asyncio.wait_for(w.queue.get(), deadline - loop.time())
                except TimeoutError:
                    break
                if item == "end":
                    break
                if item == "drop":
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if isinstance(item, tuple):  # a bookmark
                    await resp.write(self._event("BOOKMARK", {
                        "kind": "EndpointSlice" if resource == SLICES else "Node",
                        "apiVersion": "discovery.k8s.io/v1" if resource == SLICES else "v1",
                        "metadata": {"resourceVersion": str(item[1])}}))
                    continue
                if (line := self._translate(w, item)) is not None:
                    await resp.write(line)
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        finally:
            self._watches.discard(w)
        return resp

    async def _delete_pod(self, request: web.Request) -> web.StreamResponse:
        refused = self._refuse(request)
        if refused is not None:
            return refused
        ns, name = request.match_info["ns"], request.match_info["name"]
        if (ns, name) not in self._pods:
            return web.json_response(
                _status(404, "NotFound", f'pods "{name}" not found'), status=404)
        self._pods.discard((ns, name))
        self.deleted_pods.append((ns, name))
        return web.json_response({"kind": "Pod", "apiVersion": "v1", "metadata": {
            "name": name, "namespace": ns, "resourceVersion": str(self._store.next_rv()),
            "deletionTimestamp": "2026-01-01T00:00:00Z"}})


__all__ = ["NODES", "SLICES", "KubeApiDouble", "endpoint"]
