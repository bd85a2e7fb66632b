"""A door without ``--tokenizer`` finds the model's files through an engine (``/v1/models``' root)
and tokenizes text prompts locally once they encode as the engine does (issue 35 item 3: no round
trip before the decision). The engine here is httpx's mock transport encoding with the same file,
or with another one."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from conductor.frontdoor.protocol import parse_body
from conductor.frontdoor.tokenizer import EngineTokenizer, ModelFilesTokenizer, prompt_tokenizer
from conductor.harness.bench.gateway import bench_tokenizer

pytestmark = pytest.mark.unit


def _engine(root: str, tok: Tokenizer, calls: list[str], *, shift: int = 0) -> httpx.MockTransport:
    """An engine serving model ``m`` from ``root``; its /tokenize encodes with ``tok`` (ids + ``shift``)."""

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "root": root, "object": "model"}]})
        body = json.loads(request.content)
        ids = tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True)).ids
        return httpx.Response(200, json={"tokens": [i + shift for i in ids], "count": len(ids)})

    return httpx.MockTransport(answer)


async def _run(tmp_path: Path, root: str, shift: int = 0) -> tuple[ModelFilesTokenizer, list[str], list[list[int]]]:
    (tmp_path / "model").mkdir(exist_ok=True)
    file = bench_tokenizer(tmp_path / "model" / "tokenizer.json")
    calls: list[str] = []
    async with httpx.AsyncClient(transport=_engine(root, Tokenizer.from_file(str(file)), calls, shift=shift)) as client:
        engine = EngineTokenizer(client, ["http://e0"])
        tok, how = prompt_tokenizer(engine, None, None)
        assert isinstance(tok, ModelFilesTokenizer) and "/v1/models" in how
        req = parse_body({"model": "m", "prompt": "lorem ipsum 12345 dolor"}, chat=False)
        got = [(await tok.prompt(req)).token_ids]  # through the engine; the look starts
        if tok._looking is not None:
            await tok._looking
        got.append((await tok.prompt(req)).token_ids)
    return tok, calls, got


async def test_the_engines_model_files_tokenize_text_prompts_locally_once_checked(tmp_path: Path) -> None:
    tok, calls, got = await _run(tmp_path, str(tmp_path / "model"))
    assert "m" in tok.local
    # the first request and the probe went to the engine; the second request did not
    assert calls == ["/tokenize", "/v1/models", "/tokenize"]
    assert got[0] == got[1] and got[0]


async def test_files_that_encode_otherwise_are_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="conductor.frontdoor.tokenizer"):
        tok, calls, _ = await _run(tmp_path, str(tmp_path / "model"), shift=1)
    assert tok.local == {} and calls.count("/tokenize") == 3 and "encodes differently" in caplog.text


async def test_files_not_on_this_host_leave_the_engine_tokenizing_and_are_not_asked_again(tmp_path: Path) -> None:
    tok, calls, _ = await _run(tmp_path, "/nowhere/model")
    assert tok.local == {} and calls == ["/tokenize", "/v1/models", "/tokenize"]
    req = parse_body({"model": "m", "prompt": "x"}, chat=False)
    assert tok.look(req) is None  # settled: an engine answered


async def test_the_files_are_settled_at_start_up_before_any_request(tmp_path: Path) -> None:
    # warm() runs as the door starts: once the engine answers, its models tokenize locally and the
    # first request goes to no engine at all. An engine not there yet is asked again.
    (tmp_path / "model").mkdir()
    file = bench_tokenizer(tmp_path / "model" / "tokenizer.json")
    calls: list[str] = []
    engine = _engine(str(tmp_path / "model"), Tokenizer.from_file(str(file)), calls)
    down = [2]

    def answer(request: httpx.Request) -> httpx.Response:
        if down[0]:
            down[0] -= 1
            raise httpx.ConnectError("not up yet", request=request)
        return engine.handler(request)  # type: ignore[no-any-return]

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        tok, _ = prompt_tokenizer(EngineTokenizer(client, ["http://e0"]), None, None)
        assert isinstance(tok, ModelFilesTokenizer)
        await tok.warm(every_s=0.0)
        # the models listed, then the look at "m" and its probe
        assert "m" in tok.local and calls == ["/v1/models", "/v1/models", "/tokenize"]
        req = parse_body({"model": "m", "prompt": "lorem ipsum 12345 dolor"}, chat=False)
        assert (await tok.prompt(req)).token_ids
        assert calls == ["/v1/models", "/v1/models", "/tokenize"]  # the request itself asked no engine


async def test_an_engine_with_no_model_list_is_not_asked_again_at_start_up() -> None:
    calls: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(404, json={"detail": "Not Found"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        tok, _ = prompt_tokenizer(EngineTokenizer(client, ["http://e0"]), None, None)
        assert isinstance(tok, ModelFilesTokenizer)
        await tok.warm(every_s=0.0)
    assert calls == ["/v1/models"] and tok.local == {}


def test_bench_gateway_prompts_are_as_long_as_asked(tmp_path: Path) -> None:
    """`conductor bench gateway --prompt-words N`: about N tokens of the bench's tokenizer before the
    per-request tail; without it, the bench's usual prompt (~100 tokens)."""
    from conductor.harness.bench.gateway import _body

    tok = Tokenizer.from_file(str(bench_tokenizer(tmp_path / "tokenizer.json")))
    usual = len(tok.encode(_body(1, 8)["prompt"]).ids)
    assert 90 <= usual <= 115  # 80 of prefix, 16-32 of tail (the digits of i one by one)
    for words in (100, 1450):
        n = len(tok.encode(_body(3, 8, words)["prompt"]).ids)
        assert words <= n <= words + 30, (words, n)
    assert _body(3, 8, 1450)["prompt"] != _body(4, 8, 1450)["prompt"]  # each request its own tail
