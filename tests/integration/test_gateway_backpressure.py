"""Backpressure instead of errors (conductor/gateway/admission.py), on the real broker and Valkey:
more clients than the gateway's bound (or an engine's) get 429 with ``Retry-After``, the others
are served whole, and nothing is answered 5xx.

Uses the in-process stack of ``test_gateway_upstream`` (fake engines whose every call the test scripts)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from test_gateway_upstream import Stack, completion, default_answer, stack

from conductor.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


async def slow_stream(kind: str, body: dict[str, Any], request: Request) -> Response:
    """A decode whose 3 tokens take ~1.2 s: its stream holds its slots that long."""
    if kind != "decode" or not body.get("stream"):
        return default_answer(kind, body)

    async def events() -> AsyncIterator[bytes]:
        for w in ("a", "b", "c"):
            await asyncio.sleep(0.4)
            yield b'data: {"choices": [{"index": 0, "text": " ' + w.encode() + b'"}]}\n\n'
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def one_stream(c: httpx.AsyncClient) -> tuple[int, str | None, str, bytes]:
    """(status, Retry-After, the error code or "", the body) of one streamed completion."""
    async with c.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
        body = await r.aread()
    code = r.json()["error"]["code"] if r.status_code != 200 else ""
    return r.status_code, r.headers.get("retry-after"), code, body


async def burst(s: Stack, clients: int) -> list[tuple[int, str | None, str, bytes]]:
    async with s.client() as c:
        return list(await asyncio.gather(*(one_stream(c) for _ in range(clients))))


def check_served_or_throttled(got: list[tuple[int, str | None, str, bytes]], code: str, bound: int) -> None:
    statuses = [g[0] for g in got]
    assert set(statuses) <= {200, 429}, statuses  # no 5xx, no other error
    assert statuses.count(200) >= bound and statuses.count(429) >= 1, statuses
    for status, retry_after, err, body in got:
        if status == 429:
            assert retry_after == "1" and err == code, (retry_after, err)
        else:  # served whole: every token, then the end of the stream
            assert body.count(b'"text": " ') == 3 and body.endswith(b"data: [DONE]\n\n"), body


async def test_more_clients_than_the_gateway_bound_get_429_with_retry_after_and_none_fails(
        settings: Settings) -> None:
    async with stack(settings, {"p0": "prefill", "d0": "decode", "d1": "decode"}, gateway_max_in_flight=3,
                     gateway_engine_max_in_flight=0) as s:
        s.engines.on.update(d0=slow_stream, d1=slow_stream)
        got = await burst(s, 12)
        check_served_or_throttled(got, "gateway_busy", 3)
        assert [o.status for o in s.gw.outcomes].count(200) == [g[0] for g in got].count(200)
        # Refused before routing: no routing request, no engine call, for any 429.
        assert s.engines.count("decode") == [g[0] for g in got].count(200)
        # Every slot came back: the next request is served.
        status, _, _, _ = (await burst(s, 1))[0]
        assert status == 200


async def test_a_decision_naming_an_engine_at_its_bound_is_429_engine_busy_and_its_slots_come_back(
        settings: Settings) -> None:
    async with stack(settings, {"p0": "prefill", "d0": "decode"}, gateway_max_in_flight=0,
                     gateway_engine_max_in_flight=2) as s:
        s.engines.on["d0"] = slow_stream
        got = await burst(s, 8)
        check_served_or_throttled(got, "engine_busy", 2)
        assert s.engines.count("decode") == [g[0] for g in got].count(200)  # no engine called for a 429
        assert s.gw.engine_slots.open == {}
        busy = [o for o in s.gw.outcomes if o.status == 429]
        assert busy and all(o.error == "engine_busy" for o in busy)


async def test_more_requests_deciding_at_once_than_the_bound_get_429_not_a_decision_timeout(settings: Settings) -> None:
    # A decision waits on the view and on the broker's acknowledgements: 12 arriving together
    # overlap there, and past a bound of 1 they are turned away at once.
    async with stack(settings, {"p0": "prefill", "d0": "decode"}, gateway_max_in_flight=0,
                     gateway_engine_max_in_flight=0, gateway_max_deciding=1) as s:
        s.engines.on["d0"] = slow_stream
        got = await burst(s, 12)
        check_served_or_throttled(got, "gateway_busy", 1)
        assert s.gw.deciding.deciding == 0


async def test_a_request_turned_away_by_a_busy_engine_is_routed_once_more_without_it(
        settings: Settings, tmp_path: Path) -> None:
    # Two aggregated engines on one device: the group's work gathers on e0 (the prefix holder),
    # and past e0's bound of 2 the next requests go to its mate instead of being answered 429.
    topo = tmp_path / "topology.json"
    topo.write_text(json.dumps({"links": {"same_rack": {"bandwidth_gbps": 100}, "cross_rack": {"bandwidth_gbps": 10}},
                                "capacity_groups": {"dev0": ["e0", "e1"]}}))
    async with stack(settings, {"e0": "both", "e1": "both"}, gateway_max_in_flight=0,
                     gateway_engine_max_in_flight=2, topology_file=topo) as s:
        s.engines.on.update(e0=slow_stream, e1=slow_stream)
        got = await burst(s, 4)
        assert [g[0] for g in got] == [200] * 4, got
        assert s.engines.count("decode", "e0") == 2 and s.engines.count("decode", "e1") == 2
        assert s.gw.engine_slots.open == {}
        # Past both bounds, nothing else can take it: the client's answer is still the 429.
        got = await burst(s, 6)
        check_served_or_throttled(got, "engine_busy", 4)
        assert s.gw.engine_slots.open == {}
