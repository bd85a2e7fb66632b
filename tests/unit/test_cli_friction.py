"""A new user's first commands: one clear line instead of a traceback, shell-ready output."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conductor.cli import app
from conductor.cli.common import redacted_url


@pytest.fixture
def no_stack_env(tmp_path, monkeypatch):
    for k in ("CONDUCTOR_KAFKA_URL", "CONDUCTOR_REDIS_URL", "CONDUCTOR_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    return {"CONDUCTOR_DATA_DIR": str(tmp_path)}


@pytest.mark.parametrize("argv", [["worker"], ["router"], ["view", "show"], ["explain", "r-1"]])
def test_unset_servers_give_one_line_saying_what_to_do(no_stack_env, argv):
    res = CliRunner().invoke(app, argv, env=no_stack_env)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert "not configured" in res.output and "conductor dev up" in res.output


@pytest.mark.parametrize("argv", [["worker"], ["view", "show"], ["explain", "r-1"]])
def test_unreachable_servers_name_the_url(no_stack_env, argv):
    env = no_stack_env | {"CONDUCTOR_KAFKA_URL": "127.0.0.1:1", "CONDUCTOR_REDIS_URL": "redis://u:secret@127.0.0.1:1/0"}
    res = CliRunner().invoke(app, argv, env=env)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert "127.0.0.1:1" in res.output and "secret" not in res.output


def test_redacted_url_hides_only_the_password():
    assert redacted_url("rediss://app:pw@h:6380/1") == "rediss://app:***@h:6380/1"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
