"""The gateway's local tokenizer (``--tokenizer``: the model's ``tokenizer.json``, no round trip) gives
the ids real vLLM prefills for text prompts (issue 26, item 2; the ``vllm`` marker, tests/vllm/README.md).

The session's aggregated engine, serving the kit's tiny model; the gateway's :class:`LocalTokenizer` reads the
same model directory. Each prompt, with and without special tokens, is compared with the engine's
``/tokenize`` and with ``prompt_token_ids`` of the completion itself (``return_token_ids``)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from conductor.frontdoor.protocol import parse_body
from conductor.frontdoor.tokenizer import EngineTokenizer, LocalTokenizer, ModelFilesTokenizer
from conductor.gateway.handoff import engine_body
from conductor.harness.vllm_kit import VllmEngine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [
    "you are a helpful assistant. question 12: what is 7 * 6?",
    "  leading and trailing spaces, tabs\tand\nnew lines  ",
    "unicode: café naïve 東京 🙂 — “quotes”",
    "a",
]


async def test_local_tokenizer_gives_the_ids_vllm_prefills(vllm_aggregated: VllmEngine, tiny_model: Path) -> None:
    local = LocalTokenizer(str(tiny_model), fallback=None)  # the model directory, as vLLM was given
    async with httpx.AsyncClient(timeout=120) as http:
        for text in PROMPTS:
            for special in (True, False):
                body = {"model": vllm_aggregated.model, "prompt": text, "max_tokens": 1, "add_special_tokens": special}
                ours = (await local.prompt(parse_body(body, chat=False))).token_ids
                r = await http.post(vllm_aggregated.url + "/tokenize",
                                    json={"model": vllm_aggregated.model, "prompt": text, "add_special_tokens": special})
                assert r.status_code == 200, r.text
                assert ours == r.json()["tokens"], (text, special)
                r = await http.post(vllm_aggregated.url + "/v1/completions", json={**body, "return_token_ids": True})
                assert r.status_code == 200, r.text
                # vLLM puts a completion's prompt ids on its choice (a chat's at the top)
                assert ours == r.json()["choices"][0]["prompt_token_ids"], (text, special)


async def test_a_door_finds_the_engines_model_files_through_v1_models(vllm_aggregated: VllmEngine) -> None:
    """No --tokenizer: the door asks the engine which files it serves (/v1/models' root, the kit's
    model directory), checks them against its /tokenize, and then tokenizes text prompts locally."""
    async with httpx.AsyncClient(timeout=120) as http:
        tok = ModelFilesTokenizer(EngineTokenizer(http, [vllm_aggregated.url]))
        req = parse_body({"model": vllm_aggregated.model, "prompt": PROMPTS[2], "max_tokens": 1}, chat=False)
        first = (await tok.prompt(req)).token_ids  # the engine's, while the look starts
        look = tok._looking
        assert look is not None
        await look
        assert vllm_aggregated.model in tok.local
        assert (await tok.prompt(req)).token_ids == first


async def test_the_ids_the_gateway_sends_run_as_the_text_would(vllm_aggregated: VllmEngine, tiny_model: Path) -> None:
    """``--engine-prompt ids`` (the gateway's default): a text completion reaches vLLM as the ids the gateway
    tokenized it to (:func:`~conductor.gateway.handoff.engine_body`), and the engine prefills the same
    ids and answers the same tokens as it does for the text (greedy, so one answer per prompt)."""
    local = LocalTokenizer(str(tiny_model), fallback=None)
    async with httpx.AsyncClient(timeout=120) as http:
        for text in PROMPTS:
            body = {"model": vllm_aggregated.model, "prompt": text, "max_tokens": 6, "temperature": 0.0,
                    "return_token_ids": True}
            creq = parse_body(body, chat=False)
            sent = engine_body(body, creq, await local.prompt(creq))
            assert isinstance(sent["prompt"], list), sent
            answers = []
            # A salt each: the second request must not reuse the first one's cached blocks, or it
            # would compute only the prompt's tail and its logits could differ in the last bit.
            for salt, b in (("text", body), ("ids", sent)):
                r = await http.post(vllm_aggregated.url + "/v1/completions",
                                    json={**b, "cache_salt": f"{salt}-{uuid.uuid4().hex}"})
                assert r.status_code == 200, r.text
                c = r.json()["choices"][0]
                answers.append((c["prompt_token_ids"], c["token_ids"], c["text"], r.json()["usage"]["prompt_tokens"]))
            assert answers[0] == answers[1], text
