"""Both front doors against hostile requests: engine-control fields, trusted bounds, body limits."""

from __future__ import annotations

import json

import pytest

from conductor.frontdoor.protocol import BadRequest, parse_body
from tests.unit.test_epp_picker import body_msg, headers_msg, picker, run


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
