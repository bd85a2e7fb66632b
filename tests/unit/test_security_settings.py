"""Kafka SASL/TLS and Redis ACL/TLS settings reach every client (config plumbing; the Redis
ACL path is also tested against the real Valkey in tests/integration/test_redis_acl.py)."""

from __future__ import annotations

import ssl
import subprocess

import pytest

from conductor.errors import ConfigError
from conductor.settings import load_settings, settings_env
from streams.app import broker_credentials
from streams.kafka import consumer, producer, security_options

BASE = {"kafka_url": "k:9092", "redis_url": "redis://r:6379/0"}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A test CA and a client certificate it signed (openssl, made for this session)."""
    d = tmp_path_factory.mktemp("certs")
    run = lambda *a: subprocess.run(a, cwd=d, check=True, capture_output=True)
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=conductor-test-ca")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr",
        "-subj", "/CN=conductor-client")
    run("openssl", "x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "client.pem", "-days", "1")
    return d


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
async def test_sasl_reaches_aiokafka_and_faust(mechanism, certs):
    s = load_settings(**BASE, kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism=mechanism,
                      kafka_sasl_username="conductor", kafka_sasl_password="s3cret-pw",
                      kafka_ssl_cafile=certs / "ca.pem", kafka_ssl_certfile=certs / "client.pem",
                      kafka_ssl_keyfile=certs / "client.key")
    opts = security_options(s.kafka())
    assert opts["security_protocol"] == "SASL_SSL" and opts["sasl_mechanism"] == mechanism
    assert opts["sasl_plain_username"] == "conductor" and opts["sasl_plain_password"] == "s3cret-pw"
    assert isinstance(opts["ssl_context"], ssl.SSLContext)
    prod, cons = producer(s.kafka()), consumer(s.kafka(), "t", group_id=None)
    for c in (prod.client, cons._client):  # never started: nothing connects
        assert (c._security_protocol, c._sasl_mechanism, c._sasl_plain_username) == ("SASL_SSL", mechanism, "conductor")
        assert c._ssl_context is not None
    await prod.stop()
    await cons.stop()
    cred = broker_credentials(s.kafka())
    assert (cred.protocol.value, cred.mechanism.value, cred.username) == ("SASL_SSL", mechanism, "conductor")
    assert "s3cret-pw" not in repr(s) and "s3cret-pw" not in repr(s.kafka())
    # a child process gets the real secret, not pydantic's mask
    assert settings_env(s)["CONDUCTOR_KAFKA_SASL_PASSWORD"] == "s3cret-pw"


def test_tls_only_and_plaintext(certs):
    s = load_settings(**BASE, kafka_security_protocol="SSL", kafka_ssl_cafile=certs / "ca.pem")
    assert security_options(s.kafka())["security_protocol"] == "SSL"
    assert broker_credentials(s.kafka()).protocol.value == "SSL"
    plain = load_settings(**BASE).kafka()
    assert security_options(plain) == {"security_protocol": "PLAINTEXT"} and broker_credentials(plain) is None


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"kafka_security_protocol": "SASL_PLAINTEXT"}, "kafka_sasl_username"),
        ({"kafka_ssl_cafile": "/no/such/ca.pem"}, "kafka_ssl_cafile"),
        ({"kafka_ssl_certfile": "/etc/hostname"}, "kafka_ssl_keyfile"),
        ({"kafka_sasl_mechanism": "MD5"}, "kafka_sasl_mechanism"),
    ],
)
def test_incomplete_security_fails_at_start_naming_the_field(fields, field):
    with pytest.raises(ConfigError) as e:
        load_settings(**BASE, **fields)
    assert field in str(e.value)


def test_redis_acl_user_and_password_go_into_the_connection_url():
    s = load_settings(**BASE, redis_username="router", redis_password="p@ss/word")
    assert s.redis_connection_url == "redis://router:p%40ss%2Fword@r:6379/0"
    assert s.redis_url == "redis://r:6379/0"  # what is shown and logged carries no password
    assert load_settings(**BASE).redis_connection_url == "redis://r:6379/0"
    s = load_settings(kafka_url="k:9092", redis_url="rediss://u:pw@r:6380/1", redis_password="other")
    assert s.redis_connection_url == "rediss://u:other@r:6380/1"
