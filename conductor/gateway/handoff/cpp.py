"""The CPP chain (a pipelined prefill group, a Conductor extension the emulated engine speaks).

Member j pulls the KV before its chunk from member j-1, computes its chunk and holds the KV up
to its boundary; the decode instance pulls the whole KV from the last member.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conductor.gateway.handoff import Call, Opened
from conductor.gateway.handoff.vllm import vllm_decode_body, vllm_prefill_body
from conductor.gateway.outcome import Trace
from conductor.gateway.upstream import EngineFailed, Upstream


def cpp_chunk_body(body: Mapping[str, Any], chat: bool, chunk_end: int,
                   previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """One member of a CPP prefill group: a prefill half computing the prompt up to ``chunk_end``
    after pulling the KV before its chunk from the previous member (``previous``: that member's
    ``kv_transfer_params``)."""
    out = vllm_prefill_body(body, chat)
    kvp = dict(out["kv_transfer_params"])
    if previous:
        kvp.update({k: v for k, v in previous.items() if k != "do_remote_decode"})
        kvp["do_remote_prefill"] = True
    kvp.update(do_remote_decode=True, chunk_end=chunk_end)
    out["kv_transfer_params"] = kvp
    return out


async def hand_off(up: Upstream, call: Call, tr: Trace) -> Opened:
    d = call.decision
    pj: dict[str, Any] = {}
    params: dict[str, Any] | None = None
    prev: str | None = None
    for node, end in zip(d.prefill_group or (), d.chunk_boundaries or ()):
        pj_j = await up.prefill(call.url(node) + call.path, cpp_chunk_body(call.body, call.chat, end, params),
                                call.headers(node), node, tr, peer=prev)
        pj = pj or pj_j  # the head's answer: its cached tokens are the request's reuse
        got, prev = pj_j.get("kv_transfer_params"), node
        if not isinstance(got, dict):
            raise EngineFailed(node, "the CPP member's answer has no kv_transfer_params")
        params = got
    assert params is not None  # the group has members, so the loop set it
    resp = await up.open_decode(call.decode_url + call.path, vllm_decode_body(call.body, params),
                                call.headers(d.decode_instance), d, tr, kv_from=prev)
    return resp, pj
