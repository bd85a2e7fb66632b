"""A follower's blocking read never blocks as long as its client waits for an answer."""

from __future__ import annotations

import pytest

from state.connect import block_ms_within, open_client, read_timeout_s
from state.reservations import FOLLOW_BLOCK_MS, RedisReservations
from state.shared_log import SharedLog


@pytest.mark.parametrize(("want_ms", "timeout_s", "expected"), [
    (1000, 0.5, 400),  # the router's client: a 1 s block was given up (and reconnected) twice a second
    (1000, 1.0, 800),  # the gateway's: a block as long as the timeout lost the race too
    (1000, 5.0, 1000),
    (1000, None, 1000),  # no timeout: any block
    (100, 0.5, 100),
    (1000, 0.001, 1),
])
def test_block_is_cut_below_the_read_timeout(want_ms: int, timeout_s: float | None, expected: int) -> None:
    assert block_ms_within(want_ms, timeout_s) == expected


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1", "redis+cluster://127.0.0.1:1"])
def test_followers_block_within_their_clients_timeout(url: str) -> None:
    client = open_client(url, socket_timeout=0.5)
    assert read_timeout_s(client) == 0.5
    assert RedisReservations(client, "ns", 5.0, producer_id="r").block_ms == 400
    assert SharedLog(client, "k", producer_id="r", retain_ms=1000, apply=lambda _: None).block_ms == 400
    assert RedisReservations(open_client(url), "ns", 5.0, producer_id="r").block_ms == FOLLOW_BLOCK_MS


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1", "redis+cluster://127.0.0.1:1"])
def test_a_follower_client_of_its_own_blocks_a_full_second(url: str) -> None:
    """The router's short-timeout client writes; its followers read on one that allows a 1 s block."""
    client, follower = open_client(url, socket_timeout=0.5), open_client(url, socket_timeout=2.0)
    resv = RedisReservations(client, "ns", 5.0, producer_id="r", follow_client=follower)
    log = SharedLog(client, "k", producer_id="r", retain_ms=1000, apply=lambda _: None, follow_client=follower)
    assert (resv.block_ms, log.block_ms) == (FOLLOW_BLOCK_MS, FOLLOW_BLOCK_MS)
    assert resv.client is client and resv.follow_client is follower and log.follow_client is follower


def test_the_routers_stores_follow_on_a_client_of_their_own() -> None:
    from conductor.routing.stores import FOLLOW_READ_TIMEOUT_S, decision_time_stores, redis_stores
    from conductor.settings import load_settings

    settings = load_settings(redis_url="redis://127.0.0.1:1/0")
    _, resv = redis_stores(settings, producer_id="r")
    pending, inflight = decision_time_stores(settings, resv.client, "r", follow_client=resv.follow_client)
    assert read_timeout_s(resv.client) == 0.5  # decisions still fail fast on a dead Redis
    assert read_timeout_s(resv.follow_client) == FOLLOW_READ_TIMEOUT_S
    assert [s.block_ms for s in (resv, pending.log, inflight.log)] == [FOLLOW_BLOCK_MS] * 3
    assert pending.log.follow_client is resv.follow_client is inflight.log.follow_client
    assert pending.log.group is not None and pending.log.group is inflight.log.group  # one read for both
