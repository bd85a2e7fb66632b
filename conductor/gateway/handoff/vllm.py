"""vLLM's P/D hand-off (its KV connector's ``kv_transfer_params``): the prefill half, then the decode."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conductor.gateway.handoff import Call, Opened
from conductor.gateway.outcome import Trace
from conductor.gateway.upstream import EngineFailed, Upstream


def vllm_prefill_body(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill half of vLLM's disaggregated serving: one token, KV kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    out.update(stream=False, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    })
    if chat and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def vllm_decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode half: the client's body plus the prefill's ``kv_transfer_params``."""
    out = dict(body)
    out["kv_transfer_params"] = dict(kv_transfer_params)
    if out.get("stream"):
        # Usage tells the gateway the token counts; it is dropped again if the client did not ask.
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    return out


async def hand_off(up: Upstream, call: Call, tr: Trace) -> Opened:
    """The prefill half, then the decode with its ``kv_transfer_params``. A prefill done for an
    earlier attempt on the same instance, whose decode failed before taking the request
    (``tr.held_kv``), is not run again: its blocks are pinned there until a decode pulls them (or
    NIXL's abort timeout), so the new decode pulls those and the prefill's KV is freed now."""
    d = call.decision
    held, tr.held_kv = tr.held_kv, None
    if held is not None and held[0] == d.prefill_instance:
        params, pj = held[1], held[2]
    else:
        pj = await up.prefill(call.prefill_url + call.path, vllm_prefill_body(call.body, call.chat),
                              call.headers(d.prefill_instance), d.prefill_instance, tr)
        got = pj.get("kv_transfer_params")
        if not isinstance(got, dict):
            raise EngineFailed(d.prefill_instance, "the prefill answer has no kv_transfer_params "
                               "(is the engine started with a KV connector?)")
        params = got
    try:
        resp = await up.open_decode(call.decode_url + call.path, vllm_decode_body(call.body, params),
                                    call.headers(d.decode_instance), d, tr)
    except EngineFailed as e:
        if e.node == d.decode_instance:  # the decode never took it: the prefill's KV waits, pinned, for another
            tr.held_kv = (d.prefill_instance, params, pj)
        raise
    return resp, pj
