"""aiokafka clients configured for a :class:`streams.config.KafkaConnection` and its profile.

The ``embedded`` profile carries the work-arounds the Tansu broker needs (no
idempotent producer, no trustworthy "latest" offset, slow group joins with the
default timeouts); ``production`` keeps Kafka's safe defaults. :func:`end_offsets`
finds where a partition really ends on either broker. No correctness
rests on either: the view is protected by our own offset-fenced writes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.helpers import create_ssl_context

from schemas.records import MAX_BLOCKS

from .config import KafkaConnection
from .topics import Topic

log = logging.getLogger(__name__)


def _bootstrap(kafka: KafkaConnection) -> str:
    if not kafka.bootstrap_servers:
        raise ValueError("kafka_url is not set (start the embedded stack with `conductor dev up`)")
    return kafka.bootstrap_servers


def security_options(kafka: KafkaConnection) -> dict[str, Any]:
    """The SASL (PLAIN, SCRAM-SHA-256/512) and TLS options of every aiokafka client."""
    opts: dict[str, Any] = {"security_protocol": kafka.security_protocol}
    if kafka.tls:
        opts["ssl_context"] = ssl_context(kafka)
    if kafka.sasl and kafka.sasl_password is not None:  # (a SASL connection has one: KafkaConnection checks)
        opts.update(
            sasl_mechanism=kafka.sasl_mechanism,
            sasl_plain_username=kafka.sasl_username,
            sasl_plain_password=kafka.sasl_password.get_secret_value(),
        )
    return opts


def ssl_context(kafka: KafkaConnection) -> ssl.SSLContext:
    """A TLS context verifying the brokers against ``ssl_cafile`` (else the system CAs),
    presenting the client certificate when one is configured."""
    ctx: ssl.SSLContext = create_ssl_context(
        cafile=_str(kafka.ssl_cafile), certfile=_str(kafka.ssl_certfile), keyfile=_str(kafka.ssl_keyfile)
    )
    return ctx


def _str(p: Path | None) -> str | None:
    return None if p is None else str(p)


def producer(kafka: KafkaConnection, **overrides: Any) -> AIOKafkaProducer:
    opts: dict[str, Any] = dict(bootstrap_servers=_bootstrap(kafka), linger_ms=2, max_batch_size=1 << 20,
                                **security_options(kafka))
    if kafka.profile == "production":
        opts.update(acks="all", enable_idempotence=True)
    else:
        opts.update(acks=1, enable_idempotence=False)  # Tansu refuses InitProducerId
    opts.update(overrides)
    return AIOKafkaProducer(**opts)


EMBEDDED_HEARTBEAT_MS = 1000
"""A consumer group member's heartbeat interval on the embedded broker (its session timeout: 6 s)."""


def consumer(kafka: KafkaConnection, *topic_names: str, group_id: str | None, **overrides: Any) -> AIOKafkaConsumer:
    opts: dict[str, Any] = dict(
        bootstrap_servers=_bootstrap(kafka),
        group_id=group_id,
        enable_auto_commit=False,
        # Tansu's "latest" is wrong, and a new group must see every record anyway.
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=8 << 20,
        fetch_max_bytes=32 << 20,
        **security_options(kafka),
    )
    if kafka.profile == "embedded":
        # Tansu holds a join for half the session timeout: keep it short. A member that dies is
        # found out after the session timeout whatever the heartbeat; a heartbeat a second (a sixth
        # of it) is how soon the others hear of a rebalance (a member joining or leaving: up to
        # 0.5 s later than at 0.5 s) and halves what an idle group costs the broker.
        opts.update(session_timeout_ms=6000, heartbeat_interval_ms=EMBEDDED_HEARTBEAT_MS, rebalance_timeout_ms=4000)
    opts.update(overrides)
    return AIOKafkaConsumer(*topic_names, **opts)


def set_fetch_wait(c: AIOKafkaConsumer, wait_ms: int | None) -> None:
    """Change how long ``c``'s next fetches ask the broker to hold them (``fetch_max_wait_ms``),
    from the next fetch on. aiokafka reads the value per fetch but offers no setter: a consumer
    without the attribute is left as it is."""
    fetcher = getattr(c, "_fetcher", None)
    if wait_ms is not None and fetcher is not None and hasattr(fetcher, "_fetch_max_wait_ms"):
        fetcher._fetch_max_wait_ms = wait_ms


IDLE_AFTER_S = 2.0
"""A consumer with a short fetch wait that got no record for this long waits longer per fetch."""
IDLE_FETCH_WAIT_MS = 100
"""Its wait per fetch then."""
DEEP_IDLE_AFTER_S = 10.0
"""After this long without a record it waits longer still..."""
DEEP_IDLE_FETCH_WAIT_MS = 500
"""...this long per fetch (Kafka's own default fetch wait)."""


TRICKLE_RECORDS_PER_FETCH = 0.5
"""What a trickle-paced consumer (:class:`FetchPace` with ``trickle_max_ms``) wants a fetch to
bring on average: fewer, and most fetches are empty spins; more, and records wait longer."""
TRICKLE_WINDOW_S = 1.0
"""The span over which such a consumer counts its records' rate."""


KAFKA_FETCH_WAIT_MS = 500
"""aiokafka's (and Kafka's) default fetch wait."""
QUIET_FETCH_WAIT_MS = 1000
"""The fetch wait of a follower nobody waits on (``control``, ``kv-commands``) after
:data:`DEEP_IDLE_AFTER_S` without a record (:data:`QUIET_STEPS`)."""
QUIET_STEPS = ((DEEP_IDLE_AFTER_S, QUIET_FETCH_WAIT_MS),)
"""The :class:`FetchPace` steps of such a follower, from :data:`KAFKA_FETCH_WAIT_MS`: after 10 s
without a record, one fetch a second on the embedded broker instead of two; a record after such a
spell waits up to ~500 ms there instead of ~250 ms (Tansu looks half-way), never longer on Kafka
(which answers as soon as a record is there)."""


class FetchPace:
    """The fetch wait of a consumer that asks for a short one: ``short_ms`` while records come,
    then longer the longer nothing comes (``steps``: after so many seconds without a record, so
    many milliseconds; by default :data:`IDLE_FETCH_WAIT_MS` after :data:`IDLE_AFTER_S` and
    :data:`DEEP_IDLE_FETCH_WAIT_MS` after :data:`DEEP_IDLE_AFTER_S`), short again with the first
    record.

    The embedded broker answers a fetch only when its wait runs out, so a short wait is a
    fetch every few milliseconds whether or not anything is written: both the broker and the
    consumer spin (each fetch costs the embedded broker ~0.5 ms of CPU). Once quiet, a consumer
    fetches ten, then two times a second; the first record after a quiet spell waits up to
    ~100 ms, after a long one up to ~250 ms longer on the embedded broker (it looks again
    half-way through a wait of 250 ms or more); on Kafka, which answers as soon as a record is
    there, no longer. Steps at or below ``short_ms`` are left out.

    ``trickle_max_ms``: while records come, but fewer than one per two short waits (a cluster's
    few requests a second, a KV event now and then), most short fetches bring nothing and
    only cost: the wait then follows the rate, long enough for :data:`TRICKLE_RECORDS_PER_FETCH`
    records a fetch, at most ``trickle_max_ms`` (the rate counted over the last
    :data:`TRICKLE_WINDOW_S`; callers pass each fetch's record count). A record of a trickle
    waits up to that much longer on the embedded broker; at a rate of ``1 /
    (2 x short_ms)`` or more the wait is ``short_ms`` as without it. The first record after a
    quiet spell brings the short wait back (a burst's next records may follow at once); it grows
    again as the trickle shows itself."""

    def __init__(self, short_ms: int, *, steps: Sequence[tuple[float, int]] | None = None,
                 clock: Callable[[], float] = time.monotonic, trickle_max_ms: int | None = None) -> None:
        if steps is None:
            steps = ((IDLE_AFTER_S, IDLE_FETCH_WAIT_MS), (DEEP_IDLE_AFTER_S, DEEP_IDLE_FETCH_WAIT_MS))
        self.short_ms = short_ms
        self.steps = tuple(sorted((after_s, ms) for after_s, ms in steps if ms > short_ms))
        self.wait_ms = short_ms
        """The wait the consumer asks for now."""
        self.trickle_max_ms = trickle_max_ms if trickle_max_ms is not None and trickle_max_ms > short_ms else None
        self._clock = clock
        self._last_record_s = clock()
        self._since_s = self._last_record_s
        """When the rate's window began (the first record after a quiet spell, at most
        :data:`TRICKLE_WINDOW_S` ago)."""
        self._arrivals: deque[tuple[float, int]] = deque()
        """(when, records) of the fetches in the rate's window that brought records."""

    @property
    def paced(self) -> bool:
        """Whether this pace ever changes the wait (some step longer than ``short_ms``)."""
        return bool(self.steps)

    @property
    def idle(self) -> bool:
        return self.wait_ms != self.short_ms

    def saw(self, got_records: bool, count: int = 1, busy_at: float = 0.0) -> int | None:
        """After a fetch: the wait the next fetches should ask for when it changes, else None.
        ``count``: the records it brought (when ``got_records``; only a trickle pace reads it);
        ``busy_at``: when (on the pace's clock) the consumer's owner last finished working on
        records it fetched before: a quiet spell counts from the later of that and the last
        record (a worker that fetched a burst at once and folds it for seconds is not idle, and
        the first record after the burst must not wait out an idle fetch)."""
        if not self.steps and self.trickle_max_ms is None:
            return None
        now = self._clock()
        if got_records:
            if self.trickle_max_ms is not None:
                if now - self._last_record_s >= TRICKLE_WINDOW_S:
                    self._arrivals.clear()  # after a quiet spell the rate starts again from here
                    self._since_s = now
                self._arrivals.append((now, max(count, 1)))
            self._last_record_s = now
            want = self._busy_wait(now)
        else:
            quiet_s = now - max(self._last_record_s, busy_at)
            if self.trickle_max_ms is None:
                want = self.short_ms
            else:  # the trickle's wait while its window lasts, then the longest it waits
                want = self._busy_wait(now) if quiet_s < TRICKLE_WINDOW_S else self.trickle_max_ms
            for after_s, ms in self.steps:
                if quiet_s >= after_s:
                    want = max(want, ms)
        if want == self.wait_ms:
            return None
        self.wait_ms = want
        return want

    def _busy_wait(self, now: float) -> int:
        """The wait while records come: ``short_ms``, or for a trickle the wait that brings
        :data:`TRICKLE_RECORDS_PER_FETCH` records at the window's rate (at most ``trickle_max_ms``)."""
        if self.trickle_max_ms is None:
            return self.short_ms
        while self._arrivals and now - self._arrivals[0][0] > TRICKLE_WINDOW_S:
            self._arrivals.popleft()
        span_s = max(min(now - self._since_s, TRICKLE_WINDOW_S), self.short_ms / 1000.0)
        rate = sum(n for _, n in self._arrivals) / span_s
        if rate <= 0:
            return self.trickle_max_ms
        return int(min(max(1000.0 * TRICKLE_RECORDS_PER_FETCH / rate, self.short_ms), self.trickle_max_ms))

    def after_fetch(self, c: AIOKafkaConsumer, got_records: bool, count: int = 1, busy_at: float = 0.0) -> None:
        """:meth:`saw`, and the new wait (if any) set on ``c`` (:func:`set_fetch_wait`)."""
        set_fetch_wait(c, self.saw(got_records, count, busy_at))


async def ensure_topics(kafka: KafkaConnection, wanted: tuple[Topic, ...]) -> list[str]:
    """Create the topics that do not exist yet; return the names created."""
    admin = AIOKafkaAdminClient(bootstrap_servers=_bootstrap(kafka), **security_options(kafka))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        new = [
            NewTopic(t.name, num_partitions=t.partitions, replication_factor=t.replication_factor,
                     topic_configs=dict(t.configs))
            for t in wanted
            if t.name not in existing
        ]
        if new:
            try:
                await admin.create_topics(new)
            except Exception as e:  # a concurrent creator won the race
                if "TopicAlreadyExists" not in type(e).__name__ and "already exists" not in str(e).lower():
                    raise
        old = [t for t in wanted if t.name in existing]  # retention and message size checked
        if old:
            for problem in await unsafe_topic_configs(admin, old):
                log.warning("topic config: %s", problem)
        return [t.name for t in new]
    finally:
        await admin.close()


MIN_MESSAGE_BYTES = 256 * 1024
"""The smallest ``max.message.bytes`` every topic needs: a dead letter (at most
``MAX_ORIGINAL_BYTES`` of the original, an error text and the envelope) and an event of
``MAX_BLOCKS`` block keys (~150 KB) must fit. Kafka's default is 1 MB; records above the
topic's limit are refused by the broker when produced (a request of more than ~200k token
ids must carry ``block_keys`` instead)."""


def config_problems(topic: Topic, actual: dict[str, str]) -> list[str]:
    """What in an existing topic's configs breaks the recovery story (pure)."""
    want = dict(topic.configs)
    out = []
    policy = actual.get("cleanup.policy", "delete")
    if "compact" in policy and want.get("cleanup.policy") == "delete":
        out.append(f"{topic.name} has cleanup.policy={policy}: compaction drops the events a rebuild replays")
    if "max.message.bytes" in actual and int(actual["max.message.bytes"]) < MIN_MESSAGE_BYTES:
        out.append(f"{topic.name} takes records of at most {actual['max.message.bytes']} bytes, less than the "
                   f"{MIN_MESSAGE_BYTES} a dead letter or a {MAX_BLOCKS}-block event may need")
    if "retention.ms" in want and "retention.ms" in actual:
        have, need = int(actual["retention.ms"]), int(want["retention.ms"])
        if need < 0 <= have or 0 <= have < need:
            out.append(f"{topic.name} keeps records {have} ms, less than the configured {need} ms")
    return out


async def unsafe_topic_configs(admin: AIOKafkaAdminClient, wanted: list[Topic]) -> list[str]:
    """Problems with existing topics' configs; one note instead if the broker cannot describe them.

    Tansu (the embedded broker) does not keep topic configs the way Kafka does (it has no
    retention or compaction at all); whatever it answers, or if it fails, is reported, not fatal.
    """
    try:
        resources = [ConfigResource(ConfigResourceType.TOPIC, t.name) for t in wanted]
        responses = await admin.describe_configs(resources)
        actual: dict[str, dict[str, str]] = {}
        for resp in responses:
            for res in resp.resources:
                # (error_code, error_message, resource_type, resource_name, config_entries)
                error_code, _, _, name, entries = res[:5]
                if error_code:
                    continue
                actual[name] = {e[0]: e[1] for e in entries if e[1] is not None}
    except Exception as e:  # noqa: BLE001 (an unsupported API or an odd answer: say so, do not stop the caller)
        return [f"could not describe topic configs ({type(e).__name__}: {e}); retention of existing topics "
                "not checked"[:300]]
    out: list[str] = []
    for t in wanted:
        if t.name not in actual:
            out.append(f"{t.name}: the broker did not describe its configs; retention not checked")
        else:
            out.extend(config_problems(t, actual[t.name]))
    return out


async def end_offsets(c: AIOKafkaConsumer, tps: list[Any], *, probe_timeout_s: float = 5.0) -> dict[Any, int]:
    """The offset after each partition's last record, for a consumer with ``tps`` assigned.

    Kafka's high watermark is exactly that. Tansu (the embedded broker) answers with the
    base offset of the partition's last record *batch* plus one, which falls short by the
    size of that batch (a replay that trusted it would stop early and say nothing). So the
    last batch is fetched and the end taken from its last record and from the high
    watermark the fetch response carries (right on Tansu too, and the only answer when a
    small ``max_partition_fetch_bytes`` brings back the start of a large batch): the same
    answer on Kafka, the right one on Tansu. Leaves the consumer's positions anywhere: seek after.
    """
    reported = await c.end_offsets(tps)
    out = {tp: int(reported[tp]) for tp in tps}
    pending = {tp for tp in tps if out[tp] > 0}
    for tp in pending:
        c.seek(tp, out[tp] - 1)
    deadline = asyncio.get_running_loop().time() + probe_timeout_s
    while pending and asyncio.get_running_loop().time() < deadline:
        got = await c.getmany(*pending, timeout_ms=200)
        for tp, msgs in got.items():
            if msgs:
                out[tp] = max(out[tp], msgs[-1].offset + 1, c.highwater(tp) or 0)
                pending.discard(tp)
    # a partition whose last record is a control marker yields nothing: its report stands
    return out


async def acknowledged(producer: AIOKafkaProducer, sends: list[Any], *, warn_after_s: float,
                       what: str = "record(s)") -> None:
    """Wait until the broker acknowledged every send (``producer.send``'s delivery futures).

    If that takes longer than ``warn_after_s``, say so and refresh the producer's metadata,
    then keep waiting: a batch whose partition leader the producer lost track of (a new
    topic's metadata fetch that ran while it waited) otherwise waits for the next periodic
    refresh, minutes away by default, and everything behind it stalls. Used by the router
    (dispatch) and the gateway (routing requests)."""
    done = asyncio.gather(*sends)
    try:
        await asyncio.wait_for(asyncio.shield(done), warn_after_s)
    except TimeoutError:
        log.warning("%d %s not acknowledged after %.1fs; refreshing the producer's metadata",
                    len(sends), what, warn_after_s)
        producer.client.force_metadata_update()
        await done
