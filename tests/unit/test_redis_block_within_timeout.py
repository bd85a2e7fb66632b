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
