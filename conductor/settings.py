"""Conductor's one settings object.

Built once at start-up from ``CONDUCTOR_*`` environment variables (nested fields
use ``__``, e.g. ``CONDUCTOR_POLICY_PARAMS='{"alpha": 0.5}'``), validated, and
passed down. Nothing else in Conductor reads the environment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from conductor.errors import ConfigError
from conductor.topology import Topology, load_topology

Profile = Literal["embedded", "production"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CONDUCTOR_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    # --- where things are -------------------------------------------------
    kafka_url: str | None = Field(
        default=None,
        description="Kafka bootstrap servers (host:port[,host:port]); unset = the embedded broker",
    )
    redis_url: str | None = Field(
        default=None, description="Redis URL (redis://host:port/db); unset = the embedded server"
    )
    profile: Profile | None = Field(
        default=None,
        description="'embedded' (Tansu work-arounds) or 'production' (Kafka's safe defaults); "
        "default: embedded when kafka_url is unset",
    )
    data_dir: Path = Field(default=Path(".conductor"), description="embedded servers' data and pid files")
    bind_host: str = Field(default="127.0.0.1", description="address every Conductor server binds to")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus port; 0 = no endpoint")
    web_port: int = Field(default=6066, ge=1, le=65535, description="Faust web port (bound on bind_host)")

    # --- topics -----------------------------------------------------------
    topic_prefix: str = Field(default="conductor.", pattern=r"^[A-Za-z0-9._-]{0,100}$")
    partitions: int = Field(default=4, ge=1, le=1024)
    replication_factor: int = Field(default=1, ge=1, le=16)

    # --- the view ---------------------------------------------------------
    block_size: int = Field(default=16, ge=1, le=4096, description="tokens per KV block")
    heartbeat_ttl_s: float = Field(default=5.0, gt=0, description="a node silent longer is not live")
    view_namespace: str = Field(default="cv", pattern=r"^[A-Za-z0-9:_-]{1,32}$")

    # --- routing ----------------------------------------------------------
    ttft_slo_s: float = Field(default=30.0, gt=0)
    tbt_slo_ms: float = Field(default=100.0, gt=0)
    policy: str = Field(default="kvcache-centric", min_length=1)
    policy_params: dict[str, Any] = Field(default_factory=dict)
    model_profile: str = Field(default="llama3-70b-a800x8")
    seed: int = Field(default=0, ge=0, description="base seed of the routing tie-breaks")
    reservation_ttl_s: float = Field(default=10.0, gt=0)
    max_snapshot_age_s: float = Field(default=5.0, gt=0)
    router_concurrency: int = Field(
        default=2, ge=1, le=64, description="view reads a router keeps in flight (pipelined on one connection)"
    )
    topology_file: Path | None = Field(
        default=None,
        description="cluster topology (JSON: racks, zones, per-link bandwidth/latency, RDMA or TCP; "
        "docs/topology.md); unset = the model profile's two link speeds",
    )
    balance_params: dict[str, Any] = Field(
        default_factory=dict, description="KVCache balance scheduler parameters (conductor balance --help)"
    )

    @field_validator("kafka_url", "redis_url")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            return None
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

    @field_validator("topology_file")
    @classmethod
    def _topology_loads(cls, v: Path | None) -> Path | None:
        if v is not None:
            try:
                load_topology(v)
            except ConfigError as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _default_profile(self) -> "Settings":
        if self.profile is None:
            object.__setattr__(self, "profile", "embedded" if self.kafka_url is None else "production")
        return self

    # --- derived ----------------------------------------------------------
    @property
    def embedded(self) -> bool:
        return self.profile == "embedded"

    def cluster_topology(self) -> Topology | None:
        """The topology ``topology_file`` names (read now; validated at start-up), or None."""
        return None if self.topology_file is None else load_topology(self.topology_file)

    def topic(self, name: str) -> str:
        return f"{self.topic_prefix}{name}"


def load_settings(**overrides: Any) -> Settings:
    """Build and validate the settings; a bad value raises :class:`ConfigError` naming the field."""
    lines = []
    for name in sorted(os.environ):
        if name.startswith("CONDUCTOR_"):
            field = name[len("CONDUCTOR_"):].lower().split("__", 1)[0]
            if field not in Settings.model_fields:
                lines.append(f"{field} ({name}): not a Conductor setting (a typo?)")
    if lines:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))
    try:
        return Settings(**overrides)
    except ValidationError as e:
        for err in e.errors():
            field = ".".join(str(p) for p in err.get("loc", ())) or "settings"
            env = "CONDUCTOR_" + field.upper().replace(".", "__")
            lines.append(f"{field} ({env}): {err.get('msg')} (got {err.get('input')!r})")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def settings_env(settings: Settings) -> dict[str, str]:
    """The CONDUCTOR_* variables that make a child process load exactly ``settings``."""
    env = {}
    for name in type(settings).model_fields:
        v = getattr(settings, name)
        if v is None:
            continue
        env[f"CONDUCTOR_{name.upper()}"] = json.dumps(v) if isinstance(v, (dict, list, bool)) else str(v)
    return env


def inherited_environment(drop: Callable[[str], bool]) -> dict[str, str]:
    """This process's environment (PATH, ...) for a child, less the variables ``drop`` names.
    The one place besides :func:`load_settings` that reads the environment."""
    return {k: v for k, v in os.environ.items() if not drop(k)}


def child_environment(settings: Settings) -> dict[str, str]:
    """The environment of a Conductor child process: this one's (PATH, ...) without any
    CONDUCTOR_* variable, plus exactly ``settings``."""
    env = inherited_environment(lambda k: k.startswith("CONDUCTOR_"))
    env.update(settings_env(settings))
    env["PYTHONUNBUFFERED"] = "1"
    return env
