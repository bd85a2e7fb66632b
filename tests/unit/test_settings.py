from __future__ import annotations

import pytest

from conductor.errors import ConfigError
from conductor.settings import load_settings


def test_defaults_are_embedded_and_loopback(monkeypatch):
    for k in ("CONDUCTOR_KAFKA_URL", "CONDUCTOR_REDIS_URL", "CONDUCTOR_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    s = load_settings()
    assert s.profile == "embedded"
    assert s.bind_host == "127.0.0.1"
    assert s.topic("kv-events") == "conductor.kv-events"


def test_real_kafka_url_means_production(monkeypatch):
    monkeypatch.setenv("CONDUCTOR_KAFKA_URL", "kafka-1:9092,kafka-2:9092")
    monkeypatch.delenv("CONDUCTOR_PROFILE", raising=False)
    assert load_settings().profile == "production"


@pytest.mark.parametrize(
    "env,value,field",
    [
        ("CONDUCTOR_PARTITIONS", "0", "partitions"),
        ("CONDUCTOR_BLOCK_SIZE", "sixteen", "block_size"),
        ("CONDUCTOR_REDIS_URL", "http://x", "redis_url"),
        ("CONDUCTOR_TOPIC_PREFIX", "bad prefix!", "topic_prefix"),
        ("CONDUCTOR_TTFT_SLO_S", "-1", "ttft_slo_s"),
        ("CONDUCTOR_PROFILE", "staging", "profile"),
        ("CONDUCTOR_NO_SUCH_SETTING", "1", "no_such_setting"),
    ],
)
def test_bad_value_names_the_field(monkeypatch, env, value, field):
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert field in str(exc.value)
    assert env in str(exc.value)


def _write_stack(d, pid):
    import json

    (d / "stack.json").write_text(json.dumps({
        "kafka_url": "127.0.0.1:19092", "redis_url": "redis://127.0.0.1:16379/0",
        "broker_pid": pid, "redis_pid": pid, "broker_bin": "x", "redis_bin": "y",
        "data_dir": str(d), "started_at": 0.0,
    }))


def test_unset_urls_come_from_the_running_dev_stack(monkeypatch, tmp_path):
    import os

    for k in ("CONDUCTOR_KAFKA_URL", "CONDUCTOR_REDIS_URL", "CONDUCTOR_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CONDUCTOR_DATA_DIR", str(tmp_path))
    _write_stack(tmp_path, os.getpid())  # a live pid stands in for the servers
    s = load_settings()
    assert (s.kafka_url, s.redis_url, s.profile) == ("127.0.0.1:19092", "redis://127.0.0.1:16379/0", "embedded")
    # what the environment (or a caller) names wins over the stack file
    monkeypatch.setenv("CONDUCTOR_REDIS_URL", "redis://elsewhere:6379/0")
    assert load_settings().redis_url == "redis://elsewhere:6379/0"
    assert load_settings(kafka_url=None).kafka_url is None


def test_a_stale_stack_file_is_ignored(monkeypatch, tmp_path):
    import subprocess

    for k in ("CONDUCTOR_KAFKA_URL", "CONDUCTOR_REDIS_URL", "CONDUCTOR_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CONDUCTOR_DATA_DIR", str(tmp_path))
    p = subprocess.Popen(["true"])
    p.wait()  # a pid that no longer runs
    _write_stack(tmp_path, p.pid)
    s = load_settings()
    assert s.kafka_url is None and s.redis_url is None


@pytest.mark.parametrize("bad", ["redis+cluster://", "redis+cluster://h:notaport", "redis+cluster://h:7000/3",
                                 "redis+cluster://h:70000", "redis+cluster://h:7000?x=1"])
def test_a_bad_cluster_url_fails_at_start_up_naming_the_field(bad):
    with pytest.raises(ConfigError, match="redis_url"):
        load_settings(redis_url=bad)


def test_a_cluster_url_takes_several_seeds_and_separate_credentials():
    from state.connect import cluster_seeds

    s = load_settings(redis_url="redis+cluster://u:pw@h1:7000,[::1]:7001,h3", redis_password="other")
    assert s.redis_connection_url == "redis+cluster://u:other@h1:7000,[::1]:7001,h3"
    assert cluster_seeds(s.redis_connection_url) == ([("h1", 7000), ("::1", 7001), ("h3", 6379)], "u", "other")
