"""``conductor worker`` as one call: :func:`run_worker` folds ``kv-events`` and ``heartbeats``
into the Redis view until the process is stopped (Faust owns the loop and the signals)."""

from __future__ import annotations

import asyncio
import socket

import faust

from state.connect import RedisConnection
from state.redis_view import RedisViewStore
from streams.agents import build_worker
from streams.config import WorkerConfig
from streams.kafka import ensure_topics
from streams.topics import topics


def run_worker(config: WorkerConfig, redis: RedisConnection, namespace: str, *,
               web_socket: socket.socket | None = None, loglevel: str = "info") -> None:
    """Create the topics, then run the stream worker over the view ``namespace`` on ``redis``;
    Faust's web server on ``web_socket`` (see :func:`streams.app.bind_web_port`)."""
    asyncio.run(ensure_topics(config.kafka, topics(config.topics).all()))
    store = RedisViewStore.connect(redis, namespace)
    worker = build_worker(config, store, web_socket=web_socket)
    faust.Worker(worker.app, loglevel=loglevel).execute_from_commandline()
