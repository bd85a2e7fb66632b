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


def _demo_summary(stack_kept: bool) -> str:
    import io

    from rich.console import Console

    from conductor.harness.demo import _print_summary

    r = {"policy": "kvcache-centric", "baseline_policy": "round-robin", "requests": 3, "baseline_requests": 3,
         "rejected": 0, "baseline_rejected": 0, "reuse_ratio": 0.5, "baseline_reuse_ratio": 0.1,
         "ttft_p50_s": 1.0, "baseline_ttft_p50_s": 2.0, "ttft_p90_s": 1.5, "baseline_ttft_p90_s": 3.0,
         "tbt_p90_ms": 20.0, "baseline_tbt_p90_ms": 21.0, "ttft_prediction_error_p50": 0.3,
         "baseline_ttft_prediction_error_p50": 0.5, "wall_s": 24.0, "logs": "/tmp/logs", "stack_kept": stack_kept,
         "runs": [{"policy": "kvcache-centric", "topic_prefix": "demo-a.", "example_request_ids": ["r-1", "r-2"]},
                  {"policy": "round-robin", "topic_prefix": "demo-b.", "example_request_ids": ["r-3"]}]}
    out = io.StringIO()
    _print_summary(Console(file=out, width=200), r)
    return out.getvalue()


def test_demo_on_its_own_stack_suggests_no_explain_of_deleted_topics():
    text = _demo_summary(stack_kept=False)
    assert "conductor explain r-" not in text and "CONDUCTOR_TOPIC_PREFIX" not in text
    assert "conductor dev up" in text and "demo again" in text


def test_demo_on_a_kept_stack_prints_an_explain_line_per_example():
    text = _demo_summary(stack_kept=True)
    assert "CONDUCTOR_TOPIC_PREFIX=demo-a. conductor explain r-1" in text
    assert "CONDUCTOR_TOPIC_PREFIX=demo-a. conductor explain r-2" in text
    assert "CONDUCTOR_TOPIC_PREFIX=demo-b. conductor explain r-3" in text
    assert "conductor dev up" not in text
