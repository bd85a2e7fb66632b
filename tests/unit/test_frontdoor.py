"""What both front doors share: the request id rule, the one routing-request builder, the decided
engine URL, and a decider's account of why nothing can be decided."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.frontdoor.decide import Colocated, Down, LogDecider
from conductor.frontdoor.directory import decided_url
from conductor.frontdoor.protocol import BadRequest, Prompt, Slo, parse_body, request_id, routing_request
from conductor.settings import load_settings
from schemas import Endpoint, RoutingDecision
from schemas.records import MAX_EXTRA_KEYS


@pytest.mark.parametrize("client_id,in_use,kept", [
    ("abc-1", False, True),
    ("a" * 96, False, True),
    ("a" * 97, False, False),
    ("has space", False, False),
    ("", False, False),
    (None, False, False),
    ("abc-1", True, False),  # the same id in flight: a new one
])
def test_request_id_keeps_a_usable_client_id(client_id: str | None, in_use: bool, kept: bool) -> None:
    rid = request_id("gw-1", client_id, lambda _: in_use)
    if kept:
        assert rid == f"gw-1-{client_id}"
    else:
        assert rid.startswith("gw-1-") and len(rid) == len("gw-1-") + 16


def test_routing_request_is_what_the_routers_need() -> None:
    creq = parse_body({"model": "adapter-a", "prompt": "x", "max_tokens": 7, "cache_salt": "s"}, chat=False,
                      base_model="base")
    items = tuple((f"img{i}", i * 10, 4) for i in range(MAX_EXTRA_KEYS + 3)) + (("", 0, 1),)
    req = routing_request("gw-1-r.r1", creq, Slo(0.5, 40.0, 3), Prompt([1, 2, 3], items), base_model="base",
                          reachable=["p0", "d0"], exclude=[f"n{i}" for i in range(70)], retry_of="gw-1-r")
    assert (req.model, req.lora_name, req.cache_salt) == ("base", "adapter-a", "s")
    assert (req.prompt_tokens, req.expected_output_tokens) == (3, 7)
    assert (req.ttft_slo_s, req.tbt_slo_ms, req.priority) == (0.5, 40.0, 3)
    assert len(req.mm_items) == MAX_EXTRA_KEYS and req.mm_items[0].identifier == "img0"
    assert len(req.exclude) == 64 and req.retry_of == "gw-1-r" and req.reachable == ["p0", "d0"]
    assert req.reply_to is None and req.decided_by is None  # the decider sets them


def test_routing_request_refused_by_the_schema_is_a_bad_prompt() -> None:
    creq = parse_body({"model": "m", "prompt": "x"}, chat=False)
    with pytest.raises(BadRequest) as e:
        routing_request("r", creq, Slo(None, None, 0), Prompt([-1]), base_model=None, reachable=[])
    assert e.value.param == "prompt" and "token_ids" in str(e.value)


def test_decided_url_prefers_the_override() -> None:
    d = RoutingDecision(request_id="r", prefill_instance="p", decode_instance="d", reused_tokens=0,
                        predicted_ttft_s=0.1, predicted_tbt_ms=5, policy="x", endpoints={
                            "p": Endpoint(url="http://p:1/"), "d": Endpoint(url="http://d:1")})
    assert decided_url("p", d, {}) == "http://p:1"
    assert decided_url("d", d, {"d": "http://o:2/"}) == "http://o:2"
    assert decided_url("x", d, {}) is None


class StubClaim:
    def __init__(self, problem: str | None) -> None:
        self.problem = problem


class StubRouter:
    def __init__(self, ready: bool, problem: str | None, claim: StubClaim | None = None) -> None:
        self.ready, self._problem, self.claim = ready, problem, claim

    def problem(self) -> str | None:
        return self._problem


TAKEN = "another process (h:1:ab) holds the producer id 'gw-1'"


@pytest.mark.parametrize("ready,problem,claim,down", [
    (True, None, None, None),
    (True, None, StubClaim(None), None),
    (False, "the colocated router is starting", None, Down("starting", "the colocated router is starting")),
    (True, "stopped following", StubClaim(None), Down("router_down", "stopped following")),
    (True, TAKEN, StubClaim(TAKEN), Down("producer_id_in_use", TAKEN)),
])
def test_colocated_says_why_it_cannot_decide(ready: bool, problem: str | None, claim: StubClaim | None,
                                             down: Down | None) -> None:
    router: Any = StubRouter(ready, problem, claim)
    assert Colocated(router).down("gateway") == down


def test_through_the_log_a_door_that_reads_no_decisions_says_so() -> None:
    dec = LogDecider(load_settings(), producer_id="gw-1")
    down = dec.down("picker")
    assert down is not None and down.code == "starting"
    assert down.message.startswith("the picker cannot read its decisions: ")
    assert dec.problem() is not None and not dec.waiting("gw-1-r")
