"""The gateway's readiness (issue 36 items 5 and 10): it trips after repeated unacknowledged
decisions and comes back on the next acknowledged one, holds a decision's slot until its shielded
work ends, and refuses new requests while it drains. A real :class:`Gateway` over a scripted decider."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from conductor.frontdoor.decide import Down, LogUnavailable, ReleaseMark
from conductor.frontdoor.protocol import ClientRequest, Prompt
from conductor.gateway.app import gateway_app
from conductor.gateway.auth import key_ring
from conductor.gateway.config import GatewayConfig, default_gateway_id
from conductor.gateway.health import LogHealth
from conductor.gateway.service import Gateway
from conductor.routing.decision import rejection_record
from conductor.settings import Settings
from schemas import RoutingDecision, RoutingRejection, RoutingRequest

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}


class Tokens:
    async def prompt(self, creq: ClientRequest) -> Prompt:
        return Prompt(token_ids=[1, 2, 3])


class Outcomes:
    """The producer: takes the outcome records; no metadata (the broker probe says no)."""

    async def send(self, *args: Any, **kwargs: Any) -> None:
        return None


class Scripted:
    """A decider whose answers the test sets: ``fail`` → LogUnavailable, else a rejection (logged);
    ``hold`` keeps the decision's work running until it is set."""

    late = "(test)"

    def __init__(self) -> None:
        self.fail = False
        self.hold: asyncio.Event | None = None
        self.asked: list[str] = []
        self.ended = 0

    async def start(self) -> None: ...

    async def decide(self, req: RoutingRequest) -> RoutingDecision | RoutingRejection:
        self.asked.append(req.request_id)
        try:
            if self.hold is not None:
                await asyncio.shield(self.hold.wait())
            if self.fail:
                raise LogUnavailable("the broker did not take the decision (test)")
            return rejection_record(req.request_id, "overloaded", "test", policy="test", params={})
        finally:
            self.ended += 1

    def problem(self) -> str | None:
        return None

    def down(self, door: str) -> Down | None:
        return None

    def waiting(self, request_id: str) -> bool:
        return False

    def released(self, decision: RoutingDecision, at: Any, monotonic_s: float, failed: bool = False) -> ReleaseMark | None:
        return None

    async def close(self) -> None: ...


def gateway(decider: Scripted, **config: Any) -> Gateway:
    settings = Settings.model_construct()
    conf = GatewayConfig(gateway_id="gw-test", engines={}, **config)
    return Gateway(settings, conf, Tokens(), httpx.AsyncClient(), Outcomes(), decider)


async def client(gw: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    app = gateway_app(gw, key_ring(Settings.model_construct(), insecure=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c


@pytest.fixture
def decider() -> Scripted:
    return Scripted()


async def test_health_trips_after_n_unacknowledged_decisions_and_comes_back_on_an_acknowledged_one(
    decider: Scripted,
) -> None:
    gw = gateway(decider, log_failures_to_trip=3)
    async for c in client(gw):
        assert (await c.get("/health")).status_code == 200
        decider.fail = True
        for _ in range(3):
            r = await c.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "log_unavailable", r.text
        h = await c.get("/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "log_unavailable"
        # Tripped: the trial request of this second goes to the decider, the next is refused at once.
        await c.post("/v1/completions", json=BODY)
        asked = len(decider.asked)
        r = await c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "log_unavailable"
        assert len(decider.asked) == asked  # refused without waiting on a decision
        decider.fail = False
        gw.log_health._last_try = float("-inf")  # the next second's trial
        r = await c.post("/v1/completions", json=BODY)
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"  # decided and logged
        assert (await c.get("/health")).status_code == 200


async def test_a_decision_past_the_timeout_holds_its_slot_until_its_work_ends(decider: Scripted) -> None:
    gw = gateway(decider, max_deciding=1, decision_timeout_s=0.1)
    decider.hold = asyncio.Event()
    async for c in client(gw):
        r = await c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "decision_timeout"
        r = await c.post("/v1/completions", json=BODY)  # the first decision still runs: its slot is taken
        assert r.status_code == 429 and r.json()["error"]["code"] == "gateway_busy", r.text
        decider.fail = True
        decider.hold.set()
        for _ in range(50):
            if decider.ended:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        assert gw.deciding.deciding == 0 and gw.log_health.failures == 1  # its failure counted once it ended


async def test_a_draining_gateway_is_unready_and_refuses_new_requests(decider: Scripted) -> None:
    gw = gateway(decider)
    async for c in client(gw):
        gw.drain(30.0)
        h = await c.get("/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "draining"
        r = await c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining" and r.headers["retry-after"]
        assert decider.asked == []


@pytest.mark.parametrize(
    ("events", "tripped"),
    [
        ("fff", True),
        ("ff", False),
        ("ffaf", False),
        ("fffa", False),
        ("ffffh", False),
        ("ffffhf", True),
    ],
)
def test_log_health(events: str, tripped: bool) -> None:
    h = LogHealth(3)
    for e in events:
        {"f": h.failed, "a": h.acknowledged, "h": h.half_open}[e]()
    assert h.tripped is tripped and (h.problem() is not None) is tripped


def test_log_health_lets_one_trial_through_a_second() -> None:
    now = [100.0]
    h = LogHealth(1, clock=lambda: now[0])
    assert h.may_try() and not h.may_try()
    now[0] += 1.0
    assert h.may_try()


def test_the_default_gateway_id_carries_an_incarnation() -> None:
    a, b = default_gateway_id(started_s=1_800_000_000), default_gateway_id(started_s=1_800_000_001)
    assert a != b and a.rsplit("-", 1)[0] == b.rsplit("-", 1)[0]


async def test_a_second_request_under_an_id_in_flight_is_409_and_the_id_is_free_once_it_ends(
    decider: Scripted,
) -> None:
    gw = gateway(decider)
    decider.hold = asyncio.Event()  # the first request is in flight (its decision not back yet)
    same = {"x-request-id": "client-7"}
    async for c in client(gw):
        first = asyncio.ensure_future(c.post("/v1/completions", json=BODY, headers=same))
        while not decider.asked:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/completions", json=BODY, headers=same)
        assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate_request_id", r.text
        other = asyncio.ensure_future(c.post("/v1/completions", json=BODY, headers={"x-request-id": "client-8"}))
        decider.hold.set()
        assert (await first).status_code == 429 and (await other).status_code == 429
        assert decider.asked == ["gw-test-client-7", "gw-test-client-8"]
        assert (await c.post("/v1/completions", json=BODY, headers=same)).status_code == 429  # free again
