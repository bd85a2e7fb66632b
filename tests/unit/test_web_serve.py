"""conductor.web.serve: an idle server's main loop wakes once a second, and a stop ends it at once."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.applications import Starlette

from conductor import web


def test_an_idle_server_ticks_once_a_second_and_stops_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks: list[float] = []
    on_tick = web._Server.on_tick

    async def counted(self: web._Server, counter: int) -> bool:
        ticks.append(time.monotonic())
        return await on_tick(self, counter)

    monkeypatch.setattr(web._Server, "on_tick", counted)

    async def main() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(web.serve(Starlette(), web.bind("127.0.0.1", 0), stop))
        await asyncio.sleep(1.5)
        stopped = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 5)
        return time.monotonic() - stopped

    took = asyncio.run(main())
    # uvicorn's own loop ticks every 0.1 s: ~15 ticks in 1.5 s; ours: the first, one a second
    # later, and the one the stop wakes.
    assert 2 <= len(ticks) <= 3
    assert took < 0.5


def test_should_exit_reads_back_what_was_set() -> None:
    import uvicorn

    server = web._Server(uvicorn.Config(Starlette()))
    assert server.should_exit is False
    server.should_exit = True
    assert server.should_exit is True
    server.should_exit = False
    assert server.should_exit is False
