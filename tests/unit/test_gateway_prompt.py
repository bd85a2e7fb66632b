"""What the gateway sends to tokenize a prompt, and what it makes of the engine's answer (pure parts)."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.frontdoor.protocol import BadRequest, parse_body
from conductor.frontdoor.tokenizer import TOKENIZE_CHAT_FIELDS, media_parts, render_body, rendered_prompt, tokenize_body
from conductor.harness.engine.http import chat_template_vars, prompt_tokens

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSGS, "max_tokens": 8, **fields}


def test_every_field_the_engines_tokenize_route_takes_goes_with_the_chat() -> None:
    fields = {"tools": [TOOL], "chat_template": "{{ messages }}", "chat_template_kwargs": {"x": 1},
              "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
              "mm_processor_kwargs": {"a": 1}, "media_io_kwargs": {"image": {"b": 2}}}
    assert set(fields) == set(TOKENIZE_CHAT_FIELDS)
    body = tokenize_body(parse_body(chat(**fields, stream=True, temperature=0.5), chat=True))
    assert body == {"model": "m", "messages": MSGS, **fields}  # nothing that does not shape the prompt


def test_documents_and_reasoning_effort_are_folded_into_the_template_kwargs_as_the_chat_request_does() -> None:
    docs = [{"title": "a", "text": "b"}]
    body = tokenize_body(parse_body(chat(documents=docs, reasoning_effort="low",
                                         chat_template_kwargs={"documents": "client's", "x": 1}), chat=True))
    assert body["chat_template_kwargs"] == {"documents": docs, "reasoning_effort": "low", "enable_thinking": True,
                                            "x": 1}
    # the client's own thinking switch wins; "none" turns it off
    body = tokenize_body(parse_body(chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}),
                                    chat=True))
    assert body["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "none"}
    assert "chat_template_kwargs" not in tokenize_body(parse_body(chat(), chat=True))


@pytest.mark.parametrize("fields", [
    {}, {"tools": [TOOL]}, {"tools": [TOOL], "chat_template_kwargs": {"enable_thinking": False}},
    {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True},
    {"documents": [{"text": "d"}], "reasoning_effort": "high"},
    {"reasoning_effort": "medium", "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "x"}},
])
def test_the_tokenize_request_renders_what_the_chat_request_renders(fields: dict[str, Any]) -> None:
    # The emulated engine lays fields over the template kwargs as vLLM 0.32's two request types do.
    body = chat(**fields)
    want = prompt_tokens(body, chat=True)
    assert prompt_tokens(tokenize_body(parse_body(body, chat=True)), chat=True, tokenize=True) == want
    if fields:  # what the gateway sent before: the messages alone
        assert prompt_tokens({"model": "m", "messages": MSGS}, chat=True, tokenize=True) != want


def test_the_render_request_is_the_clients_chat() -> None:
    body = render_body(parse_body(chat(tools=[TOOL], tool_choice="auto", truncate_prompt_tokens=100, stream=True),
                                  chat=True))
    assert body == {"model": "m", "messages": MSGS, "tools": [TOOL], "tool_choice": "auto",
                    "truncate_prompt_tokens": 100, "mm_payload": "none"}


def test_a_render_answer_gives_the_ids_and_the_multimodal_items_in_prompt_order() -> None:
    answer = {"request_id": "r", "token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "sampling_params": {},
              "features": {"mm_hashes": {"image": ["img-b", "img-a"], "audio": ["aud"]},
                           "mm_placeholders": {"image": [{"offset": 6, "length": 2}, {"offset": 1, "length": 2}],
                                               "audio": [{"offset": 4, "length": 1}]},
                           "kwargs_data": None, "mm_metadata": None}}
    p = rendered_prompt(answer)
    assert p.token_ids == list(range(1, 11)) and p.unhashed_media == 0
    assert p.mm_items == (("img-a", 1, 2), ("aud", 4, 1), ("img-b", 6, 2))
    assert rendered_prompt({"token_ids": [5], "features": None}).mm_items == ()
    with pytest.raises(TypeError):
        rendered_prompt({"detail": "Not Found"})
    with pytest.raises(ValueError):  # hashes without placeholders
        rendered_prompt({"token_ids": [1], "features": {"mm_hashes": {"image": ["a"]}, "mm_placeholders": {}}})


def test_media_parts_are_counted() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                                         {"type": "input_audio", "input_audio": {"data": "..", "format": "wav"}}]}]
    assert media_parts(parse_body({"model": "m", "messages": msgs}, chat=True)) == 2
    assert media_parts(parse_body(chat(), chat=True)) == 0


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": ["x"]}, "tools"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncation_side": "middle"}, "truncation_side"),
])
def test_a_bad_prompt_field_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_body(chat(**fields), chat=True)
    assert e.value.param == param


def test_completions_keep_their_special_tokens_choice() -> None:
    req = parse_body({"model": "m", "prompt": "hello", "add_special_tokens": False}, chat=False)
    assert tokenize_body(req) == {"model": "m", "prompt": "hello", "add_special_tokens": False}
    assert chat_template_vars({"add_generation_prompt": False}, tokenize=True) == {
        "add_generation_prompt": False, "continue_final_message": False}


async def test_an_engine_whose_render_route_is_off_or_absent_is_asked_by_tokenize_from_then_on() -> None:
    import httpx

    from conductor.frontdoor.tokenizer import EngineTokenizer, PromptRejected

    asked: list[str] = []
    off = {"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
                                "enable them.", "type": "PermissionDeniedError", "param": None, "code": 403}}

    def engine(request: httpx.Request) -> httpx.Response:
        asked.append(f"{request.url.host}{request.url.path}")
        if request.url.path.endswith("/render"):
            if request.url.host == "vllm-default":  # vLLM 0.32 without --enable-scale-out
                return httpx.Response(403, json=off)
            return httpx.Response(404, json={"detail": "Not Found"})  # no such route (FastAPI's answer)
        if b"bad" in request.content:
            return httpx.Response(400, json={"error": {"message": "bad tool", "type": "BadRequestError",
                                                       "param": "tools", "code": 400}})
        return httpx.Response(200, json={"count": 2, "max_model_len": 8, "tokens": [7, 8]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as http:
        tok = EngineTokenizer(http, ["http://vllm-default", "http://older"])
        creq = parse_body(chat(tools=[TOOL]), chat=True)
        for _ in range(4):
            assert (await tok.prompt(creq)).token_ids == [7, 8]
        assert tok.renders == {"http://vllm-default": False, "http://older": False}
        assert sorted(asked[:4]) == ["older/tokenize", "older/v1/chat/completions/render",
                                     "vllm-default/tokenize", "vllm-default/v1/chat/completions/render"]
        assert all(a.endswith("/tokenize") for a in asked[4:])  # learnt once per engine
        with pytest.raises(PromptRejected) as e:
            await tok.prompt(parse_body(chat(tools=[{"bad": 1}]), chat=True))
        assert e.value.status == 400 and e.value.body["error"]["param"] == "tools"
