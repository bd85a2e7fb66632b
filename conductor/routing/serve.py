"""``conductor router`` as calls: :func:`build_router` (the configured policy over the Redis view),
then :func:`serve` until stopped."""

from __future__ import annotations

import asyncio

from conductor.routing.router import Router
from conductor.routing.stores import decision_index, decision_time_stores, default_router_id, redis_stores
from conductor.routing.worker import RouterWorker
from conductor.settings import Settings


def build_router(settings: Settings, router_id: str | None = None) -> RouterWorker:
    """A routing worker reading the Redis view and sharing reservations, pending blocks and the
    in-flight ledger through Redis, with the
    configured policy; a bad policy name or parameters raise :class:`ConfigError` here, before
    anything is contacted. ``router_id`` names it on ``dispatch`` (default: router-HOST-PID-INCARNATION). It keeps
    the decision index (``decision_index_ttl_s``) on the reservations' connection."""
    rid = router_id or default_router_id()
    view, reservations = redis_stores(settings, producer_id=rid)
    pending, inflight = decision_time_stores(settings, reservations.client, rid,
                                             follow_client=reservations.follow_client)
    return RouterWorker(settings, Router(settings, view, reservations, pending=pending, inflight=inflight),
                        router_id=rid, decisions=decision_index(settings, reservations.client))


async def serve(worker: RouterWorker, stop: asyncio.Event) -> None:
    """Route until ``stop``; then close the view the worker read."""
    try:
        await worker.run(stop)
    finally:
        close = getattr(worker.router.view, "close", None)  # the Redis view's; a reader may hold nothing
        if close is not None:
            await close()
