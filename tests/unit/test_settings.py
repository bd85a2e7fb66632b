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
