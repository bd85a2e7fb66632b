"""The hand-offs: how one decided request becomes calls to its engines, one module each.

- :mod:`.aggregated`: one engine prefills and decodes (an aggregated decision), one call;
- :mod:`.vllm`: vLLM P/D, the prefill half first, its ``kv_transfer_params`` to the decode;
- :mod:`.sglang`: SGLang P/D, both halves at once, meeting at the prefill's bootstrap room;
- :mod:`.cpp`: a pipelined prefill group (CPP), each member pulling the KV before its chunk
  from the one before, the decode from the last.

Each opens the decode's answer (its headers in, its body left to the relay) and returns it with
the prefill's answer, whose cached tokens are the request's reuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from conductor.frontdoor.directory import decided_url
from conductor.frontdoor.protocol import ClientRequest, Prompt
from conductor.gateway.outcome import Trace
from conductor.gateway.upstream import EngineFailed, Upstream
from schemas import RoutingDecision

Opened = tuple[httpx.Response, dict[str, Any]]
"""The decode's answer, open, and the prefill's answer (``{}`` when there is no prefill half)."""


@dataclass(frozen=True)
class Call:
    """One decided request as its hand-off sees it (built by :func:`call_of`)."""

    body: dict[str, Any]
    """The client's body, forwarded."""
    chat: bool
    decision: RoutingDecision
    request_id: str
    """This attempt's id (the engines' ``x-request-id``)."""
    engines: Mapping[str, str]
    """``--engine`` overrides."""
    prefill_url: str
    decode_url: str

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def url(self, node: str) -> str:
        """``--engine``'s URL for ``node``, else the endpoint its heartbeats announce (in the decision)."""
        return _url(node, self.decision, self.engines)

    def headers(self, node: str) -> dict[str, str]:
        """The request id, and the DP rank the node is (vLLM routes a request carrying it to that rank)."""
        ep = self.decision.endpoints.get(node)
        if ep is not None and ep.dp_rank is not None:
            return {"x-request-id": self.request_id, "X-data-parallel-rank": str(ep.dp_rank)}
        return {"x-request-id": self.request_id}


def engine_body(body: dict[str, Any], creq: ClientRequest, prompt: Prompt) -> dict[str, Any]:
    """``body`` with its text prompt replaced by ``prompt``'s token ids, where the engine would have
    tokenized it to those very ids: one text completion (a chat's template is the engine's to apply)
    for the base model (a LoRA adapter may bring a tokenizer of its own), not echoed (the echo is
    the client's own text) and not truncated (``truncate_prompt_tokens``: left to the engine, on the
    text). Else ``body`` unchanged.

    The ids are the engine's own (its ``/tokenize``, or the model's files checked against it:
    :mod:`conductor.frontdoor.tokenizer`), so the engine runs what it would have run, without
    tokenizing the prompt a second time: on a 1,500-token prompt that was ~5 ms of the engine's
    CPU before its headers came back (live A/B, tiny model; docs/benchmarks.md)."""
    text = body.get("prompt")
    if (creq.chat or not isinstance(text, str) or not prompt.token_ids or body.get("echo") or creq.lora_name
            or "truncate_prompt_tokens" in creq.prompt_fields or prompt.mm_items or prompt.unhashed_media):
        return body
    return {**body, "prompt": prompt.token_ids}


def call_of(body: dict[str, Any], chat: bool, d: RoutingDecision, request_id: str,
            engines: Mapping[str, str]) -> Call:
    """The call for decision ``d``; :class:`EngineFailed` naming an instance with no known URL."""
    prefill_url = _url(d.prefill_instance, d, engines)
    return Call(body, chat, d, request_id, engines, prefill_url, _url(d.decode_instance, d, engines))


def _url(node: str, d: RoutingDecision, engines: Mapping[str, str]) -> str:
    url = decided_url(node, d, engines)
    if url is None:
        raise EngineFailed(node, f"the gateway knows no URL for {node}: its heartbeats announce no "
                           f"endpoint (conductor bridge --engine-url) and no --engine {node}=URL was given")
    return url


class HandOff(Protocol):
    """Opens a decided request's decode answer on ``up`` (see the module)."""

    async def __call__(self, up: Upstream, call: Call, tr: Trace) -> Opened: ...
