"""Turns at prefill (conductor/gateway/turns.py) through the gateway, on the real broker and Valkey:
two engines declared one capacity group that takes turns never prefill at the same time (a call
to one starts after the other's calls sent their first token); without turns they do.

Uses the in-process stack of ``test_gateway_upstream`` (fake engines whose every call the test scripts)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from test_gateway_backpressure import burst
from test_gateway_upstream import default_answer, stack

from conductor.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PREFILL_S = 0.3


def overlapping(spans: list[tuple[str, float, float]]) -> list[tuple[str, str]]:
    """Pairs of prefills on different engines that ran at the same time (start, first token)."""
    return [(a[0], b[0]) for i, a in enumerate(spans) for b in spans[i + 1:]
            if a[0] != b[0] and a[1] < b[2] - 0.01 and b[1] < a[2] - 0.01]


@pytest.mark.parametrize("turns", [True, False], ids=["turns", "no-turns"])
async def test_a_group_that_takes_turns_never_prefills_on_two_engines_at_once(
        settings: Settings, tmp_path: Path, turns: bool) -> None:
    spans: list[tuple[str, float, float]] = []

    def engine(node: str) -> Any:
        async def answer(kind: str, body: dict[str, Any], request: Request) -> Response:
            if kind != "decode" or not body.get("stream"):
                return default_answer(kind, body)
            start = time.monotonic()

            async def events() -> AsyncIterator[bytes]:
                await asyncio.sleep(PREFILL_S)  # the prefill: nothing before the first token
                spans.append((node, start, time.monotonic()))
                for w in ("a", "b", "c"):
                    yield b'data: {"choices": [{"index": 0, "text": " ' + w.encode() + b'"}]}\n\n'
                    await asyncio.sleep(0.05)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return answer

    topo = tmp_path / "topology.json"
    topo.write_text(json.dumps({"links": {"same_rack": {"bandwidth_gbps": 100}, "cross_rack": {"bandwidth_gbps": 10}},
                                "capacity_groups": {"dev0": ["e0", "e1"]},
                                "prefill_turns": ["dev0"] if turns else []}))
    # Past an engine's bound of 2 the next request goes to its mate: both engines get work.
    async with stack(settings, {"e0": "both", "e1": "both"}, gateway_max_in_flight=0,
                     gateway_engine_max_in_flight=2, topology_file=topo) as s:
        s.engines.on.update(e0=engine("e0"), e1=engine("e1"))
        got = await burst(s, 4)
        assert [g[0] for g in got] == [200] * 4, got
        assert s.engines.count("decode", "e0") == 2 and s.engines.count("decode", "e1") == 2
        assert len(spans) == 4
        if turns:
            assert s.gw.turns is not None and s.gw.turns.waited >= 1 and s.gw.turns.timed_out == 0
            assert overlapping(spans) == [], spans
        else:
            assert s.gw.turns is None
            assert overlapping(spans), spans  # both engines prefilled at once
        assert s.gw.engine_slots.open == {}
