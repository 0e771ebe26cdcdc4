"""Merged execution: a merge group sent as one upstream request, its answer split.

The batcher (:mod:`gateway.flow.batching`) dispatches a group of mergeable requests (equal
:func:`gateway.flow.merging.merge_key`) to one backend; :meth:`MergedRequests.run` sends
them as one request through the attempts (:class:`gateway.flow.pipeline.Pipeline`) under a
lease of its own, then gives each member its share of the answer. When the merged request
fails in any way, each member is sent again alone (so one bad input cannot fail its
neighbours), carrying the backend's answer (a 429, a 5xx): a member that no backend takes
then gets that answer as the backend sent it. When every member's client has gone, the
merged request is cancelled (and with it the generation on the backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.core.outcomes import BackendAnswer, Refusal
from gateway.fleet.backend import Backend
from gateway.flow import merging
from gateway.flow.context import Answer, RequestContext
from gateway.flow.lease import Hold, RequestLease
from gateway.flow.pipeline import Pipeline
from gateway.metrics import GatewayMetrics
from gateway.proxy.relay import CutHandle
from gateway.proxy.sse import extract_usage
from gateway.proxy.upstream import UpstreamRequest
from gateway.traffic.batcher import Item

log = logging.getLogger("gateway.flow.merged")

UNMERGED = object()  # a merge failed: send this member again, alone


def has_result(fut: asyncio.Future[Any]) -> bool:
    """Whether ``fut`` holds a result (not cancelled, no exception)."""
    return fut.done() and not fut.cancelled() and fut.exception() is None


@dataclass(slots=True, eq=False)
class Waiter:
    """A request waiting in the batcher's queue: its context, the future its dispatch
    resolves (a backend, a merged share, :data:`UNMERGED`), and its queue state."""

    ctx: RequestContext
    fut: asyncio.Future[Any]
    backend: Backend | None = None
    deadline: asyncio.Timeout | None = None  # the queue timeout, while it is queued
    riding: bool = False  # dispatched in a merged request: out of the queue
    reserved: str | None = None  # the backend kept for it to drain (it needs several places)

    def dispatched(self) -> None:
        """Its queue wait is over (it rides in a merged request): no queue timeout now;
        the merged request's own timeouts apply."""
        self.riding = True
        if self.deadline is not None and not self.fut.done():
            with contextlib.suppress(RuntimeError):  # it expired meanwhile
                self.deadline.reschedule(None)


Holds = tuple[Callable[[], None] | None, Callable[[], None] | None]


class MergedRequests:
    """Runs merge groups (one per app, owned by the batch dispatcher).

    ``new_lease()``: a lease whose freed slots wake the queue; ``reserve(backend, places,
    lease)``: keep places on a backend for a lease; ``deliver(waiter, result)``: resolve a
    waiter (or give back what was kept for it when it left)."""

    def __init__(
        self,
        pipeline: Pipeline,
        metrics: GatewayMetrics,
        new_lease: Callable[[], RequestLease],
        reserve: Callable[[Backend, int, RequestLease], None],
        deliver: Callable[[Waiter, Any], None],
    ) -> None:
        self.pipeline = pipeline
        self.metrics = metrics
        self.new_lease = new_lease
        self.reserve = reserve
        self.deliver = deliver

    async def run(self, unit: list[Item], backend: Backend, holds: Holds) -> None:
        """Send ``unit`` as one upstream request on ``backend`` and answer each member.
        ``holds``: the group's reservation on ``backend`` and its merge-window place
        (release functions, handed over from the head's lease), owned from now on by the
        merged request's lease."""
        reservation, slot = holds
        live: list[Waiter] = [it.handle for it in unit if not it.handle.fut.done()]
        async with self.new_lease() as lease:  # its end wakes the queue for what it frees
            if reservation is not None:
                lease.hold(Hold.RESERVATION, reservation)
            if slot is not None:
                lease.hold(Hold.MERGE_SLOT, slot)
            if len(live) > 1:
                await self._send(live, backend, lease)
            elif live:  # one left: it goes alone, with the group's place in the window
                alone = live[0].ctx
                lease.release(Hold.RESERVATION)
                self.reserve(backend, alone.places, alone.lease)
                moved = lease.hand_over(Hold.MERGE_SLOT)
                if moved is not None:
                    alone.lease.hold(Hold.MERGE_SLOT, moved)
                self.deliver(live[0], backend)

    async def _send(self, live: list[Waiter], backend: Backend, lease: RequestLease) -> None:
        first = live[0].ctx
        endpoint = first.endpoint
        embeddings = endpoint == merging.EMBEDDINGS
        answers: list[bytes] | None = None
        shared: list[tuple[bytes, bytes]] = []  # the backend's answer headers, for each
        version = ""  # the answering backend's version label, for each
        outcome = "unmerged"
        # every member gone (their clients hung up): stop the upstream request too
        me = asyncio.current_task()
        waiting = [len(live)]

        def gone(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                waiting[0] -= 1
                if waiting[0] == 0 and me is not None:
                    me.cancel()

        try:
            # Whatever fails from here on (building the merged body too), every member is
            # answered: its share, or sent again alone; the lease gives the rest back.
            parts = [w.ctx.merge_part for w in live if w.ctx.merge_part is not None]
            if len(parts) != len(live):
                raise RuntimeError("a merge group member without its part")
            headers = dict(first.upstream.headers)
            headers["accept-encoding"] = "identity"  # the answer is parsed to be split
            mctx = RequestContext(
                endpoint=endpoint,
                model=first.model,
                stream=False,
                upstream=UpstreamRequest(
                    "POST",
                    first.upstream.path,
                    headers,
                    merging.merged_body(endpoint, parts),
                    False,
                ),
                request_id=first.request_id,
                cut=CutHandle(),
                lease=lease,
                priority=first.priority,
                places=1 if embeddings else sum(w.ctx.places for w in live),
                pooled_extra=sum(w.ctx.pooled_extra + 1 for w in live) - 1 if embeddings else 0,
            )
            for w in live:
                w.fut.add_done_callback(gone)
            opened = await self.pipeline.open(mctx, bound=backend)
            answer = self.pipeline.finish_body(mctx, opened)
            if answer.status == 200:
                answers = merging.split_answer(endpoint, answer.body, parts)
                outcome = "ok"
                shared, version = answer.headers, answer.version
        except BackendAnswer as e:
            # each member goes alone; if no backend takes it, it gets this answer as sent
            for w in live:
                w.ctx.answered = e
        except Refusal:
            pass  # no good answer: each member goes alone
        except merging.SplitError as e:
            log.warning("merged %s answer could not be split (%s); retrying unmerged", endpoint, e)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception:
            log.exception("merged %s request failed; retrying unmerged", endpoint)
        finally:
            self.metrics.merged_requests.labels(endpoint, outcome).inc(len(live))
            for i, w in enumerate(live):
                if not w.fut.done():
                    if answers is not None:  # its share's usage, not admission's estimate
                        w.ctx.settle(extract_usage(answers[i]))
                    w.fut.set_result(
                        UNMERGED if answers is None
                        else Answer(200, answers[i], list(shared), version)
                    )
