"""Batches of a Faust agent's events with no timer running while nothing comes.

Faust's ``Stream.take_events(n, within)`` wakes every ``within`` seconds whether or not a
record came: at the worker's 10 ms that was 100 wake-ups a second per agent, each through
Faust's task machinery (most of an idle worker's main thread). :func:`take_batches` gives
the same batches (at most ``max_records`` events; each event acknowledged once the caller
has handled its batch) but sleeps until the first event of a batch arrives, then closes the
batch ``within_s`` later or as soon as it is full. A lone record waits at most ``within_s``
as before; an idle agent does not wake at all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import faust
from mode.utils.locks import Event


async def take_batches(stream: faust.StreamT[Any], max_records: int, within_s: float) -> AsyncIterator[list[Any]]:
    """Yield lists of ``stream``'s events (``faust.types.EventT``), in order (see the module docstring).

    While the caller handles a batch no event is added to the next one; the events of a batch
    are acknowledged after the caller asks for the next batch (or stops)."""
    if max_records < 1 or within_s <= 0:
        raise ValueError("take_batches needs max_records >= 1 and within_s > 0")
    assert isinstance(stream, faust.Stream)  # (what Faust hands an agent; the passive drain is its own)
    events: list[Any] = []
    started = Event()  # the batch's first event came (mode's Event: what Service.wait takes)
    full = Event()
    open_ = Event()  # events may join the batch (cleared while the caller handles one)
    open_.set()

    async def collect(value: Any) -> Any:
        while not open_.is_set():
            await open_.wait()
        event = stream.current_event
        if event is None:
            raise RuntimeError("take_batches: an event without current_event")
        events.append(event)
        started.set()
        if len(events) >= max_records:
            full.set()
            open_.clear()
            await open_.wait()  # never more than max_records in one batch
        return value

    acks = stream.enable_acks
    stream.enable_acks = False  # acknowledged here, once handled
    stream.add_processor(collect)
    channel: Any = aiter(stream.channel)
    stream._enable_passive(channel)  # the stream drains itself through ``collect``
    try:
        while not stream.should_stop:
            await stream.wait_for_stopped(started)  # no timeout: an idle agent sleeps
            if not full.is_set():
                await stream.wait_for_stopped(full, timeout=within_s)  # (says "stopped" on a timeout too)
            if stream.should_stop:
                break
            if not events:
                continue
            open_.clear()
            batch = list(events)
            try:
                yield batch
            finally:
                events.clear()
                started.clear()
                full.clear()
                for event in batch:
                    await stream.ack(event)
                open_.set()
    finally:
        stream.enable_acks = acks
        stream._processors.remove(collect)


__all__ = ["take_batches"]
