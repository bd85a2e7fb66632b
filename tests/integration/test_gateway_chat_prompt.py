"""A chat is routed on the token ids the engine prefills: tools, template kwargs, documents and the
generation prompt included (issue 27, item 9), through `conductor gateway` in front of emulated
engines (their template renders every one of those fields, as a real template does)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvstream import read_all

from conductor.frontdoor.protocol import parse_body
from conductor.frontdoor.tokenizer import EngineTokenizer, PromptRejected
from conductor.harness.gateway_cluster import GatewayCluster
from conductor.settings import Settings
from schemas import RoutingRequest
from streams.topics import topics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # `scripts/test -m slow`

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MSGS = [{"role": "system", "content": "you answer with a tool call"},
        {"role": "user", "content": "what is the weather in Paris and in Lyon today " * 4},
        {"role": "assistant", "content": "let me look that"}]


async def test_a_chat_with_tools_is_routed_on_the_ids_the_engine_prefills(settings: Settings, tmp_path: Path) -> None:
    body: dict[str, Any] = {
        "model": "default", "messages": MSGS, "tools": [TOOL], "tool_choice": "auto", "max_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"title": "cities", "text": "Paris Lyon"}],
        "add_generation_prompt": False, "continue_final_message": True,
    }
    async with GatewayCluster(settings, tmp_path / "logs", prefill=1, decode=1, time_scale=20.0,
                              max_output_tokens=4) as c, httpx.AsyncClient(timeout=30) as http:
        r = await http.post(c.gateway_url + "/v1/chat/completions", json=body,
                            headers={**c.auth_headers, "x-request-id": "tools-chat"})
        assert r.status_code == 200, r.text
        sent = [b for b in await read_all(settings, topics(settings.topic_config()).requests.name, 1)
                if isinstance(b, RoutingRequest) and b.request_id.endswith("-tools-chat")]
        assert len(sent) == 1

        # What the engine prefills for this very request (vLLM's return_token_ids).
        engine = c.engine_urls["decode-0"]
        direct = await http.post(engine + "/v1/chat/completions", json={**body, "return_token_ids": True})
        prefilled = direct.json()["prompt_token_ids"]
        assert sent[0].token_ids == prefilled and sent[0].prompt_tokens == len(prefilled)

        # The same ids by either of the engine's routes: render (first) and /tokenize (an engine without render).
        urls = list(c.engine_urls.values())
        creq = parse_body(body, chat=True)
        rendering = EngineTokenizer(http, urls)
        assert (await rendering.prompt(creq)).token_ids == prefilled and set(rendering.renders.values()) == {True}
        tokenizing = EngineTokenizer(http, urls)
        tokenizing.renders = dict.fromkeys(urls, False)
        assert (await tokenizing.prompt(creq)).token_ids == prefilled

        # What the gateway sent before (the messages alone) is another prompt.
        alone = await http.post(engine + "/tokenize", json={"model": "default", "messages": MSGS})
        assert alone.json()["tokens"] != prefilled

        # A prompt the engine's tokenizer refuses (messages that are no objects; the gateway's own check
        # passed them) is the client's error, its answer passed through.
        with pytest.raises(PromptRejected) as e:
            await tokenizing.prompt(replace(creq, messages=("not a message",)))
        assert e.value.status == 400 and e.value.body["error"]["param"] == "messages"
