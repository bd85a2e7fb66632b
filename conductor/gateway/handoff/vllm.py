"""vLLM's P/D hand-off (its KV connector's ``kv_transfer_params``): the prefill half, then the decode."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from conductor.gateway.handoff import Call, Opened
from conductor.gateway.outcome import Trace
from conductor.gateway.upstream import MAX_ANSWER_BYTES, EngineFailed, Upstream

log = logging.getLogger(__name__)
_freeing: set[asyncio.Task[None]] = set()
"""Pulls that free an orphaned prefill's KV, running past their request (kept from the collector)."""

ABORT_TIMEOUT_S = 480.0
"""vLLM's default ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``: a prefill's KV that no decode pulled is freed
by the engine itself after this long, so an orphan older than this needs no pull."""
MAX_ORPHANS = 1024
"""Orphans kept for a later pull at most (the oldest go first: the engine's timeout frees them)."""

Held = tuple[str, dict[str, Any], dict[str, Any]]
"""A prefill's held KV: its instance, its ``kv_transfer_params``, its answer."""


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


@dataclass(frozen=True)
class Orphan:
    """A prefill's KV that no decode took: the one-token decode that pulls (and so frees) it."""

    request_id: str
    """The attempt whose prefill holds it (the pull's id: ``<it>-free``)."""
    holder: str
    """The prefill instance holding the blocks."""
    path: str
    body: dict[str, Any]
    deadline: float
    """Monotonic time after which vLLM's abort timeout has freed the blocks anyway."""

    @classmethod
    def of(cls, call: Call, held: Held, now: float) -> Orphan:
        """The pull of ``held``, a prefill of ``call`` (its body asking for one token)."""
        return cls(call.request_id, held[0], call.path, vllm_decode_body(_one_token(call.body, call.chat), held[1]),
                   now + ABORT_TIMEOUT_S)


class Orphans:
    """Held KV waiting for a decode instance that answers (a decode-side outage outlasted the
    request's retries, or a freeing pull failed): the next decode call that opens pulls them, so
    prefill KV does not stay pinned through an outage for vLLM's abort timeout (minutes, per
    request). Bounded (:data:`MAX_ORPHANS`, the oldest dropped); past ``deadline`` one is dropped
    unpulled (the engine has freed it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, limit: int = MAX_ORPHANS) -> None:
        self.clock = clock
        self._q: deque[Orphan] = deque(maxlen=limit)

    def __len__(self) -> int:
        return len(self._q)

    def add(self, call: Call, held: Held) -> None:
        self.requeue(Orphan.of(call, held, self.clock()))

    def take(self) -> list[Orphan]:
        """The orphans still worth a pull, removed (a failed pull adds its orphan back)."""
        now = self.clock()
        out = [o for o in self._q if o.deadline > now]
        self._q.clear()
        return out

    def requeue(self, o: Orphan) -> None:
        if o.deadline > self.clock():
            self._q.append(o)


class VllmHandOff:
    """vLLM's P/D hand-off with this gateway's :class:`Orphans`: the KV of prefills whose decode
    never took their request, freed by the next decode call that opens."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.orphans = Orphans(clock)

    async def __call__(self, up: Upstream, call: Call, tr: Trace) -> Opened:
        opened = await hand_off(up, call, tr, self.orphans)
        for o in self.orphans.take() if self.orphans else ():
            _pull(up, call, o, self.orphans)
        return opened

    def orphaned(self, tr: Trace) -> bool:
        """Keep ``tr``'s held KV (its request ended with no decode left to take it) for the next
        decode that opens; True when there was some."""
        if tr.held_kv is None or tr.held_call is None:
            return False
        self.orphans.add(tr.held_call, tr.held_kv)
        tr.held_kv = tr.held_call = None
        return True


async def hand_off(up: Upstream, call: Call, tr: Trace, orphans: Orphans | None = None) -> Opened:
    """The prefill half, then the decode with its ``kv_transfer_params``. A prefill done for an
    earlier attempt on the same instance, whose decode failed before taking the request
    (``tr.held_kv``), is not run again: its blocks are pinned there until a decode pulls them (or
    vLLM's abort timeout), so the new decode pulls those and the prefill's KV is freed now. When
    the client leaves after the prefill answered and before the decode did, a one-token decode
    pulls the KV in the background (the decode call, cancelled, may not have)."""
    d = call.decision
    held, tr.held_kv, tr.held_call = tr.held_kv, None, None
    if held is not None and held[0] == d.prefill_instance:
        params, pj = held[1], held[2]
    else:
        if held is not None:  # routed to another prefill: the held blocks would stay pinned
            free_held(up, call, held, orphans)
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
            tr.held_kv, tr.held_call = (d.prefill_instance, params, pj), call
        raise
    except asyncio.CancelledError:
        # The client left while the decode was on its way: whether it pulled the KV is unknown, and a
        # pull of blocks already freed only costs a one-token decode.
        free_held(up, call, (d.prefill_instance, params, pj), orphans)
        raise
    return resp, pj


def free_held(up: Upstream, call: Call, held: Held, orphans: Orphans | None = None) -> None:
    """Free the KV a prefill holds for a decode that never took it (``held``) with a one-token
    decode on this call's decode instance that pulls those blocks, which frees them on the holder
    now instead of at vLLM's abort timeout (minutes of a prefill's KV, per request, through a
    decode-side outage). In the background; on failure the pull waits in ``orphans`` for the next
    decode that opens (without: only logged; the timeout still frees them)."""
    _pull(up, call, Orphan.of(call, held, orphans.clock() if orphans is not None else up.clock()), orphans)


def _pull(up: Upstream, call: Call, o: Orphan, orphans: Orphans | None) -> None:
    """``o``'s pull on ``call``'s decode instance, in the background, with a time budget of its own
    (not what is left of a request's); on failure ``o`` goes back to ``orphans``."""
    node = call.decision.decode_instance
    hdrs = {**call.headers(node), "x-request-id": f"{o.request_id}-free"}
    tr = Trace(request_id=hdrs["x-request-id"], t0=up.clock(), stream=False)

    async def pull() -> None:
        try:
            r = await up.send(call.decode_url + o.path, o.body, hdrs, node, tr, what="decode that frees the KV",
                              first_byte=False)
            await up.read(r, tr, node, "the freeing decode's answer", MAX_ANSWER_BYTES)
            why = None if r.status_code < 400 else f"{node} answered {r.status_code}"
        except Exception as e:  # noqa: BLE001 - a background pull's failure is logged; vLLM's timeout frees them
            why = str(e) or type(e).__name__
        if why is None:
            log.info("request %s: freed the KV its prefill on %s held (pulled by %s)", o.request_id, o.holder, node)
        elif orphans is not None:
            log.warning("request %s: could not free the KV its prefill on %s holds (%s); the next decode that "
                        "answers will try again", o.request_id, o.holder, why)
            orphans.requeue(o)
        else:
            log.warning("request %s: could not free the KV its prefill on %s holds (vLLM's abort timeout will): %s",
                        o.request_id, o.holder, why)

    task = asyncio.ensure_future(pull())
    _freeing.add(task)
    task.add_done_callback(_freeing.discard)
