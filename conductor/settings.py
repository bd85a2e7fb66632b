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

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from conductor.errors import ConfigError
from conductor.topology import Topology, load_topology
from state.connect import RedisConnection, cluster_seeds, is_cluster_url
from streams.config import KafkaConnection, Profile, SaslMechanism, SecurityProtocol, WorkerConfig
from streams.topics import TopicConfig

HARNESS_VARIABLES = frozenset({"vllm_kit"})
"""``CONDUCTOR_*`` variables that only the harness reads (``conductor.harness.settings.HarnessSettings``):
accepted here, left to it, and passed on to child processes as they are."""


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
        default=None,
        description="Redis URL (redis://host:port/db), or a Redis Cluster by its seed nodes "
        "(redis+cluster://host:port[,host:port]); unset = the embedded server",
    )
    profile: Profile | None = Field(
        default=None,
        description="'embedded' (Tansu work-arounds) or 'production' (Kafka's safe defaults); "
        "default: embedded when kafka_url is unset",
    )
    data_dir: Path = Field(default=Path(".conductor"), description="embedded servers' data and pid files")
    bind_host: str = Field(default="127.0.0.1", description="address every Conductor server binds to")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus port; 0 = no endpoint")
    web_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="`conductor worker`'s Faust web port on bind_host; unset = 6066, or the next free port when "
        "another worker on the host holds it; set = that port or a one-line error",
    )

    # --- security on every connection ---------------------------------------
    kafka_security_protocol: SecurityProtocol = Field(
        default="PLAINTEXT", description="how every Kafka client (aiokafka and Faust) connects"
    )
    kafka_sasl_mechanism: SaslMechanism = "PLAIN"
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: Path | None = Field(default=None, description="CA bundle that signed the brokers' certificates")
    kafka_ssl_certfile: Path | None = Field(default=None, description="client certificate (mutual TLS)")
    kafka_ssl_keyfile: Path | None = Field(default=None, description="its private key")
    redis_username: str | None = Field(default=None, description="Redis ACL user (else the URL's, else default)")
    redis_password: SecretStr | None = Field(default=None, description="its password (else the URL's)")
    redis_ssl_ca_certs: Path | None = Field(default=None, description="CA bundle for a rediss:// server")

    # --- the admin API and console ------------------------------------------
    admin_port: int = Field(default=8088, ge=0, le=65535, description="`conductor admin` port on bind_host")
    admin_token: SecretStr | None = Field(
        default=None, description="bearer token of the admin scope (reads and control changes)"
    )
    read_token: SecretStr | None = Field(default=None, description="bearer token of the read-only scope")
    admin_login_max_failures: int = Field(
        default=5, ge=0,
        description="failed console sign-ins (POST /login) from one address within admin_login_window_s after "
        "which it is answered 429 until the window passes; 0 = no limit",
    )
    admin_login_window_s: float = Field(default=300.0, gt=0, description="the window of admin_login_max_failures")

    # --- the gateway's API keys ----------------------------------------------
    gateway_api_key: SecretStr | None = Field(
        default=None,
        description="one API key clients send as `Authorization: Bearer <key>` (named `default`, the default "
        "bounds: no SLO looser than ttft_slo_s/tbt_slo_ms, priority at most 0, no rate limit)",
    )
    gateway_api_keys_file: Path | None = Field(
        default=None,
        description="a JSON file of API keys, each with its own limits and SLO bounds (conductor/gateway/auth.py, "
        "docs/configuration.md); read and checked at the gateway's start",
    )

    # --- topics -----------------------------------------------------------
    topic_prefix: str = Field(default="conductor.", pattern=r"^[A-Za-z0-9._-]{0,100}$")
    partitions: int = Field(default=4, ge=1, le=1024)
    replication_factor: int = Field(default=1, ge=1, le=16)
    kv_events_retention_ms: int = Field(
        default=7 * 86_400_000, ge=-1,
        description="retention of kv-events (time-based, never compacted; -1 = forever): a rebuild needs every "
        "event since each node's epoch began, so keep it longer than any engine runs without a restart",
    )
    heartbeats_retention_ms: int = Field(default=86_400_000, ge=-1, description="retention of heartbeats (-1 = forever)")
    audit_retention_ms: int = Field(
        default=30 * 86_400_000, ge=-1,
        description="retention of requests and dispatch, which `conductor explain` audits (-1 = forever)",
    )
    decision_index_ttl_s: float = Field(
        default=3_600.0, ge=0,
        description="how long the routers' decision index keeps where each decision and its request sit on the "
        "log (Redis, ~100 bytes a decision), so `conductor explain` finds them without a scan; 0 = no index; "
        "never longer than audit_retention_ms",
    )
    decision_index_url: str | None = Field(
        default=None,
        description="a Redis of its own for the decision index (redis://, rediss:// or unix://; same user and "
        "password settings as redis_url); unset = the view's Redis",
    )
    decision_index_memory_alert_bytes: int = Field(
        default=1 << 30, ge=0,
        description="the routers log a warning (each minute, at most) when the used memory of the decision "
        "index's Redis (INFO memory, also the gauge conductor_decision_index_redis_bytes) passes this; 0 = none",
    )
    admin_explain_max_records: int = Field(
        default=2_000_000, ge=1,
        description="most log records one explain through the admin API may read (kv-events from the start, "
        "heartbeats, dispatch and requests around the decision's time); beyond it the explain is refused",
    )

    # --- the view ---------------------------------------------------------
    block_size: int = Field(default=16, ge=1, le=4096, description="tokens per KV block")
    heartbeat_ttl_s: float = Field(default=5.0, gt=0, description="a node silent longer is not live")
    view_namespace: str = Field(default="cv", pattern=r"^[A-Za-z0-9:_-]{1,32}$")
    view_reader: Literal["raw", "tracking"] = Field(
        default="raw",
        description="how routers read the view: raw (one round trip per decision) or tracking (block entries and "
        "node states cached in process, kept current by Redis's CLIENT TRACKING pushes; a request whose chain "
        "is all cached is decided with no round trip; state/README.md, \"Client-side caching\")",
    )
    view_cache_keys: int = Field(default=200_000, ge=1, description="block entries a tracking reader keeps")

    # --- routing ----------------------------------------------------------
    ttft_slo_s: float = Field(default=30.0, gt=0)
    tbt_slo_ms: float = Field(default=100.0, gt=0)
    policy: str = Field(default="kvcache-centric", min_length=1)
    policy_params: dict[str, Any] = Field(default_factory=dict)
    model_profile: str = Field(default="llama3-70b-a800x8")
    fit_min_interval_s: float = Field(
        default=600.0, ge=0,
        description="`conductor fit` publishes no profile sooner than this after the last set_profile "
        "(conductor/costmodel/guard.py)",
    )
    fit_min_gain: float = Field(
        default=0.05, ge=0, lt=1,
        description="a fit is published only when its out-of-sample p90 TTFT error on the window is this much "
        "(relative) below the profile in force's on the same requests, its p50 no higher",
    )
    fit_revert_watch_s: float = Field(
        default=300.0, ge=0, description="how long `conductor fit` watches the rejections after a set_profile"
    )
    fit_revert_min_requests: int = Field(
        default=20, ge=1, description="requests after a set_profile before its rejections are judged"
    )
    fit_revert_rejection_jump: float = Field(
        default=0.25, ge=0, le=1,
        description="`conductor fit` reverts a set_profile (to the profile before it, logged at ERROR, counted in "
        "conductor_fit_reverts) when the share of requests rejected by early rejection after it exceeds the "
        "share before by this much; 0 = never",
    )
    seed: int = Field(default=0, ge=0, description="base seed of the routing tie-breaks")
    reservation_ttl_s: float = Field(default=10.0, gt=0)
    pending_ttl_s: float = Field(
        default=5.0, gt=0,
        description="how long a decision's placed blocks count as reusable on its instances before the engine's "
        "KV events confirm them (sooner if they do, or if the request fails; state/pending.py)",
    )
    pending_lru_blocks: int = Field(
        default=16_384, ge=0,
        description="blocks remembered per instance that publishes no KV events, least recently placed "
        "forgotten first, when its KV cache size is not known (state/pending.py)",
    )
    inflight_lease_s: float = Field(
        default=60.0, gt=0,
        description="a request charged to the in-flight ledger and never released (its gateway died) stops "
        "counting this long after its last news (state/inflight.py); a request that runs longer is then "
        "counted by its engine's heartbeat alone (the picture takes the larger of the two)",
    )
    inflight_lost_after_s: float = Field(
        default=10.0, gt=0,
        description="a gateway or picker silent this long on the in-flight log while its charges are open has "
        "died: the first other one to notice ends its charges (with a request_outcome, error gateway_lost) "
        "instead of waiting out inflight_lease_s; each producer with open charges says it is alive every fifth "
        "of this (state/shared_log.py, RedisInflight)",
    )
    max_snapshot_age_s: float = Field(default=5.0, gt=0)
    router_concurrency: int = Field(
        default=2, ge=1, le=64, description="view reads a router keeps in flight (pipelined on one connection)"
    )
    embedded_fetch_wait_ms: int = Field(
        default=5, ge=1, le=500,
        description="embedded profile: how long the broker holds a router's fetch of requests and a gateway's "
        "fetch of its replies (Tansu answers only when the wait runs out); lower = faster decisions, more "
        "CPU while idle (conductor/gateway/README.md)",
    )
    topology_file: Path | None = Field(
        default=None,
        description="cluster topology (JSON: racks, zones, per-link bandwidth/latency, RDMA or TCP; "
        "docs/topology.md); unset = the model profile's two link speeds",
    )
    balance_params: dict[str, Any] = Field(
        default_factory=dict, description="KVCache balance scheduler parameters (conductor balance --help)"
    )

    # --- the gateway's calls to the engines, by phase (conductor/gateway/README.md) ----------
    gateway_connect_timeout_s: float = Field(
        default=2.0, gt=0, description="to open a connection to an engine; a failure is routed again elsewhere"
    )
    gateway_first_byte_timeout_s: float = Field(
        default=120.0, ge=0,
        description="to an engine's first byte: a streamed call's response headers (sent when the engine takes "
        "the request), a prefill half's answer (queue + prefill); a non-streamed generation has no first byte "
        "before its last token and is bounded by the total only; 0 = no limit",
    )
    gateway_idle_timeout_s: float = Field(
        default=300.0, ge=0,
        description="between two reads of an engine's answer once it started (a stream's chunks, its first chunk "
        "after the headers); 0 = no limit",
    )
    gateway_total_timeout_s: float = Field(
        default=0.0, ge=0,
        description="a whole request, from its arrival to its last byte; 0 = no limit (a long generation is never "
        "cut)",
    )

    # --- the gateway's backpressure (conductor/gateway/README.md) ------------------------------
    gateway_max_in_flight: int = Field(
        default=1024, ge=0,
        description="client requests one gateway process serves at once (a stream counts until it ends); "
        "beyond it a request is answered 429 gateway_busy with Retry-After at once, never queued or failed; "
        "0 = no limit",
    )
    gateway_max_deciding: int = Field(
        default=16, ge=0,
        description="requests one gateway process decides at once (the view's reads, the log's acknowledgements); "
        "beyond it a request is answered 429 gateway_busy with Retry-After at once instead of waiting into the "
        "decision timeout (503); 0 = no limit",
    )
    gateway_max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1,
        description="the longest request body a gateway reads; a longer Content-Length, or a body that grows "
        "past it as it is read, is answered 413 body_too_large (as conductor epp's --max-body-bytes)",
    )
    gateway_engine_max_in_flight: int = Field(
        default=256, ge=0,
        description="requests one gateway has open on one engine (prefill or decode) at once; a decision naming "
        "an engine at its bound is answered 429 engine_busy with Retry-After; 0 = no limit",
    )
    gateway_drain_s: float = Field(
        default=50.0, ge=0,
        description="on SIGTERM, how long a gateway lets the requests in flight finish (readiness 503 and new "
        "requests 503 draining meanwhile) before it cuts the streams still open with an SSE error event "
        "(gateway_shutdown); the manifests' terminationGracePeriodSeconds (60) less their preStop sleep (5), less "
        "5 s to close its clients",
    )
    gateway_log_failures_to_trip: int = Field(
        default=3, ge=1,
        description="colocated routing: after this many decisions in a row that the broker did not acknowledge, "
        "the gateway's /health answers 503 log_unavailable and new requests are refused at once instead of each "
        "waiting the decision timeout; one acknowledged decision (a trial let through every second) clears it",
    )

    # --- the endpoint picker (conductor/epp/README.md) ---------------------------------------
    epp_trust_bounds_header: bool = Field(
        default=False,
        description="conductor epp: widen a request's SLO and priority bounds (default: ttft_slo_s, tbt_slo_ms, "
        "priority 0) by the x-conductor-trusted-bounds header; only where the proxy in front removes a client's "
        "own copy of it before ext_proc (deploy/kubernetes/README.md)",
    )

    @field_validator("kafka_url", "redis_url", "decision_index_url")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            return None
        return v

    @field_validator("admin_token", "read_token", "gateway_api_key")
    @classmethod
    def _token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None or not v.get_secret_value().strip():
            return None
        if len(v.get_secret_value()) < 16:
            raise ValueError("a token must be at least 16 characters")
        return v

    @field_validator("redis_url", "decision_index_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if is_cluster_url(v):
            cluster_seeds(v)  # its ValueError names what is wrong
            return v
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss://, unix:// or (a Redis Cluster) redis+cluster://")
        return v

    @field_validator("model_profile")
    @classmethod
    def _profile_file(cls, v: str) -> str:
        # A path (a file `conductor profile calibrate` or `profile fit` wrote) must hold a JSON
        # object; its fields are checked where it is loaded (conductor.costmodel.profiles.load_profile).
        if v.endswith(".json") or os.sep in v:
            try:
                data = json.loads(Path(v).read_text())
            except OSError as e:
                raise ValueError(f"cannot read the profile file {v}: {e.strerror or e}") from None
            except ValueError as e:
                raise ValueError(f"the profile file {v} is not JSON: {e}") from None
            if not isinstance(data, dict):
                raise ValueError(f"the profile file {v} holds no JSON object")
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
    def _security_complete(self) -> Settings:
        if self.kafka_security_protocol.startswith("SASL_") and not (
            self.kafka_sasl_username and self.kafka_sasl_password
        ):
            raise ValueError("kafka_security_protocol SASL_* needs kafka_sasl_username and kafka_sasl_password")
        if (self.kafka_ssl_certfile is None) != (self.kafka_ssl_keyfile is None):
            raise ValueError("kafka_ssl_certfile and kafka_ssl_keyfile go together")
        for name in ("kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile", "redis_ssl_ca_certs",
                     "gateway_api_keys_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")
        return self

    @model_validator(mode="after")
    def _default_profile(self) -> Settings:
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

    @property
    def redis_connection_url(self) -> str | None:
        """``redis_url`` with ``redis_username`` / ``redis_password`` put in, when set apart from it.
        Carries the password: never log it (``conductor.cli.common.redacted_url``)."""
        return None if self.redis_url is None else self.redis().connection_url()

    # --- what the lower layers are given ------------------------------------
    def kafka(self) -> KafkaConnection:
        """How every Kafka client connects (``streams``)."""
        return KafkaConnection(
            bootstrap_servers=self.kafka_url,
            profile="embedded" if self.embedded else "production",
            security_protocol=self.kafka_security_protocol,
            sasl_mechanism=self.kafka_sasl_mechanism,
            sasl_username=self.kafka_sasl_username,
            sasl_password=self.kafka_sasl_password,
            ssl_cafile=self.kafka_ssl_cafile,
            ssl_certfile=self.kafka_ssl_certfile,
            ssl_keyfile=self.kafka_ssl_keyfile,
        )

    def redis(self) -> RedisConnection:
        """How every Redis client of the view connects (``state``)."""
        return RedisConnection(self.redis_url, self.redis_username, self.redis_password, self.redis_ssl_ca_certs)

    def topic_config(self) -> TopicConfig:
        """The topics' names, partitions, replication and retention (``streams.topics.topics``)."""
        return TopicConfig(
            prefix=self.topic_prefix,
            partitions=self.partitions,
            replication_factor=self.replication_factor,
            kv_events_retention_ms=self.kv_events_retention_ms,
            heartbeats_retention_ms=self.heartbeats_retention_ms,
            audit_retention_ms=self.audit_retention_ms,
        )

    def worker(self) -> WorkerConfig:
        """A Faust app's configuration (``streams.app.make_app``, ``streams.agents.build_worker``)."""
        return WorkerConfig(
            kafka=self.kafka(),
            topics=self.topic_config(),
            data_dir=self.data_dir,
            bind_host=self.bind_host,
            web_port=self.web_port,
            heartbeat_ttl_s=self.heartbeat_ttl_s,
        )


SECRET_FIELDS = frozenset({"admin_token", "read_token", "gateway_api_key", "kafka_sasl_password", "redis_password",
                           "redis_url", "decision_index_url"})
"""Never echoed, not even in a configuration error."""

STACK_FILE = "stack.json"
"""What `conductor dev up` writes in the data directory (conductor.harness.devstack)."""


def running_stack(data_dir: Path) -> dict[str, Any] | None:
    """The URLs of the embedded stack `conductor dev up` started in ``data_dir``, if both of its
    processes still run; ``None`` otherwise (no file, a stale one, or an unreadable one)."""
    try:
        st = json.loads((data_dir / STACK_FILE).read_text())
        pids = (int(st["broker_pid"]), int(st["redis_pid"]))
        urls = {"kafka_url": str(st["kafka_url"]), "redis_url": str(st["redis_url"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, someone else's: the URLs may still answer
    return urls


def load_settings(**overrides: Any) -> Settings:
    """Build and validate the settings; a bad value raises :class:`ConfigError` naming the field.

    When ``kafka_url`` or ``redis_url`` is unset and `conductor dev up` runs a stack in
    ``data_dir``, the missing URL is taken from it (and the profile stays ``embedded``
    unless set), so every command finds the running embedded stack by itself."""
    s = _build_settings(**overrides)
    if s.kafka_url and s.redis_url:
        return s
    found = running_stack(s.data_dir)
    if found is None:
        return s
    update: dict[str, Any] = {k: v for k, v in found.items() if getattr(s, k) is None and k not in overrides}
    if not update:
        return s
    if "kafka_url" in update and "profile" not in overrides and not _env_sets("profile"):
        update["profile"] = "embedded"
    return s.model_copy(update=update)


def _env_sets(field: str) -> bool:
    return f"CONDUCTOR_{field.upper()}" in os.environ


def _build_settings(**overrides: Any) -> Settings:
    lines = []
    for name in sorted(os.environ):
        if name.startswith("CONDUCTOR_"):
            field = name[len("CONDUCTOR_"):].lower().split("__", 1)[0]
            if field not in Settings.model_fields and field not in HARNESS_VARIABLES:
                lines.append(f"{field} ({name}): not a Conductor setting (a typo?)")
    if lines:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))
    try:
        return Settings(**overrides)
    except ValidationError as e:
        for err in e.errors():
            field = ".".join(str(p) for p in err.get("loc", ())) or "settings"
            env = "CONDUCTOR_" + field.upper().replace(".", "__")
            got = "hidden" if field in SECRET_FIELDS else repr(err.get("input"))
            lines.append(f"{field} ({env}): {err.get('msg')} (got {got})")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def settings_env(settings: Settings) -> dict[str, str]:
    """The CONDUCTOR_* variables that make a child process load exactly ``settings``."""
    env = {}
    for name in type(settings).model_fields:
        v = getattr(settings, name)
        if v is None:
            continue
        if isinstance(v, SecretStr):
            v = v.get_secret_value()
        env[f"CONDUCTOR_{name.upper()}"] = json.dumps(v) if isinstance(v, (dict, list, bool)) else str(v)
    return env


def inherited_environment(drop: Callable[[str], bool]) -> dict[str, str]:
    """This process's environment (PATH, ...) for a child, less the variables ``drop`` names.
    The one place besides :func:`load_settings` that reads the environment."""
    return {k: v for k, v in os.environ.items() if not drop(k)}


def child_environment(settings: Settings) -> dict[str, str]:
    """The environment of a Conductor child process: this one's (PATH, ...) without any
    CONDUCTOR_* variable but the harness's, plus exactly ``settings``."""
    env = inherited_environment(
        lambda k: k.startswith("CONDUCTOR_") and k[len("CONDUCTOR_"):].lower() not in HARNESS_VARIABLES)
    env.update(settings_env(settings))
    env["PYTHONUNBUFFERED"] = "1"
    return env
