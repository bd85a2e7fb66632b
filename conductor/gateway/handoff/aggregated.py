"""The aggregated hand-off: one engine prefills and decodes, one call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conductor.gateway.handoff import Call, Opened
from conductor.gateway.outcome import Trace
from conductor.gateway.upstream import Upstream


def aggregated_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The whole request in one call to one engine (an aggregated decision): the client's body,
    with usage on a stream so the gateway learns the token counts (dropped again if the client
    did not ask)."""
    out = dict(body)
    if out.get("stream"):
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    return out


async def hand_off(up: Upstream, call: Call, tr: Trace) -> Opened:
    d = call.decision
    resp = await up.open_decode(call.decode_url + call.path, aggregated_body(call.body),
                                call.headers(d.decode_instance), d, tr)
    return resp, {}
