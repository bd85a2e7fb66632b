"""A vLLM-compatible KV-event publisher: ZMQ PUB plus a replay ROUTER socket.

What Conductor's emulated engine (and the bridge's tests) use to speak exactly
what a vLLM engine started with ``--kv-events-config '{"enable_kv_cache_events":
true, "publisher": "zmq"}'`` speaks: multipart ``[topic, seq, payload]`` with
seq counting from 0, and a replay socket that streams buffered batches from a
requested seq, ended by seq = -1.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from conductor.bridge.wire import (
    END_SEQ,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    encode_batch,
    seq_frame,
)

log = logging.getLogger(__name__)


class EventPublisher:
    """Publish event batches with sequence numbers and serve replay requests."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        buffer_steps: int = 10_000,
        topic: str = "kv-events",
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.ctx = context or zmq.asyncio.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint = _bind(self.pub, endpoint)
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self.router, replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.topic = topic.encode()
        self.next_seq = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.router is not None and self._task is None:
            self._task = asyncio.create_task(self._serve_replay())

    async def publish(
        self,
        ts: float,
        events: Sequence[EngineBlockStored | EngineBlockRemoved | EngineAllCleared],
        *,
        send: bool = True,
    ) -> int:
        """Publish one batch; return its seq. ``send=False`` buffers it only (a lost message)."""
        return await self.publish_payload(encode_batch(ts, events), send=send)

    async def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        """Publish an already encoded batch (e.g. an engine's own msgspec bytes); return its seq."""
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq_frame(seq), payload])
        return seq

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) not in (2, 3) or len(frames[-1]) != 8:
                log.warning("ignoring a malformed replay request of %d frames", len(frames))
                continue
            ident, start_b = frames[0], frames[-1]
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([ident, b"", seq_frame(seq), payload])
            await self.router.send_multipart([ident, b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind (port 0 = a free one) and return the endpoint actually bound."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = sock.bind_to_random_port(endpoint[: -len(":0")])
        return f"{endpoint[: -len(':0')]}:{port}"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
