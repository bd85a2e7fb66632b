"""SGLang's P/D hand-off: prefill and decode at once, meeting at the prefill's bootstrap room."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from conductor.gateway.handoff import Call, Opened
from conductor.gateway.outcome import Trace
from conductor.gateway.upstream import Upstream, discard


def sglang_bodies(body: Mapping[str, Any], host: str, port: int, room: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """SGLang's hand-off: the same request to both instances, naming the prefill's bootstrap server and a room."""
    boot = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill.update(boot, stream=False)
    decode = dict(body)
    decode.update(boot)
    if decode.get("stream"):
        decode["stream_options"] = {**(decode.get("stream_options") or {}), "include_usage": True}
    return prefill, decode


class SglangHandOff:
    """The hand-off over SGLang's bootstrap rooms; ``bootstrap_port``: the prefill instances'
    (default: the one their heartbeats announce, else the port of their URL)."""

    def __init__(self, bootstrap_port: int | None, rng: random.Random | None = None) -> None:
        self.bootstrap_port = bootstrap_port
        self.rng = rng or random.Random()

    async def __call__(self, up: Upstream, call: Call, tr: Trace) -> Opened:
        """Whatever fails, nothing is left open: the other call is cancelled, or its response closed."""
        d = call.decision
        u = urlparse(call.prefill_url + call.path)
        ep = d.endpoints.get(d.prefill_instance)
        prefill_body, decode_body = sglang_bodies(call.body, u.hostname or "127.0.0.1",
                                                  self.bootstrap_port or (ep and ep.bootstrap_port) or u.port or 80,
                                                  self.rng.getrandbits(63))
        prefill = asyncio.ensure_future(up.prefill(call.prefill_url + call.path, prefill_body,
                                                   call.headers(d.prefill_instance), d.prefill_instance, tr))
        try:
            resp = await up.open_decode(call.decode_url + call.path, decode_body, call.headers(d.decode_instance), d,
                                        tr, prefill)
            try:
                return resp, await prefill
            except BaseException:
                await resp.aclose()  # the decode opened (a stream's headers are in) but its prefill failed
                raise
        except BaseException:
            await discard(prefill)
            raise
