"""The fitted cost model through the log, on the real broker and Redis: the fitter's ``set_profile``
reaches a running router, the next decisions predict with it, and ``explain`` re-derives a
decision made under the fitted profile (and one made before it) exactly."""

from __future__ import annotations

import asyncio
import time

import pytest

from conductor.costmodel.fitting import CostFitter, FitConfig
from conductor.costmodel.profiles import load_profile
from conductor.routing.control_log import current_control, publish_control
from conductor.routing.explain import explain
from conductor.routing.router import Router
from conductor.routing.stores import redis_stores
from conductor.routing.worker import RouterWorker
from schemas import (
    BlocksStored,
    Heartbeat,
    RequestOutcome,
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


def served(i: int, prompt: int, reused: int, predicted: float, offset: int) -> RequestOutcome:
    """A served request whose engine-side TTFT is 40 ms + 20 us per token not reused (a small engine)."""
    real = 0.040 + 20e-6 * (prompt - reused)
    return RequestOutcome(request_id=f"o{i}", gateway="gw", status=200, prompt_tokens=prompt, reused_tokens=reused,
                          output_tokens=8, predicted_ttft_s=predicted, predicted_tbt_ms=20.0, ttft_s=real + 0.002,
                          decided_s=0.002, tbt_p50_ms=12.0, control_offset=offset, model="default")


async def test_a_fitted_profile_is_published_applied_and_explained(settings):
    now = int(time.time() * 1000)
    settings = settings.model_copy(update={"heartbeat_ttl_s": 60.0})
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    keys = chain_keys(SHARED, settings.block_size)
    prod = kafka.producer(settings.kafka())
    await prod.start()
    await _publish(prod, t.heartbeats.name, [
        envelope(Heartbeat(role=r, rack="r0", total_kv_blocks=10_000, free_kv_blocks=10_000,
                           queued_prefill_tokens=q, queue_depth=1 if q else 0), producer_id=n, producer_seq=0, ts_ms=now)
        for n, r, q in (("p-holder", "prefill", 2048), ("p-idle", "prefill", 0), ("d-0", "decode", 0))
    ])
    await _publish(prod, t.kv_events.name, [
        envelope(BlocksStored(block_keys=keys), producer_id="p-holder", producer_seq=0, ts_ms=now)])
    await prod.stop()
    view = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    await replay_into(settings.kafka(), settings.topic_config(), view, idle_timeout_s=1.0)

    reader, resv = redis_stores(settings, producer_id="fit-test")
    router = Router(settings, reader, resv)
    worker = RouterWorker(settings, router, router_id="fit-test")
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
        return RoutingRequest(request_id=f"f{i}", token_ids=SHARED + list(range(100 * i, 100 * i + 64)),
                              prompt_tokens=len(SHARED) + 64)

    base = load_profile(settings.model_profile)
    fitter = CostFitter(base, FitConfig(window=64, min_rows=24, refit_every=24))
    try:
        await _route(settings, [req(0)], now)
        await collect(1)
        cmd = None
        for i in range(24):
            n = 200 + 150 * i
            cmd = fitter.on_outcome(served(i, n, (i % 3) * 64, base.prefill_seconds(n), -1)) or cmd
        assert cmd is not None and cmd.action == "set_profile"
        offset = await publish_control(settings, cmd, producer_id="conductor-fit")
        deadline = time.monotonic() + 20
        while router.control.offset < offset:
            assert time.monotonic() < deadline, "the router never applied the set_profile record"
            await asyncio.sleep(0.1)
        await _route(settings, [req(1)], now)
        await collect(2)
    finally:
        stop.set()
        await cons.stop()
        await asyncio.wait_for(task, 10)
        await reader.close()

    fitted = fitter.published
    assert router.profile == fitted and fitted.fit_rows == 24
    # The fit recovered the engine: 40 ms fixed, 20 us a token (the quadratic term is ~0).
    assert fitted.prefill_seconds(1000) == pytest.approx(0.040 + 0.020, rel=0.05)
    assert fitted.ttft_error_p90 is not None and fitted.ttft_error_p90 < 0.05
    before, after = got["f0"], got["f1"]
    assert (before.control_offset, after.control_offset) == (-1, offset)
    # The same request shape, predicted with the engine's measured costs after the fit: its fixed
    # 40 ms and 20 us a token not reused (the hand-set 70B profile predicted ~11 ms).
    assert before.predicted_ttft_s < 0.02
    assert after.predicted_ttft_s == pytest.approx(0.040 + 20e-6 * (req(1).prompt_tokens - after.reused_tokens), rel=0.05)
    for rid in ("f0", "f1"):
        ex = await explain(settings, rid)
        assert ex.matches, ex.differences
        assert ex.control_offset == got[rid].control_offset
    st = await current_control(settings)
    assert st.profile == fitted and st.offset == offset
    await view.clear()
    await view.close()
