"""What the stream layer is configured with: small frozen values, built by ``conductor.settings``.

The layer reads nothing else of the configuration: :class:`KafkaConnection` says how every
Kafka client (aiokafka and Faust) connects, :class:`streams.topics.TopicConfig` how the topics
are laid out, :class:`WorkerConfig` what a Faust app adds to both. Importing this module
loads no Kafka client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import SecretStr

from .topics import TopicConfig

Profile = Literal["embedded", "production"]
"""``embedded``: the Tansu broker's work-arounds; ``production``: Kafka's safe defaults."""
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


@dataclass(frozen=True, slots=True)
class KafkaConnection:
    """Where the brokers are and how to log in to them."""

    bootstrap_servers: str | None
    """``host:port[,host:port]``; ``None`` when not configured (a client then refuses to start)."""
    profile: Profile
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism = "PLAIN"
    sasl_username: str | None = None
    sasl_password: SecretStr | None = field(default=None, repr=False)
    ssl_cafile: Path | None = None
    """CA bundle that signed the brokers' certificates (else the system's CAs)."""
    ssl_certfile: Path | None = None
    """Client certificate (mutual TLS), with :attr:`ssl_keyfile`."""
    ssl_keyfile: Path | None = None

    def __post_init__(self) -> None:
        if self.sasl and not (self.sasl_username and self.sasl_password):
            raise ValueError(f"security protocol {self.security_protocol} needs a SASL username and password")

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A Faust app's configuration (the stream worker's, the balance worker's)."""

    kafka: KafkaConnection
    topics: TopicConfig
    data_dir: Path
    """Faust's data directory goes under ``data_dir/faust``."""
    bind_host: str = "127.0.0.1"
    web_port: int | None = None
    """Faust's web port on ``bind_host``; ``None``: the first free one from 6066 up."""
    heartbeat_ttl_s: float = 5.0
    """A node silent longer is not live (the ingest metrics' live-node gauge)."""
