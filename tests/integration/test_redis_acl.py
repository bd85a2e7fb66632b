"""Redis ACL users on the real Valkey, with the least privilege Conductor needs (``state.acl``):
the view's writes, reads and maintenance, and the request path (worker, router with its
tracking reader, reservations and decision index, gateway: processes) run as a user limited
to its namespace's keys and the commands the code sends, and the server logs no denial;
anything else is refused; a wrong password is one clear line."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr
from redis.exceptions import NoPermissionError
from typer.testing import CliRunner

from conductor.cli import app
from conductor.harness.gateway_cluster import GatewayCluster
from conductor.routing.stores import decision_index, redis_stores
from conductor.settings import Settings, load_settings, settings_env
from schemas import AllBlocksCleared, BlocksRemoved, BlocksStored, Heartbeat, envelope
from state.acl import acl_rules
from state.decisions import DecisionPosition
from state.redis_view import RedisViewStore
from state.reservations import placement_reservations

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture
async def acl_user(settings: Settings) -> AsyncIterator[tuple[Settings, aioredis.Redis]]:
    """``settings`` as a fresh ACL user with ``state.acl``'s rules for its namespace, and the root client."""
    user, pw = f"conductor-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    root = aioredis.from_url(settings.redis_url)
    await root.execute_command("ACL", "SETUSER", user, "reset", "on", f">{pw}", *acl_rules(settings.view_namespace))
    await root.execute_command("ACL", "LOG", "RESET")
    try:
        yield settings.model_copy(update={"redis_username": user, "redis_password": SecretStr(pw)}), root
    finally:
        await root.execute_command("ACL", "DELUSER", user)
        await root.aclose()


async def denials(root: aioredis.Redis, user: str) -> list[str]:
    """What the server refused ``user`` (its ACL LOG): ``reason object``, e.g. ``command flushall``."""
    out = []
    for entry in await root.execute_command("ACL", "LOG", "128"):
        e = dict(zip(entry[::2], entry[1::2])) if isinstance(entry, list) else entry
        e = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v for k, v in e.items()}
        if e.get("username") == user:
            out.append(f"{e.get('reason')} {e.get('object')}")
    return out


async def test_the_view_and_its_maintenance_need_no_more(acl_user: tuple[Settings, aioredis.Redis]) -> None:
    s, root = acl_user
    now = int(time.time() * 1000)
    view = RedisViewStore.connect(s.redis(), s.view_namespace)
    index = decision_index(s)
    assert index is not None
    try:
        # Every branch of the write script: store, a second holder, a tier added, removals (an entry
        # left empty is deleted), a node cleared (its slot retired), then compaction sweeps the slot.
        bodies = {"p-acl": [Heartbeat(role="prefill"), BlocksStored(block_keys=[11, 12, 13]),
                            BlocksStored(block_keys=[11], tier="dram"), BlocksRemoved(block_keys=[12, 11])],
                  "p-two": [Heartbeat(role="prefill"), BlocksStored(block_keys=[11, 13]), AllBlocksCleared()]}
        await view.apply([(envelope(body, producer_id=node, producer_seq=i, ts_ms=now), None)
                          for node, seq in bodies.items() for i, body in enumerate(seq)])
        snap = await view.snapshot([11, 12, 13, 14])
        assert sorted(n.node_id for n in snap.nodes) == ["p-acl", "p-two"]
        assert (await view.view_health())[0] and await view.streams(["p-acl"]) and await view.dump()
        assert (await view.compact())["slots_freed"] == 1
        await index.record([DecisionPosition("r-acl", 0, 7, now, 1, 3)])
        assert (await index.lookup(["r-acl"]))["r-acl"].offset == 7
        await view.clear()  # what `conductor view rebuild` does first
        assert await view.nodes() == []

        # Nothing beyond: no administration, no other namespace's keys.
        for cmd in (("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "maxmemory"), ("GET", "{other}|2|gen"),
                    ("SET", "unrelated", "1"), ("PUBLISH", "c", "m")):
            with pytest.raises(NoPermissionError):
                await view.client.execute_command(*cmd)
        refused = await denials(root, s.redis_username or "")  # denials name the user: the view ran as it
        assert len(refused) == 6 and not any(r.split()[1] in ("evalsha", "time", "scan") for r in refused), refused
    finally:
        await index.close()
        await view.close()

    bad = s.model_copy(update={"redis_password": SecretStr("wrong-" + s.redis_password.get_secret_value())})
    res = CliRunner().invoke(app, ["view", "show"], env=settings_env(bad))
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "cannot reach Redis" in res.output and s.redis_password.get_secret_value() not in res.output


@pytest.mark.slow  # `scripts/test -m slow`
async def test_the_request_path_runs_as_the_least_privileged_user(acl_user: tuple[Settings, aioredis.Redis],
                                                                  tmp_path: Path) -> None:
    s, root = acl_user
    s = s.model_copy(update={"view_reader": "tracking"})  # the raw reader's commands and RESP3 tracking
    async with GatewayCluster(s, tmp_path / "logs", time_scale=20.0, max_output_tokens=4) as c:
        cl = openai.AsyncOpenAI(base_url=c.gateway_url + "/v1", api_key=c.api_key, max_retries=0, timeout=30)
        for i in range(3):
            r = await cl.completions.create(model="default", prompt=f"least privilege {i} " * 20, max_tokens=4)
            assert r.choices[0].text
        res = await asyncio.to_thread(CliRunner().invoke, app, ["view", "show"], env=settings_env(s))
        assert res.exit_code == 0, res.output
    assert await denials(root, s.redis_username or "") == []


async def test_on_a_redis_cluster_the_user_needs_the_slot_map_too(stack, valkey_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tag = uuid.uuid4().hex[:8]
    user, pw = f"conductor-{tag}", uuid.uuid4().hex
    s = load_settings(kafka_url=stack.kafka_url, redis_url=valkey_cluster.url, profile="embedded",
                      topic_prefix=f"t{tag}.", view_namespace=f"t{tag}", data_dir=tmp_path / "data",
                      redis_username=user, redis_password=pw)
    roots = [n.client() for n in valkey_cluster.nodes]
    for r in roots:
        r.execute_command("ACL", "SETUSER", user, "reset", "on", f">{pw}", *acl_rules(s.view_namespace, cluster=True))
        r.execute_command("ACL", "LOG", "RESET")
    now = int(time.time() * 1000)
    view = RedisViewStore.connect(s.redis(), s.view_namespace)
    reader, resv = redis_stores(s, producer_id="router-acl")
    try:
        await view.apply([(envelope(Heartbeat(role="prefill"), producer_id="p-c", producer_seq=0, ts_ms=now), None),
                          (envelope(BlocksStored(block_keys=[5, 6]), producer_id="p-c", producer_seq=1, ts_ms=now),
                           None)])
        assert (await view.snapshot([5, 6])).prefix == {"p-c": (2, 2, 2)}
        assert (await reader.snapshot([5, 6])).prefix == {"p-c": (2, 2, 2)}  # the raw reader, at the slot's primary
        await resv.start(now)  # the reservations stream: errors are only logged, denials are in the ACL LOG
        await resv.reserve(placement_reservations("p-c", "p-c", prefill_tokens=64, context_tokens=64, kv_blocks=4), now)
        await resv.flush()
        await view.compact()
        refused = [e for r in roots for e in r.execute_command("ACL", "LOG", "128")]
        assert refused == [], refused
    finally:
        await resv.close()
        await reader.close()
        await view.close()
        for r in roots:
            r.execute_command("ACL", "DELUSER", user)
            r.close()
