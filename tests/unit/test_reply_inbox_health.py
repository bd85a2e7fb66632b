"""Why a gateway's reply inbox cannot answer (what ``/health`` says), on a clock of the test's own."""

from __future__ import annotations

import asyncio

from conductor.gateway.replies import STALL_S, InboxClosed, ReplyInbox
from conductor.settings import load_settings


async def test_the_inbox_says_why_it_cannot_answer() -> None:
    now = [100.0]
    inbox = ReplyInbox(load_settings(), "gw-1", clock=lambda: now[0])
    assert inbox.problem() == "not reading its reply topic yet"
    inbox._ready.set()
    inbox._polled_at = now[0]
    assert inbox.problem() is None
    now[0] += STALL_S + 1
    assert inbox.problem() == f"the reply inbox has not polled its topic for {STALL_S + 1:.0f}s"
    now[0] -= STALL_S + 1
    inbox._assigned = lambda: False
    assert inbox.problem() == f"the reply consumer holds no assignment of {inbox.topic.name}"


async def test_a_stopped_inbox_fails_what_waits_on_it_and_what_comes_after() -> None:
    inbox = ReplyInbox(load_settings(), "gw-1")
    waiting = inbox.expect("r1")

    async def broken(stop: asyncio.Event) -> None:
        raise ConnectionError("broker gone")

    inbox._read = broken  # type: ignore[method-assign]
    try:
        await inbox.run(asyncio.Event())
    except ConnectionError:
        pass
    assert inbox.problem() == "the reply inbox failed: ConnectionError: broker gone"
    assert isinstance(waiting.exception(), InboxClosed)  # not a cancellation of the request waiting on it
    later = inbox.expect("r2")
    assert later.done() and isinstance(later.exception(), InboxClosed)
