"""The ZMQ → Kafka bridge for one engine.

Subscribes to an engine's KV-event publisher (vLLM's or SGLang's ZMQ PUB socket,
or Conductor's emulated engine), keeps the engine's sequence in order, translates
its events into Conductor records and hands them to a sink (in production: the
``kv-events`` topic keyed by node id).

Ordering and recovery, all per node:

- On start it asks the replay socket for everything from seq 0, so blocks the
  engine stored before the bridge connected (or while it was down) reach the view.
- A missing sequence number is asked for again on the replay socket (DEALER →
  ROUTER: one frame, the start seq as 8 bytes big-endian; replies ``[seq, payload]``
  or ``[topic, seq, payload]`` after the empty delimiter, ended by seq = -1). If
  replay cannot fill it, the node's view is stale: the bridge opens a new epoch,
  whose first record clears the node, and goes on.
- A sequence that goes backwards means the engine restarted: new epoch, too. So
  does a reconnect after which the engine no longer holds the last batch applied
  (byte for byte): a restarted engine may already be past the old sequence. The
  reconnect is checked as soon as ZMQ reports it, so an engine that restarts and
  stays idle is noticed too; and with ``metrics_url`` a new
  ``process_start_time_seconds`` on the engine's ``/metrics`` is a restart as well.
  After a restart the new process's buffered batches are replayed from seq 0.
- With ``metrics_url`` the heartbeats carry the engine's real load (see
  :mod:`conductor.bridge.scrape`); an engine whose ``/metrics`` does not answer gets
  no heartbeat, so the view stops counting it live within the heartbeat TTL.

Each epoch starts with an ``AllBlocksCleared`` at producer_seq 0 and numbers its
records 1, 2, 3... without holes (the view counts a hole as a gap). A bridge that
(re)starts opens a new epoch, which clears the node and lets the replayed batches
rebuild it, so nothing published by an earlier bridge process can linger wrongly.

An engine that publishes no KV events (``kv_events=False``: SGLang or vLLM started without
them, a hosted endpoint) gets heartbeats only, from its ``/metrics`` where it has one: no ZMQ
socket is opened, the heartbeats say ``kv_events=False``, and the node's kv-events stream holds
just the clear that opens each epoch (blocks an earlier bridge reported do not linger).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from aiokafka.errors import KafkaError
from zmq.utils.monitor import parse_monitor_message

from conductor.bridge.scrape import EngineLoad, EngineUnreachable, MetricsScraper, fetch_bootstrap_port, heartbeat_of
from conductor.bridge.translate import DEFAULT_MAX_TRACKED, NodeTranslator, tracked_bound
from conductor.bridge.wire import WireError, decode_batch, parse_seq, seq_frame
from schemas import AllBlocksCleared, Envelope, Heartbeat, Role, encode, envelope, headers
from schemas.records import Record

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0
"""The longest the event loop of a bridge sleeps with nothing from its engine. A batch, a connection
event (a reconnect is checked at once) and stop each wake it sooner; this only bounds the unexpected."""

RECENT_BATCHES = 4096

Sink = Callable[[list[Envelope]], Awaitable[None]]
"""Publishes envelopes in order; raises if they could not be published."""


@dataclass(frozen=True)
class BridgeConfig:
    node_id: str
    role: Role
    zmq_endpoint: str | None
    """The engine's KV-event PUB socket (None only with ``kv_events=False``)."""
    replay_endpoint: str | None = None
    block_size: int | None = None
    replay_timeout_s: float = 2.0
    heartbeat_s: float | None = 1.0
    """Publish a heartbeat for the node this often (None: the engine heartbeats itself)."""
    model: str = "default"
    metrics_url: str | None = None
    """The engine's Prometheus endpoint (vLLM/SGLang ``/metrics``): heartbeats with its real load."""
    dp_rank: int | None = None
    """The data-parallel rank this bridge follows (its batches must say so; its metrics are filtered by it)."""
    default_prompt_tokens: int = 0
    """Mean prompt length assumed for queued requests until the engine has finished one."""
    rack: str | None = None
    """Where the engine is (carried in heartbeats; transfer costs follow the topology)."""
    zone: str | None = None
    endpoint: str | None = None
    """The engine's serving base URL, announced in heartbeats so gateways find it through the view
    (None: the base of ``metrics_url``, when that is an ``http(s)://host:port/metrics`` URL)."""
    bootstrap_port: int | None = None
    """SGLang: the prefill server's bootstrap port, announced in heartbeats (None: a prefill bridge asks
    the engine's ``/server_info`` for its ``disaggregation_bootstrap_port``)."""
    kv_transfer: bool | None = None
    """Whether the engine runs a KV connector (P/D hand-offs); None: by role (``both`` cannot)."""
    max_tracked_blocks: int | None = None
    """Engine hashes remembered (the translator's memory bound); None: from the engine's KV capacity
    on its ``/metrics`` (:func:`~conductor.bridge.translate.tracked_bound`), else 1,000,000."""
    kv_events: bool = True
    """False: the engine publishes no KV events; heartbeats only, announcing ``kv_events=False``."""

    def __post_init__(self) -> None:
        if self.kv_events and not self.zmq_endpoint:
            raise ValueError("a bridge that follows KV events needs the engine's zmq_endpoint")
        if not self.kv_events and not self.heartbeat_s:
            raise ValueError("a bridge without KV events publishes heartbeats only: it needs heartbeat_s")

    def announced(self) -> dict[str, Any]:
        """What every heartbeat of this node says besides the load: where it is and how to reach it."""
        out: dict[str, Any] = {"rack": self.rack, "zone": self.zone, "dp_rank": self.dp_rank,
                               "bootstrap_port": self.bootstrap_port, "kv_transfer": self.kv_transfer,
                               "kv_events": None if self.kv_events else False}
        out["endpoint"] = self.endpoint or endpoint_of_metrics(self.metrics_url)
        return out


def endpoint_of_metrics(metrics_url: str | None) -> str | None:
    """``http://h:p/metrics`` → ``http://h:p`` (vLLM and SGLang serve both from one server)."""
    if not metrics_url or not metrics_url.startswith(("http://", "https://")):
        return None
    base, sep, _ = metrics_url.rstrip("/").rpartition("/metrics")
    return base if sep and base.count("/") == 2 else None


class Bridge:
    """Follow one engine's event stream and publish it as Conductor records."""

    def __init__(
        self,
        config: BridgeConfig,
        sink: Sink,
        heartbeat_sink: Sink | None = None,
        *,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.config = config
        self.sink = sink
        self.heartbeat_sink = heartbeat_sink
        self.clock_ms = clock_ms
        self.ctx = context or zmq.asyncio.Context.instance()
        self.translator = NodeTranslator(expected_block_size=config.block_size,
                                         max_tracked=config.max_tracked_blocks or DEFAULT_MAX_TRACKED)
        self.counts: Counter[str] = Counter()
        self.epoch = 0
        self.expected: int | None = None
        """The next engine seq in order (None: nothing seen in this epoch yet)."""
        self._hb_seq = 0
        self._seq = 0
        """producer_seq of the last record published in this epoch."""
        self._last_applied: tuple[int, bytes] | None = None
        self._recent: OrderedDict[int, bytes] = OrderedDict()
        """Digests of the last batches applied in this epoch, by seq: tells a repeat from a restart."""
        self._disconnected = False
        self._verify = False
        self._last_engine_contact = 0.0
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()
        """Serialises the event loop's work with restarts noticed by the heartbeat task."""
        self.scraper = (
            MetricsScraper(config.metrics_url, rank=config.dp_rank) if config.metrics_url else None
        )
        self._engine_start: float | None = None
        self.last_load: EngineLoad | None = None
        """The last scrape's reading (its prefix-cache counters are exported as the reuse realised)."""
        self._announced = Heartbeat(role=config.role, **config.announced()).model_dump(
            include=set(config.announced()))  # validated once: a bad --engine-url fails at start-up
        self._bootstrap_unknown = (config.bootstrap_port is None and config.role == "prefill"
                                   and self._announced["endpoint"] is not None)
        """A prefill engine whose bootstrap port nobody told: asked at each heartbeat until it answers."""
        self._restart_seen_s = 0.0
        self.ready = asyncio.Event()
        """Set once the start-up replay is done and live events are being followed."""

    # --- publishing ---------------------------------------------------------

    async def _new_epoch(self, reason: str) -> None:
        self.epoch = max(self.clock_ms(), self.epoch + 1)
        self.translator.reset()
        self.expected = None
        self._last_applied = None
        self._recent.clear()
        self.counts[f"epoch_{reason}"] += 1
        log.info("node %s: new epoch %d (%s)", self.config.node_id, self.epoch, reason)
        self._seq = -1
        await self._publish([AllBlocksCleared()])

    async def _publish(self, bodies: list[Record]) -> None:
        if not bodies:
            return
        now = self.clock_ms()
        envs = [
            envelope(b, producer_id=self.config.node_id, producer_seq=self._seq + 1 + i, epoch=self.epoch, ts_ms=now)
            for i, b in enumerate(bodies)
        ]
        await self.sink(envs)
        self._seq += len(envs)
        self.counts["records"] += len(envs)

    async def _apply(self, seq: int, payload: bytes) -> None:
        """Apply engine batch ``seq``, which is the next one in order."""
        self.expected = seq + 1
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        self._last_applied = (seq, digest)
        self._recent[seq] = digest
        while len(self._recent) > RECENT_BATCHES:
            self._recent.popitem(last=False)
        try:
            batch = decode_batch(payload)
        except WireError as e:
            # The blocks in it are unknown: the node's view can no longer be trusted.
            self.counts["bad_batch"] += 1
            log.warning("node %s: undecodable batch %d (%s); marking the node stale", self.config.node_id, seq, e)
            await self._new_epoch("bad_batch")
            self.expected = seq + 1
            return
        if (self.config.dp_rank is not None and batch.data_parallel_rank is not None
                and batch.data_parallel_rank != self.config.dp_rank):
            # Events of another rank's cache would mislead routing to this node: counted, still applied
            # (the engine decides which socket a rank publishes on; the count tells the operator).
            self.counts["dp_rank_mismatch"] += 1
        await self._publish(self.translator.translate(batch))
        self.counts["batches"] += 1

    # --- replay -------------------------------------------------------------

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the engine for every batch from ``start``; None if nobody answered."""
        if self._dealer is None:
            return None
        # A fresh DEALER per request: a late reply to an abandoned request can never
        # be mistaken for the answer to this one.
        self._dealer.close(linger=0)
        self._dealer = self._make_dealer()
        # The empty delimiter makes the DEALER look like a REQ to vLLM's ROUTER (3 frames).
        await self._dealer.send_multipart([b"", seq_frame(start)])
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.config.replay_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await self._dealer.poll(int(left * 1000)):
                self.counts["replay_timeout"] += 1
                return None
            frames = await self._dealer.recv_multipart()
            while frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) not in (2, 3):
                self.counts["bad_replay_frame"] += 1
                continue
            try:
                seq = parse_seq(frames[-2])
            except WireError:
                self.counts["bad_replay_frame"] += 1
                continue
            if seq == -1:
                self._last_engine_contact = time.monotonic()
                return out
            out.append((seq, frames[-1]))

    def _make_dealer(self) -> zmq.asyncio.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        assert self.config.replay_endpoint is not None
        s.connect(self.config.replay_endpoint)
        return s

    async def _catch_up(self, start: int, upto: int | None) -> bool:
        """Fill ``start`` .. ``upto`` (exclusive; None = all buffered) from replay; True if filled.

        At the start of an epoch (nothing applied yet) whatever the engine still buffers is
        applied even if it begins after ``start``: the epoch opened with a clear, so a view
        missing older blocks is incomplete, never wrong.
        """
        got = await self.replay(start)
        if got is None:
            return False
        got.sort()
        for seq, payload in got:
            if upto is not None and seq >= upto:
                break
            if self.expected is None:
                if seq > start:
                    self.counts["missed_before_join"] += 1
            elif seq < self.expected:
                continue  # already applied
            elif seq != self.expected:
                return False  # the engine's buffer no longer reaches back far enough
            await self._apply(seq, payload)
        return upto is None or self.expected == upto

    # --- the loop -----------------------------------------------------------

    async def _drain_monitor(self, monitor: zmq.asyncio.Socket) -> None:

        while await monitor.poll(0):
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._disconnected = True
            elif event == zmq.EVENT_CONNECTED and self._disconnected:
                self._disconnected = False
                self._verify = True
                self.counts["reconnects"] += 1

    async def _same_run(self) -> bool:
        """After a reconnect: does the engine still hold the last batch applied, byte for byte?

        A restarted engine numbers from 0 again and may already be past the old sequence,
        so a higher seq alone proves nothing. If the batch cannot be compared (no replay
        socket, or no longer buffered), assume a restart: a clear is safe, a mix is not.
        """
        self._verify = False
        if self.expected is None or self._last_applied is None:
            return True
        seq, digest = self._last_applied
        got = await self.replay(seq)
        if not got or got[0][0] != seq:
            return False
        return hashlib.blake2b(got[0][1], digest_size=16).digest() == digest

    async def _restarted(self, reason: str) -> None:
        """The engine is a new process: drop the old blocks, then take what the new one buffers."""
        log.warning("node %s: engine restarted (%s)", self.config.node_id, reason)
        self._restart_seen_s = time.time()
        await self._new_epoch(reason)
        if self.config.replay_endpoint:
            await self._catch_up(0, None)

    @staticmethod
    async def _batch_waiting(poller: zmq.asyncio.Poller, sub: zmq.asyncio.Socket, stopping: asyncio.Future[Any]) -> bool:
        """Sleep until the engine's socket or its connection monitor has something, or ``stopping``
        ends, or :data:`IDLE_WAIT_S` passes; whether a batch is waiting on ``sub``. (The loop used to
        wake every 200 ms to look: five wake-ups a second per idle bridge.)"""
        polling = asyncio.ensure_future(poller.poll(int(IDLE_WAIT_S * 1000)))
        await asyncio.wait({polling, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not polling.done():
            polling.cancel()
            return False
        return any(sock is sub for sock, _ in polling.result())

    async def _check_reconnect(self) -> None:
        """Right after ZMQ reconnects (an engine may have restarted and stay idle)."""
        if self._verify and not await self._same_run():
            await self._restarted("restart")

    async def _on_message(self, seq: int, payload: bytes) -> None:
        if self._verify and not await self._same_run():
            await self._restarted("restart")
        if self.expected is not None and seq < self.expected:
            if self._recent.get(seq) == hashlib.blake2b(payload, digest_size=16).digest():
                # Already applied: it came both from replay and from the live socket.
                self.counts["duplicates"] += 1
                return
            # A different batch under an old number: the engine restarted.
            await self._new_epoch("restart")
        if self.expected is None:
            if seq > 0 and self.config.replay_endpoint:
                # First contact in this epoch, mid-stream: fetch what the engine still buffers.
                await self._catch_up(0, seq)
                if self.expected is not None and self.expected != seq:
                    await self._new_epoch("gap")
            await self._apply(seq, payload)
            return
        if seq > self.expected:
            self.counts["gaps"] += 1
            log.info("node %s: gap %d..%d, asking for replay", self.config.node_id, self.expected, seq - 1)
            if not await self._catch_up(self.expected, seq):
                self.counts["gaps_unfilled"] += 1
                await self._new_epoch("gap")
        await self._apply(seq, payload)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Follow the engine until ``stop`` is set (or the task is cancelled)."""
        stop = stop or asyncio.Event()
        if not self.config.kv_events:
            await self._heartbeats_only(stop)
            return
        assert self.config.zmq_endpoint is not None  # checked by the config
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # Connection events tell a reconnect apart; after one, the engine may have restarted.
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.config.zmq_endpoint)
        self._sub = sub
        if self.config.replay_endpoint:
            self._dealer = self._make_dealer()
        hb_task = asyncio.create_task(self._heartbeats(stop)) if self.config.heartbeat_s else None
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await self._new_epoch("start")
            if self.config.replay_endpoint:
                await self._catch_up(0, None)
            self.ready.set()
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not stop.is_set():
                if not await sub.poll(0):
                    await self._drain_monitor(monitor)
                    async with self._lock:
                        await self._check_reconnect()
                    if not await self._batch_waiting(poller, sub, stopping):
                        continue
                await self._drain_monitor(monitor)
                frames = await sub.recv_multipart()
                self._last_engine_contact = time.monotonic()
                if len(frames) == 3:
                    seq_b, payload = frames[1], frames[2]
                elif len(frames) == 2:
                    seq_b, payload = frames
                else:
                    self.counts["bad_frame"] += 1
                    continue
                try:
                    seq = parse_seq(seq_b)
                except WireError:
                    self.counts["bad_frame"] += 1
                    continue
                if seq < 0:
                    self.counts["bad_frame"] += 1
                    continue
                async with self._lock:
                    await self._on_message(seq, payload)
        finally:
            stopping.cancel()
            if hb_task:
                hb_task.cancel()
                await asyncio.gather(hb_task, return_exceptions=True)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            if self._dealer is not None:
                self._dealer.close(linger=0)

    async def _heartbeats_only(self, stop: asyncio.Event) -> None:
        """An engine without KV events: open the epoch (its clear), then heartbeat until ``stop``.
        A heartbeat task that fails (its sink raised) ends the bridge with that error."""
        await self._new_epoch("start")
        hb_task = asyncio.create_task(self._heartbeats(stop))
        stopper = asyncio.create_task(stop.wait())
        self.ready.set()
        try:
            await asyncio.wait([stopper, hb_task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stopper, hb_task):
                t.cancel()
            results = await asyncio.gather(stopper, hb_task, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                raise r

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        """Heartbeat for an engine that does not heartbeat itself (a real vLLM/SGLang).

        With ``metrics_url``: one scrape per interval, the heartbeat carries the engine's load,
        and no answer means no heartbeat. Otherwise liveness is what the bridge can see (recent
        events, or an answer to a probe on the replay socket) and the load fields stay zero.
        """
        assert self.config.heartbeat_s
        interval = self.config.heartbeat_s
        probe = None
        if self.scraper is None and self.config.replay_endpoint:
            probe = self.ctx.socket(zmq.DEALER)
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(self.config.replay_endpoint)
        try:
            while not stop.is_set():
                if probe is not None:
                    # Ask for a seq far ahead: a live engine answers with just the end marker.
                    await probe.send_multipart([b"", seq_frame(1 << 62)])
                started = time.monotonic()
                if self.scraper is not None:
                    hb = await self._scraped_heartbeat(interval)
                else:
                    await asyncio.sleep(interval)
                    if probe is not None:
                        while await probe.poll(0):
                            await probe.recv_multipart()
                            self._last_engine_contact = time.monotonic()
                    alive = probe is None or time.monotonic() - self._last_engine_contact <= 3 * interval
                    hb = Heartbeat(role=self.config.role, model=self.config.model, interval_s=interval) if alive else None
                if hb is not None and self._bootstrap_unknown:
                    await self._discover_bootstrap_port()
                if hb is not None:
                    hb = hb.model_copy(update=self._announced)
                if hb is not None and self.heartbeat_sink is not None:
                    self._hb_seq += 1
                    env = envelope(hb, producer_id=self.config.node_id, producer_seq=self._hb_seq,
                                   epoch=self.epoch, ts_ms=self.clock_ms())
                    try:
                        await self.heartbeat_sink([env])
                        self.counts["heartbeats"] += 1
                    except (KafkaError, OSError) as e:  # a broker hiccup must not stop the bridge
                        log.warning("node %s: heartbeat not published: %s", self.config.node_id, e)
                if self.scraper is not None:
                    await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
        finally:
            if probe is not None:
                probe.close(linger=0)
            if self.scraper is not None:
                await self.scraper.close()

    async def _discover_bootstrap_port(self) -> None:
        """Announce the bootstrap port the engine says it serves (SGLang's ``/server_info``): each prefill
        instance its own, where a gateway would otherwise guess the engine's HTTP port."""
        try:
            port = await fetch_bootstrap_port(self._announced["endpoint"])
        except EngineUnreachable:
            return  # asked again at the next heartbeat
        self._bootstrap_unknown = False
        if port is not None:
            self._announced["bootstrap_port"] = port
            log.info("node %s: the engine serves its bootstrap on port %d", self.config.node_id, port)

    async def _scraped_heartbeat(self, interval: float) -> Heartbeat | None:
        assert self.scraper is not None
        load = await self.scraper.scrape()
        if load is None:
            self.counts["scrape_failures"] += 1
            return None
        self.counts["scrapes"] += 1
        self.last_load = load
        await self._bound_by_capacity(load)
        if load.start_time_s is not None:
            # A new process, unless the ZMQ side already opened an epoch for this very one.
            if (self._engine_start is not None and load.start_time_s != self._engine_start
                    and self._restart_seen_s < load.start_time_s):
                self.counts["restart_by_start_time"] += 1
                async with self._lock:
                    await self._restarted("restart")
            self._engine_start = load.start_time_s
        return heartbeat_of(load, role=self.config.role, model=self.config.model, interval_s=interval,
                            default_prompt_tokens=self.config.default_prompt_tokens)

    async def _bound_by_capacity(self, load: EngineLoad) -> None:
        """Unless the operator set it, track as many hashes as the engine's capacity can hold (with
        room to spare; :func:`~conductor.bridge.translate.tracked_bound`)."""
        if self.config.max_tracked_blocks is not None or not self.config.kv_events:
            return
        bound = tracked_bound(load.total_blocks, load.cpu_blocks, self.translator.tiers_seen)
        if bound is not None and bound != self.translator.max_tracked:
            async with self._lock:
                await self._publish(self.translator.bound(bound))


def offset_port(endpoint: str | None, rank: int) -> str | None:
    """The endpoint data-parallel rank ``rank`` uses: tcp port + rank (as vLLM offsets them), ipc/inproc + ``_dp<r>``."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def rank_configs(*, node_id: str, dp_size: int = 1, zmq_endpoint: str | None, replay_endpoint: str | None,
                 **common: Any) -> list[BridgeConfig]:
    """One bridge per data-parallel rank: its own sockets, node id and metrics series.

    Each rank of a vLLM DP engine is its own scheduler with its own KV cache, queue and
    prefix-cache hits, so Conductor routes to a rank as to any instance (vLLM accepts a
    request pinned to a rank); one node with merged load would hide which rank holds a prefix.
    """
    if dp_size == 1:
        return [BridgeConfig(node_id=node_id, zmq_endpoint=zmq_endpoint, replay_endpoint=replay_endpoint, **common)]
    return [
        BridgeConfig(node_id=f"{node_id}-dp{r}", zmq_endpoint=offset_port(zmq_endpoint, r) or zmq_endpoint,
                     replay_endpoint=offset_port(replay_endpoint, r), dp_rank=r, **common)
        for r in range(dp_size)
    ]


class KafkaSink:
    """Sends envelopes to a topic keyed by their producer id, in order, without a round trip each.

    aiokafka keeps at most one batch in flight per partition, so one node's records stay in
    order. A send that failed is raised by the next call (or by :meth:`flush`), which stops the
    bridge; a restarted bridge opens a new epoch, so a lost record is never silently skipped.
    """

    def __init__(self, producer: Any, topic: str, max_pending: int = 2_000) -> None:
        self.producer = producer
        self.topic = topic
        self.max_pending = max_pending
        self.pending: deque[asyncio.Future[Any]] = deque()

    def _settle(self) -> None:
        while self.pending and self.pending[0].done():
            failed = self.pending.popleft().exception()
            if failed is not None:
                raise failed

    async def __call__(self, envs: list[Envelope]) -> None:

        self._settle()
        for env in envs:
            self.pending.append(
                await self.producer.send(self.topic, encode(env), key=env.producer_id.encode(), headers=headers(env))
            )
        while len(self.pending) > self.max_pending:
            await self.pending.popleft()

    async def flush(self) -> None:
        """Wait for every send so far; raise the first failure."""
        while self.pending:
            await self.pending.popleft()


def kafka_sink(producer: Any, topic: str) -> KafkaSink:
    """A sink onto ``topic`` (see :class:`KafkaSink`)."""
    return KafkaSink(producer, topic)
