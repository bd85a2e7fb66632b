"""One live process per producer id (state.claim) on the session's Valkey: a second process under
a live one's id is refused at start, naming the option; a killed holder's claim is taken over in
about a second and a half, not its life; one given back is taken at once; the holder that lost its
id says so."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from conductor.settings import Settings
from state.claim import ProducerClaim, ProducerIdInUse

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

RENEW_MS, TTL_MS = 200, 1_000


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.from_url(str(settings.redis_url))
    try:
        yield c
    finally:
        await c.aclose()


def claim(client: aioredis.Redis, settings: Settings, producer: str = "gw-fixed") -> ProducerClaim:
    return ProducerClaim(client, settings.view_namespace, producer, renew_ms=RENEW_MS, ttl_ms=TTL_MS)


async def test_a_second_process_under_a_live_ones_id_is_refused_naming_the_option(
        client: aioredis.Redis, settings: Settings) -> None:
    first, second = claim(client, settings), claim(client, settings)
    await first.take()
    first.start()
    try:
        with pytest.raises(ProducerIdInUse, match="--gateway-id") as e:
            await second.take()
        assert first.token in str(e.value) and "gw-fixed" in str(e.value)
        assert not second.held
        await asyncio.sleep(3 * RENEW_MS / 1000)
        assert first.held and first.problem is None  # the refused one wrote nothing
        other = claim(client, settings, "gw-other")  # another id is free
        await other.take()
        assert other.held
        await other.close()
    finally:
        await first.close()


async def test_a_killed_holders_claim_is_taken_over_well_before_it_lapses(
        client: aioredis.Redis, settings: Settings) -> None:
    first = ProducerClaim(client, settings.view_namespace, "gw-fixed", renew_ms=RENEW_MS, ttl_ms=60_000)
    await first.take()
    first.start()
    await asyncio.sleep(2 * RENEW_MS / 1000)
    first.abandon()  # kill -9: no renewal, no give-back
    again = claim(client, settings)
    t0 = time.monotonic()
    await again.take()
    assert again.held and time.monotonic() - t0 < 2 * 1.5 * RENEW_MS / 1000 + 1  # not the claim's 60 s
    assert await client.get(again.key) == again.token.encode()
    # The earlier holder, were it alive after all (stalled, cut off), learns it lost the id.
    assert not await first.renew()
    assert first.problem is not None and again.token in first.problem
    await first.close()  # gives back nothing that is not its own
    assert await client.get(again.key) == again.token.encode()
    await again.close()


async def test_a_claim_given_back_is_taken_at_once_and_one_that_lapsed_is_taken_again(
        client: aioredis.Redis, settings: Settings) -> None:
    first = claim(client, settings)
    await first.take()
    await first.close()
    assert await client.get(first.key) is None
    again = claim(client, settings)
    t0 = time.monotonic()
    await again.take()
    assert again.held and time.monotonic() - t0 < RENEW_MS / 1000
    await client.delete(again.key)  # lapsed (Redis out of reach longer than its life) or the view cleared
    assert await again.renew() and again.problem is None
    assert await client.get(again.key) == again.token.encode()
    assert 0 < await client.pttl(again.key) <= TTL_MS
    await again.close()


async def test_a_claim_needs_its_renewal_within_its_life(client: aioredis.Redis, settings: Settings) -> None:
    with pytest.raises(ValueError, match="within its life"):
        ProducerClaim(client, settings.view_namespace, "gw", renew_ms=1_000, ttl_ms=1_000)


async def test_a_claim_on_a_redis_cluster_is_refused_taken_over_and_given_back_the_same(
        cluster_settings: Settings) -> None:
    from state.connect import open_client

    c = open_client(str(cluster_settings.redis_url), decode_responses=False)
    try:
        first, twin = claim(c, cluster_settings), claim(c, cluster_settings)  # type: ignore[arg-type]
        await first.take()
        first.start()
        with pytest.raises(ProducerIdInUse):
            await twin.take()
        first.abandon()
        again = claim(c, cluster_settings)  # type: ignore[arg-type]
        await again.take()
        assert again.held and await c.get(again.key) == again.token.encode()
        await again.close()
        assert await c.get(again.key) is None
    finally:
        await c.aclose()
