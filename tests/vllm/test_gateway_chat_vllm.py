"""A chat with tools tokenizes, through the gateway's tokenizer, to the ids real vLLM prefills
(issue 27, item 9; the ``vllm`` marker, tests/vllm/README.md).

The session's aggregated engine, started with a chat template that renders tools, documents, a
template kwarg and the generation prompt (conftest's ``CHAT_TEMPLATE``: the tiny model has none)
and with ``--enable-scale-out`` (its render route is off, answering 403, without it): the gateway's tokenizer asks it by its render
route and by ``/tokenize`` (as for an engine without the render route), and both answers equal
``prompt_token_ids`` of the chat completion itself (``return_token_ids``)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from conductor.frontdoor.protocol import parse_body
from conductor.frontdoor.tokenizer import EngineTokenizer
from conductor.harness.vllm_kit import VllmEngine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MSGS = [{"role": "system", "content": "you answer with a tool call"},
        {"role": "user", "content": "what is the weather in Paris today?"},
        {"role": "assistant", "content": "let me look"}]


@pytest.mark.parametrize("fields", [
    {"tools": [TOOL], "tool_choice": "none"},
    {"tools": [TOOL], "tool_choice": "none", "documents": [{"title": "cities", "text": "Paris"}],
     "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False,
     "continue_final_message": True},
], ids=["tools", "tools+documents+kwargs+continue"])
async def test_a_chat_with_tools_tokenizes_to_what_vllm_prefills(vllm_aggregated: VllmEngine,
                                                                 fields: dict[str, Any]) -> None:
    body = {"model": vllm_aggregated.model, "messages": MSGS, "max_tokens": 1, **fields}
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(vllm_aggregated.url + "/v1/chat/completions", json={**body, "return_token_ids": True})
        assert r.status_code == 200, r.text
        prefilled = r.json()["prompt_token_ids"]

        creq = parse_body(body, chat=True)
        rendering = EngineTokenizer(http, [vllm_aggregated.url])
        assert (await rendering.prompt(creq)).token_ids == prefilled
        assert rendering.renders == {vllm_aggregated.url: True}  # vLLM 0.32 serves the render route
        tokenizing = EngineTokenizer(http, [vllm_aggregated.url])
        tokenizing.renders[vllm_aggregated.url] = False
        assert (await tokenizing.prompt(creq)).token_ids == prefilled

        # What the gateway sent before: the messages and a generation prompt, nothing else.
        before = await http.post(vllm_aggregated.url + "/tokenize",
                                 json={"model": vllm_aggregated.model, "messages": MSGS, "add_generation_prompt": True})
        assert before.json()["tokens"] != prefilled
