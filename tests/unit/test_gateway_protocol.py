"""The front door's pure parts (body and header validation, rejections as HTTP) and the P/D hand-off bodies."""

from __future__ import annotations

import pytest

from conductor.frontdoor.protocol import (
    REJECTION_STATUS,
    BadRequest,
    Prompt,
    parse_body,
    parse_engine_map,
    parse_slo,
    rejection_response,
)
from conductor.gateway.config import ConfigError, engine_prompt
from conductor.gateway.handoff import engine_body
from conductor.gateway.handoff.sglang import sglang_bodies
from conductor.gateway.handoff.vllm import vllm_decode_body, vllm_prefill_body
from conductor.harness.engine.http import chat_prompt, emulated_tokens
from schemas.records import RejectReason


@pytest.mark.parametrize("body,chat,param", [
    ({"prompt": "x"}, False, "model"),
    ({"model": "m"}, False, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, False, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, False, "max_tokens"),
    ({"model": "m", "prompt": "x", "n": 2}, False, "n"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, False, "stream"),
    ({"model": "m", "messages": []}, True, "messages"),
    ({"model": "m", "messages": [{"content": "hi"}]}, True, "messages[0]"),
    ({"model": "m", "prompt": "x", "cache_salt": 5}, False, "cache_salt"),
    ([1, 2], False, "body"),
])
def test_a_bad_body_names_its_field(body, chat, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BadRequest) as e:
        parse_body(body, chat=chat)
    assert e.value.param == param


def test_good_bodies_and_lora_by_model_name() -> None:
    r = parse_body({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}}, chat=False, base_model="m")
    assert r.prompt_ids == (1, 2, 3) and r.max_tokens == 5 and r.stream and r.include_usage and r.lora_name is None
    c = parse_body({"model": "sql-adapter", "messages": [{"role": "user", "content": "hi"}],
                    "max_completion_tokens": 7}, chat=True, base_model="m")
    assert c.max_tokens == 7 and c.lora_name == "sql-adapter"


def test_slo_headers() -> None:
    s = parse_slo({"x-conductor-ttft-slo-ms": "250", "x-conductor-tbt-slo-ms": "40", "x-conductor-priority": "3"})
    assert (s.ttft_s, s.tbt_ms, s.priority) == (0.25, 40.0, 3)
    assert parse_slo({}).ttft_s is None
    for h, v in (("x-conductor-ttft-slo-ms", "-1"), ("x-conductor-tbt-slo-ms", "nan"), ("x-conductor-priority", "x")):
        with pytest.raises(BadRequest) as e:
            parse_slo({h: v})
        assert e.value.param == h


def test_every_rejection_reason_has_a_status_and_slo_misses_are_429() -> None:
    assert set(RejectReason.__args__) <= set(REJECTION_STATUS)  # type: ignore[attr-defined]
    status, body, headers = rejection_response("ttft_slo", "predicted 40s > 30s")
    assert status == 429 and body["error"]["code"] == "ttft_slo" and headers["Retry-After"] == "1"
    status, body, headers = rejection_response("no_live_instance", "none")
    assert status == 503 and body["error"]["type"] == "service_unavailable" and "Retry-After" in headers


def test_vllm_hand_off_bodies() -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": False}}
    p = vllm_prefill_body(body, chat=False)
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    kv = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
          "remote_port": 1}
    d = vllm_decode_body(body, kv)
    assert d["kv_transfer_params"] == kv and d["max_tokens"] == 50 and d["stream_options"]["include_usage"] is True
    assert body["stream_options"] == {"include_usage": False}  # the client's body is not changed


def test_a_text_completion_reaches_the_engine_as_the_ids_it_was_tokenized_to() -> None:
    ids = Prompt([1, 450, 4996, 17354])
    body = {"model": "m", "prompt": "the quick fox", "max_tokens": 5, "stream": True, "add_special_tokens": True}
    out = engine_body(body, parse_body(body, chat=False), ids)
    assert out == {**body, "prompt": [1, 450, 4996, 17354]}
    assert body["prompt"] == "the quick fox"  # the client's body is not changed
    # and the P/D halves carry them on (prefill and decode alike)
    assert vllm_prefill_body(out, chat=False)["prompt"] == ids.token_ids
    assert vllm_decode_body(out, {"do_remote_prefill": True})["prompt"] == ids.token_ids


@pytest.mark.parametrize("body,chat,why", [
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True, "a chat: the template is the engine's"),
    ({"model": "m", "prompt": "hi", "echo": True}, False, "echoed: the client's own text comes back"),
    ({"model": "m", "prompt": "hi", "truncate_prompt_tokens": 1}, False, "truncated by the engine, on its text"),
    ({"model": "m", "prompt": [1, 2, 3]}, False, "ids already"),
])
def test_what_keeps_its_prompt_as_the_client_sent_it(body, chat, why) -> None:  # type: ignore[no-untyped-def]
    assert engine_body(body, parse_body(body, chat=chat), Prompt([1, 2, 3])) is body, why


def test_a_lora_adapters_prompt_keeps_its_text() -> None:
    body = {"model": "my-adapter", "prompt": "hi"}  # an adapter may bring a tokenizer of its own
    assert engine_body(body, parse_body(body, chat=False, base_model="base"), Prompt([1, 2])) is body
    body = {"model": "base", "prompt": "hi"}
    assert engine_body(body, parse_body(body, chat=False, base_model="base"), Prompt([1, 2]))["prompt"] == [1, 2]


def test_no_ids_no_rewrite_and_the_option_names_itself() -> None:
    body = {"model": "m", "prompt": ""}
    assert engine_body(body, parse_body(body, chat=False), Prompt([])) is body
    assert engine_prompt("ids") == "ids" and engine_prompt("text") == "text"
    with pytest.raises(ConfigError, match="--engine-prompt must be one of ids, text"):
        engine_prompt("tokens")


def test_sglang_hand_off_bodies_share_one_room() -> None:
    p, d = sglang_bodies({"model": "m", "prompt": "x", "stream": True}, "10.0.0.1", 8998, 42)
    for b in (p, d):
        assert (b["bootstrap_host"], b["bootstrap_port"], b["bootstrap_room"]) == ("10.0.0.1", 8998, 42)
    assert p["stream"] is False and d["stream"] is True


def test_engine_map() -> None:
    assert parse_engine_map(["p0=http://h:1/", "d0=http://h:2"]) == {"p0": "http://h:1", "d0": "http://h:2"}
    for bad in (["p0"], ["p0=h:1"], ["p0=http://a", "p0=http://b"]):
        with pytest.raises(ValueError):
            parse_engine_map(bad)


def test_emulated_tokenizer_keeps_shared_prefixes() -> None:
    a, b = emulated_tokens("one two three four"), emulated_tokens("one two three five")
    assert a[:3] == b[:3] and a[3] != b[3] and len(a) == 4
    assert chat_prompt([{"role": "user", "content": "hi"}]).endswith("<|assistant|>")
