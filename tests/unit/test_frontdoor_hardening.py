"""Both front doors against hostile requests: engine-control fields, trusted bounds, body limits."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from starlette.responses import JSONResponse, Response

from conductor.frontdoor.protocol import BadRequest, SloBounds, parse_body, trusted_bounds
from conductor.frontdoor.tokenizer import LocalTokenizer, find_tokenizer, prompt_tokenizer
from conductor.gateway.app import gateway_app
from conductor.gateway.auth import key_ring
from conductor.harness.bench.gateway import bench_tokenizer
from conductor.settings import Settings
from tests.unit.test_epp_picker import BODY, WordTokenizer, body_msg, headers_msg, picker, run


@pytest.mark.parametrize("field,value", [
    ("kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 5600}),
    ("ec_transfer_params", {"do_remote_encode": True}), ("vllm_xargs", {"kv": 1}), ("priority", -100),
    ("request_id", "someone-else"), ("rid", "x"), ("data_parallel_rank", 1),
    ("bootstrap_host", "10.9.9.9"), ("bootstrap_port", 8998), ("bootstrap_room", 7), ("bootstrap_pair_key", "k"),
])
@pytest.mark.parametrize("chat", [False, True])
def test_an_engine_control_field_is_refused_naming_it(field: str, value: object, chat: bool) -> None:
    body: dict[str, object] = ({"model": "m", "messages": [{"role": "user", "content": "hi"}]} if chat
                               else {"model": "m", "prompt": "hi"})
    body[field] = value
    with pytest.raises(BadRequest) as e:
        parse_body(body, chat=chat)
    assert e.value.param == field


def test_the_client_s_own_fields_are_not_control() -> None:
    parse_body({"model": "m", "prompt": "hi", "cache_salt": "tenant-a", "session_id": "s", "user": "u",
                "temperature": 0.3}, chat=False)


async def test_the_picker_refuses_an_engine_control_field_before_deciding() -> None:
    p, dec = picker()
    body = json.dumps({"model": "m", "prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}).encode()
    [_, [r]] = await run(p, headers_msg(), body_msg(body, True))
    err = json.loads(r.immediate_response.body)["error"]
    assert r.immediate_response.status.code == 400 and err["param"] == "kv_transfer_params"
    assert dec.asked == []


async def test_the_picker_clamps_slo_and_priority_headers_to_the_defaults() -> None:
    p, dec = picker()
    hdrs: dict[str, Any] = {"x-conductor-priority": "100", "x-conductor-ttft-slo-ms": "1e9", "x-conductor-tbt-slo-ms": "1e9",
            "x-conductor-trusted-bounds": "ttft_ms=1e9, priority=100"}  # not trusted unless configured
    await run(p, headers_msg(**hdrs), body_msg(BODY, True))
    [req] = dec.asked
    assert (req.priority, req.ttft_slo_s, req.tbt_slo_ms) == (0, 30.0, 100.0)
    lower: dict[str, Any] = {"x-conductor-priority": "-5", "x-conductor-ttft-slo-ms": "500"}
    p, dec = picker()
    await run(p, headers_msg(**lower), body_msg(BODY, True))
    assert (dec.asked[0].priority, dec.asked[0].ttft_slo_s) == (-5, 0.5)  # tighter asks pass as sent


async def test_a_trusted_proxy_s_bounds_header_widens_them_when_the_picker_trusts_it() -> None:
    p, dec = picker(trust_bounds_header=True)
    hdrs: dict[str, Any] = {"x-conductor-priority": "100", "x-conductor-ttft-slo-ms": "1e9",
            "x-conductor-trusted-bounds": "ttft_ms=60000, priority=50"}
    await run(p, headers_msg(**hdrs), body_msg(BODY, True))
    [req] = dec.asked
    assert (req.priority, req.ttft_slo_s, req.tbt_slo_ms) == (50, 60.0, None)
    [_, [r]] = await run(p, headers_msg(**dict[str, Any]({"x-conductor-trusted-bounds": "ttft_ms=fast"})), body_msg(BODY, True))
    assert json.loads(r.immediate_response.body)["error"]["param"] == "x-conductor-trusted-bounds"


@pytest.mark.parametrize("value,want", [
    (None, SloBounds(30.0, 100.0, 0)), ("priority=7", SloBounds(30.0, 100.0, 7)),
    ("ttft_ms=2000,tbt_ms=50", SloBounds(2.0, 50.0, 0)), (" priority=-3 ", SloBounds(30.0, 100.0, -3)),
])
def test_trusted_bounds(value: str | None, want: SloBounds) -> None:
    assert trusted_bounds(value, SloBounds(30.0, 100.0, 0)) == want


@pytest.mark.parametrize("value", ["priority=101", "priority=1.5", "ttft_ms=0", "ttft_ms=inf", "speed=3", ""])
def test_bad_trusted_bounds_name_the_header(value: str) -> None:
    with pytest.raises(BadRequest) as e:
        trusted_bounds(value, SloBounds())
    assert e.value.param == "x-conductor-trusted-bounds"


async def test_the_picker_answers_deeply_nested_json_with_400() -> None:
    p, dec = picker()
    [_, [r]] = await run(p, headers_msg(), body_msg(b"[" * 200_000 + b"]" * 200_000, True))
    assert r.immediate_response.status.code == 400 and dec.asked == []


class EchoGateway:
    """What the routes hand to the gateway: the bodies it got."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []

    async def handle(self, body: Any, hdrs: Any, *, chat: bool, bounds: SloBounds | None = None) -> Response:
        self.bodies.append(body)
        return JSONResponse({"ok": True})


def test_the_gateway_refuses_a_body_past_its_limit_by_length_or_as_it_streams() -> None:
    gw = EchoGateway()
    with TestClient(gateway_app(gw, key_ring(Settings.model_construct(), insecure=True),  # type: ignore[arg-type]
                                max_body_bytes=1000)) as c:
        big = json.dumps({"model": "m", "prompt": "x" * 2000}).encode()
        r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: read until past the limit
            yield b'{"model": "m", "prompt": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'
        assert c.post("/v1/chat/completions", content=chunks()).status_code == 413
        assert c.post("/v1/completions", json={"model": "m", "prompt": "hi"}).status_code == 200
    assert gw.bodies == [{"model": "m", "prompt": "hi"}]


def test_find_tokenizer_in_a_model_directory_or_the_hub_cache(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    bench_tokenizer(tmp_path / "model" / "tokenizer.json")
    assert find_tokenizer(str(tmp_path / "model")) == str(tmp_path / "model" / "tokenizer.json")
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    bench_tokenizer(snap / "tokenizer.json")
    assert find_tokenizer("org/tiny", hub=tmp_path / "hub") == str(snap / "tokenizer.json")
    assert find_tokenizer("org/other", hub=tmp_path / "hub") is None
    assert find_tokenizer("llm", hub=tmp_path / "hub") is None and find_tokenizer(None) is None


async def test_prompt_tokenizer_says_which_way_and_falls_back_to_the_engine(tmp_path: Path) -> None:
    engine = WordTokenizer()
    tok, how = prompt_tokenizer(engine, None, "llm")
    assert tok is engine and "/tokenize" in how
    (tmp_path / "m").mkdir()
    bench_tokenizer(tmp_path / "m" / "tokenizer.json")
    tok, how = prompt_tokenizer(engine, None, str(tmp_path / "m"))
    assert isinstance(tok, LocalTokenizer) and "locally" in how


async def test_a_long_prompt_is_encoded_off_the_event_loop(tmp_path: Path) -> None:
    tok = LocalTokenizer(str(bench_tokenizer(tmp_path / "tokenizer.json")), None)
    text = "lorem ipsum dolor 12345 " * 30_000  # ~150k tokens: hundreds of ms of encoding
    creq = parse_body({"model": "m", "prompt": text}, chat=False)
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    ids = (await tok.prompt(creq)).token_ids
    took = time.perf_counter() - t0
    await asyncio.sleep(0.02)  # the ticker's gap over the encoding, if the loop was held
    t.cancel()
    short = (await tok.prompt(parse_body({"model": "m", "prompt": "lorem ipsum dolor 12345 " * 3}, chat=False))).token_ids
    assert ids[:len(short)] == short and len(ids) > 30_000
    assert took > 0.1 and max(gaps) < took / 2  # the loop went on while it encoded


async def test_the_door_encodes_a_prompt_to_the_ids_the_plain_encode_gives(tmp_path: Path) -> None:
    # The door encodes without character offsets (encode_batch_fast): the ids must be exactly the
    # tokenizer's own, for a BPE with merges across bytes, special tokens on and off, short prompts
    # on the loop and long ones on a thread.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog 0123456789", "Ünïcødé 日本語 🙂 tabs\tand  spaces",
              "conductor routes prefill and decode; kv blocks of 512 tokens"] * 50
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path / "tokenizer.json"
    bpe.save(str(path))
    tok = LocalTokenizer(str(path), None)
    texts = ["", "a", "the lazy dog", "Ünïcødé 日本語 🙂\t x", " ".join(corpus[:3]) * 2, " ".join(corpus) * 2]
    assert any(len(t) > 4096 for t in texts) and any(0 < len(t) <= 4096 for t in texts)  # both branches
    for text in texts:
        for special in (True, False):
            creq = parse_body({"model": "m", "prompt": text, "add_special_tokens": special}, chat=False)
            assert (await tok.prompt(creq)).token_ids == bpe.encode(text, add_special_tokens=special).ids


def test_a_refused_key_is_not_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    gw = EchoGateway()
    keys = key_ring(Settings.model_construct(gateway_api_key=SecretStr("k" * 20)))
    with caplog.at_level(logging.INFO, logger="conductor.gateway.auth"), TestClient(gateway_app(gw, keys)) as c:  # type: ignore[arg-type]
        for _ in range(5):
            assert c.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 401
    assert not [r for r in caplog.records if r.name == "conductor.gateway.auth"]
