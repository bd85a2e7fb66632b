"""vLLM's P/D hand-off (its KV connector's ``kv_transfer_params``): the prefill half, then the decode."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from conductor.gateway.handoff import Call, Opened
from conductor.gateway.outcome import Trace
from conductor.gateway.upstream import MAX_ANSWER_BYTES, EngineFailed, Upstream

log = logging.getLogger(__name__)
_freeing: set[asyncio.Task[None]] = set()
"""Pulls that free an orphaned prefill's KV, running past their request (kept from the collector)."""


def _one_token(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """``body`` asking for one token, answered whole."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    out.update(stream=False, max_tokens=1)
    if chat and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def vllm_prefill_body(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill half of vLLM's disaggregated serving: one token, KV kept for a remote decode."""
    out = _one_token(body, chat)
    out["kv_transfer_params"] = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }
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
        if held is not None:  # routed to another prefill: the held blocks would stay pinned
            free_held(up, call, held, tr)
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


def free_held(up: Upstream, call: Call, held: tuple[str, dict[str, Any], dict[str, Any]], tr: Trace) -> None:
    """Free the KV an earlier attempt's prefill holds for a decode that never took it (``held``:
    its instance, its ``kv_transfer_params``, its answer) when the retry went to another prefill
    instance: a one-token decode on this call's decode instance pulls those blocks, which frees
    them on the holder now instead of at vLLM's abort timeout (minutes of a prefill's KV, per
    request, through a decode-side outage). In the background; its failure is only logged (the
    timeout still frees them)."""
    node = call.decision.decode_instance
    body = vllm_decode_body(_one_token(call.body, call.chat), held[1])
    hdrs = {**call.headers(node), "x-request-id": f"{call.request_id}-free"}

    async def pull() -> None:
        try:
            r = await up.send(call.decode_url + call.path, body, hdrs, node, tr, what="decode that frees the KV",
                              first_byte=False)
            await up.read(r, tr, node, "the freeing decode's answer", MAX_ANSWER_BYTES)
            why = None if r.status_code < 400 else f"{node} answered {r.status_code}"
        except Exception as e:  # noqa: BLE001 - a background pull's failure is logged; vLLM's timeout frees them
            why = str(e)
        if why is None:
            log.info("request %s: freed the KV its prefill on %s held (pulled by %s)", tr.request_id, held[0], node)
        else:
            log.warning("request %s: could not free the KV its prefill on %s holds (vLLM's abort timeout will): %s",
                        tr.request_id, held[0], why)

    task = asyncio.ensure_future(pull())
    _freeing.add(task)
    task.add_done_callback(_freeing.discard)
