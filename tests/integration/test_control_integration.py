"""Runtime control on the real broker and Redis: a cordon and a policy change through the
``control`` topic reach a running router, and `explain` re-derives decisions made on both sides."""

from __future__ import annotations

import asyncio
import time

import pytest

from conductor.errors import ConfigError
from conductor.routing.control_log import current_control, publish_control
from conductor.routing.explain import explain
from conductor.routing.router import Router
from conductor.routing.stores import redis_stores
from conductor.routing.worker import RouterWorker
from schemas import (
    BlocksStored,
    ControlCommand,
    Heartbeat,
    RoutingDecision,
    RoutingRequest,
    chain_keys,
    decode,
    envelope,
)
from state.redis_view import RedisViewStore
from streams import kafka
from streams.replay import replay_into
from streams.topics import topics
from tests.integration.test_audit import SHARED, _publish, _route

pytestmark = pytest.mark.integration


async def test_cordon_and_policy_change_apply_in_log_order_and_explain_both_sides(settings):
    # Each node beats once, at the start: a TTL longer than the test keeps them live however long
    # the set-up takes on a busy machine (as test_audit does; 5 s ran out under load).
    settings = settings.model_copy(update={"heartbeat_ttl_s": 3600.0})
    now = int(time.time() * 1000)
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    keys = chain_keys(SHARED, settings.block_size)
    prod = kafka.producer(settings.kafka())
    await prod.start()
    await _publish(prod, t.heartbeats.name, [
        envelope(Heartbeat(role=r, rack="r0", total_kv_blocks=10_000, free_kv_blocks=10_000), producer_id=n,
                 producer_seq=0, ts_ms=now)
        for n, r in (("p-holder", "prefill"), ("p-idle", "prefill"), ("d-0", "decode"))
    ])
    await _publish(prod, t.kv_events.name, [
        envelope(BlocksStored(block_keys=keys), producer_id="p-holder", producer_seq=0, ts_ms=now)])
    await prod.stop()
    view = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    await replay_into(settings.kafka(), settings.topic_config(), view, idle_timeout_s=1.0)

    reader, resv = redis_stores(settings, producer_id="control-test")
    router = Router(settings, reader, resv)
    worker = RouterWorker(settings, router, router_id="control-test")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    cons = kafka.consumer(settings.kafka(), t.dispatch.name, group_id=None)
    await cons.start()
    got: dict[str, RoutingDecision] = {}

    async def collect(n: int) -> None:
        deadline = time.monotonic() + 30
        while len(got) < n:
            assert time.monotonic() < deadline, f"only {sorted(got)} were routed"
            for recs in (await cons.getmany(timeout_ms=300)).values():
                for rec in recs:
                    body = decode(rec.value).body
                    got[body.request_id] = body

    def req(i: int) -> RoutingRequest:
        return RoutingRequest(request_id=f"c{i}", token_ids=SHARED + list(range(100 * i, 100 * i + 64)),
                              prompt_tokens=len(SHARED) + 64)

    try:
        await _route(settings, [req(0), req(1)], now)
        await collect(2)
        with pytest.raises(ConfigError, match="temprature"):  # refused before it reaches the log
            await publish_control(settings, ControlCommand(action="set_params", params={"temprature": 1}))
        first = got["c0"].prefill_instance
        other = ({"p-holder", "p-idle"} - {first}).pop()
        assert await publish_control(settings, ControlCommand(action="cordon", node_id=first)) == 0
        assert await publish_control(settings, ControlCommand(action="set_policy", policy="least-loaded")) == 1
        deadline = time.monotonic() + 20
        while router.control.offset < 1:
            assert time.monotonic() < deadline, "the router never applied the control records"
            await asyncio.sleep(0.1)
        await _route(settings, [req(2), req(3)], now)
        await collect(4)
    finally:
        stop.set()
        await cons.stop()
        await asyncio.wait_for(task, 10)
        await reader.close()

    assert {got[r].control_offset for r in ("c0", "c1")} == {-1}
    assert {got[r].prefill_instance for r in ("c2", "c3")} == {other}
    assert {(got[r].control_offset, got[r].policy) for r in ("c2", "c3")} == {(1, "least-loaded")}
    for rid in ("c0", "c3"):
        ex = await explain(settings, rid)
        assert ex.matches, ex.differences
        assert ex.control_offset == got[rid].control_offset
    assert (await explain(settings, "c3")).control["cordoned"] == [first]
    st = await current_control(settings)
    assert (st.offset, st.policy, sorted(st.cordoned)) == (1, "least-loaded", [first])
    await view.clear()
    await view.close()
