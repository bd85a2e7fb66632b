"""Redis ACL users on the real Valkey: a Conductor that names a user and password (apart from
the URL) reads and writes the view with them; a wrong password is one clear line."""

from __future__ import annotations

import time
import uuid

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr
from typer.testing import CliRunner

from conductor.cli import app
from conductor.settings import settings_env
from schemas import Heartbeat, envelope
from state.redis_view import RedisViewStore

pytestmark = pytest.mark.integration


async def test_view_through_an_acl_user(settings):
    user, pw = f"conductor-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    root = aioredis.from_url(settings.redis_url)
    # Only its own namespace's keys, only the commands the view needs; never the default user.
    await root.execute_command("ACL", "SETUSER", user, "on", f">{pw}", f"~{{{settings.view_namespace}}}|*", "+@all")
    try:
        s = settings.model_copy(update={"redis_username": user, "redis_password": SecretStr(pw)})
        view = RedisViewStore.connect(s.redis(), s.view_namespace)
        try:
            await view.apply([(envelope(Heartbeat(role="prefill"), producer_id="p-acl", producer_seq=0,
                                        ts_ms=int(time.time() * 1000)), None)])
            snap = await view.snapshot([])
            assert [n.node_id for n in snap.nodes] == ["p-acl"]
            assert (await view.client.execute_command("ACL", "WHOAMI")).decode() == user
        finally:
            await view.close()

        bad = settings.model_copy(update={"redis_username": user, "redis_password": SecretStr("wrong-" + pw)})
        res = CliRunner().invoke(app, ["view", "show"], env=settings_env(bad))
        assert res.exit_code == 2 and "Traceback" not in res.output
        assert "cannot reach Redis" in res.output and pw not in res.output
    finally:
        await root.execute_command("ACL", "DELUSER", user)
        await root.aclose()
