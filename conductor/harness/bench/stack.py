"""The servers a benchmark runs against: the configured ones, else an embedded stack of its own."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from conductor.harness.devstack import EmbeddedStack
from conductor.settings import Settings


@contextlib.contextmanager
def with_redis(settings: Settings) -> Iterator[Settings]:
    """``settings`` when they name a Redis; else the same settings on an embedded stack started for
    the block (stopped after it, and by the kernel if this process dies first)."""
    if settings.redis_url:
        yield settings
        return
    with tempfile.TemporaryDirectory(prefix="conductor-bench-") as tmp:
        stack = EmbeddedStack(Path(tmp), host=settings.bind_host)
        state = stack.up(die_with_parent=True)
        try:
            yield settings.model_copy(update={"redis_url": state.redis_url})
        finally:
            stack.down()


@contextlib.contextmanager
def with_servers(settings: Settings) -> Iterator[Settings]:
    """``settings`` when they name a broker and a Redis; else the same settings on an embedded
    stack (both servers) started for the block and stopped after it."""
    if settings.kafka_url and settings.redis_url:
        yield settings
        return
    with tempfile.TemporaryDirectory(prefix="conductor-bench-") as tmp:
        stack = EmbeddedStack(Path(tmp), host=settings.bind_host)
        state = stack.up(die_with_parent=True)
        try:
            yield settings.model_copy(update={"kafka_url": state.kafka_url, "redis_url": state.redis_url,
                                              "profile": "embedded"})
        finally:
            stack.down()
