"""A gateway process killed (SIGKILL) with streams in flight: its in-flight charges stop counting
within ``inflight_lost_after_s`` plus a look, ended by another gateway (here a colocated router
in the test process, as a second gateway's), not a lease later; the outcome says so. Started again
under the same id, the gateway ends the killed run's charges itself before it serves."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from conductor.harness.gateway_cluster import GatewayCluster
from conductor.routing.local import LocalRouter
from conductor.settings import Settings
from schemas import RequestOutcome
from state.shared_log import RedisInflight
from streams.topics import topics
from tests.integration.kvstream import read_all

STREAMS = 4


async def stream(c: GatewayCluster, i: int) -> None:
    """One long streamed completion through the cluster's gateway, read to its end (or its gateway's death)."""
    async with httpx.AsyncClient(base_url=c.gateway_url, headers=c.auth_headers, timeout=60) as cl:
        with contextlib.suppress(httpx.HTTPError):
            async with cl.stream("POST", "/v1/completions", json={
                    "model": "default", "prompt": f"stream {i} " * 200, "max_tokens": 400, "stream": True}) as r:
                async for _ in r.aiter_bytes():
                    pass


@dataclass
class Watch:
    """Another gateway's colocated router in the test process, its in-flight ledger, and the streams
    the test opened through the cluster's gateway."""

    other: LocalRouter
    ledger: RedisInflight
    clients: list[asyncio.Task[None]] = field(default_factory=list)

    def open_streams(self, c: GatewayCluster) -> None:
        self.clients = [asyncio.create_task(stream(c, i)) for i in range(STREAMS)]


@contextlib.asynccontextmanager
async def watching(s: Settings) -> AsyncIterator[Watch]:
    other = LocalRouter(s, producer_id="gw-other")
    await other.start()
    w = None
    try:
        ledger = other.router.decision_time.inflight
        assert isinstance(ledger, RedisInflight)
        w = Watch(other, ledger)
        yield w
    finally:
        clients = w.clients if w is not None else []
        for t in clients:
            t.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await other.close()


async def test_a_killed_gateways_charges_end_seconds_later_not_a_lease_later(settings: Settings,
                                                                            tmp_path: Path) -> None:
    s = settings.model_copy(update={"inflight_lost_after_s": 3.0, "inflight_lease_s": 600.0})
    async with GatewayCluster(s, tmp_path / "logs", time_scale=1.0, max_output_tokens=400) as c:
        async with watching(s) as w:
            other, ledger = w.other, w.ledger
            w.open_streams(c)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(ledger.owner) < 4:
                await asyncio.sleep(0.05)
            assert len(ledger.owner) == 4 and set(ledger.owner.values()) == {c.gateway_id}
            await asyncio.sleep(2.0)  # past a keep-alive or two: a live gateway with long streams is not lost
            assert len(ledger.owner) == 4 and other.reaped == 0
            pid = c.gateway_pids()["gateway"]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            while time.monotonic() < killed + 20 and other.reaped < 4:
                await asyncio.sleep(0.1)
            took = time.monotonic() - killed
            assert other.reaped == 4, other.reaped
            # Silent for the limit (counted from its last entry, up to a keep-alive before the kill),
            # then the next look; a lease (600 s here) later before.
            assert 3.0 - 0.6 - 0.3 <= took < 15.0, took
            now = await ledger.now_ms()
            assert not ledger.local.loads(now)  # no instance carries the dead gateway's work
        outs = [o for o in await read_all(s, topics(s.topic_config()).request_outcomes.name, 4)
                if isinstance(o, RequestOutcome) and o.error == "gateway_lost"]
        assert len(outs) == 4 and {o.gateway for o in outs} == {c.gateway_id}
        assert {o.release_producer for o in outs} == {"gw-other"}


async def test_a_gateway_restarted_under_its_own_id_ends_its_killed_runs_charges_at_start(settings: Settings,
                                                                                          tmp_path: Path) -> None:
    """Killed with streams in flight and started again under the same ``--gateway-id`` (a container
    restarted with a fixed id): the others hear that id alive again at once, so nobody takes the
    killed run's charges for lost (the limit is a minute here, the lease ten); the new process ends
    them itself before it serves, each with a ``gateway_restarted`` outcome."""
    s = settings.model_copy(update={"inflight_lost_after_s": 60.0, "inflight_lease_s": 600.0})
    async with GatewayCluster(s, tmp_path / "logs", time_scale=1.0, max_output_tokens=400) as c:
        async with watching(s) as w:
            other, ledger = w.other, w.ledger
            w.open_streams(c)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(ledger.local.in_flight()) < 4:
                await asyncio.sleep(0.05)
            killed_charges = set(ledger.local.in_flight())
            assert len(killed_charges) == 4 and set(ledger.owner.values()) == {c.gateway_id}
            pid = c.gateway_pids()["gateway"]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await asyncio.gather(*w.clients, return_exceptions=True)
            killed = time.monotonic()
            await c.restart_gateway()
            while time.monotonic() < killed + 30 and killed_charges & ledger.local.in_flight():
                await asyncio.sleep(0.1)
            took = time.monotonic() - killed
            assert not killed_charges & ledger.local.in_flight()
            assert took < 30.0 and other.reaped == 0, (took, other.reaped)  # the new run's, not a reaper's
            # The restarted gateway serves.
            async with httpx.AsyncClient(base_url=c.gateway_url, headers=c.auth_headers, timeout=60) as cl:
                r = await cl.post("/v1/completions", json={"model": "default", "prompt": "after the restart " * 50,
                                                           "max_tokens": 4})
                assert r.status_code == 200, r.text
        outs = [o for o in await read_all(s, topics(s.topic_config()).request_outcomes.name, 4)
                if isinstance(o, RequestOutcome) and o.error == "gateway_restarted"]
        assert sorted(o.request_id for o in outs) == sorted(killed_charges)
        assert {o.gateway for o in outs} == {c.gateway_id} and {o.release_producer for o in outs} == {c.gateway_id}


async def test_a_second_gateway_under_a_live_ones_id_exits_at_start_naming_the_option(settings: Settings,
                                                                                       tmp_path: Path) -> None:
    """A second replica given the running gateway's fixed ``--gateway-id`` would skip its records
    and end its charges: it exits at start (status 2, one line naming the option and the holder),
    and the first gateway's requests in flight and after go on as before."""
    s = settings.model_copy(update={"inflight_lost_after_s": 60.0, "inflight_lease_s": 600.0})
    async with GatewayCluster(s, tmp_path / "logs", time_scale=1.0, max_output_tokens=400) as c, watching(s) as w:
        ledger = w.ledger
        w.open_streams(c)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(ledger.local.in_flight()) < STREAMS:
            await asyncio.sleep(0.05)
        charged = set(ledger.local.in_flight())
        assert len(charged) == STREAMS
        twin = await c.start_twin_gateway()
        assert await asyncio.wait_for(twin.wait(), 60) == 2
        said = c.procs.log_tail("gateway-twin", 1)  # one line, however wide the terminal
        assert said.startswith("error: producer id") and "--gateway-id" in said and c.gateway_id in said, said
        assert "Traceback" not in said
        assert charged <= ledger.local.in_flight()  # the first one's charges stand
        async with httpx.AsyncClient(base_url=c.gateway_url, headers=c.auth_headers, timeout=60) as cl:
            r = await cl.post("/v1/completions", json={"model": "default", "prompt": "beside a twin " * 50,
                                                       "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert (await cl.get("/health")).status_code == 200
