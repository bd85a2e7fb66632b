"""The stateless routing worker: ``requests`` → policy → ``dispatch``.

Per request: compute (or take) the block-key chain, read the view for that chain
(one round trip), add the in-flight reservations not yet in heartbeats (held in
memory, shared between replicas through a Redis stream: see
``state.reservations``), build the policy's
:class:`~conductor.routing.snapshot.ClusterSnapshot`, decide, reserve the placement, and
produce the decision keyed by the prefill instance (a rejection keyed by the
request id) onto ``dispatch``.

Failure modes: a request that does not decode or validate becomes a
``invalid_request`` rejection (keyed and named by the Kafka key when the body is
unreadable; dead-lettered when even that is missing) and the worker goes on. When
Redis is unreachable the worker answers from its last snapshot's node states
(prefixes unknown), marks the decisions ``degraded`` with the snapshot's age, and
rejects with ``view_unavailable`` once that age passes ``max_snapshot_age_s``.

Delivery is at least once: offsets are committed after the batch's decisions are
acknowledged by the broker, so a crash may decide a request twice (the same seed,
possibly a newer view); dispatchers drop a second decision for a request id.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from opentelemetry import metrics

from conductor.errors import ViewStoreError
from conductor.profiles import ModelProfile, load_profile
from conductor.routing.policies import Placement, Policy, Rejection, make_policy
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest
from conductor.settings import Settings
from schemas import (
    DeadLetter,
    DecodeError,
    Envelope,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
    chain_keys,
    decode,
    encode,
    envelope,
    headers,
)
from state.reader import HiredisPackedConnection, RawSnapshotReader
from state.redis_view import RedisViewStore
from state.reservations import (
    Load,
    RedisReservations,
    ReservationStore,
    placement_reservations,
)
from state.view import NodeState, ViewReader, ViewSnapshot
from streams.kafka import consumer, ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)


def request_seed(base_seed: int, request_id: str) -> int:
    """The tie-break seed of one request: a stable 64-bit hash of the base seed and its id."""
    h = hashlib.blake2b(f"{base_seed}\x1f{request_id}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


class InvalidRequest(ValueError):
    """A request the router cannot place as given; the message goes back to the caller."""


@dataclass(slots=True)
class _LastView:
    snapshot: ViewSnapshot
    at: float  # time.monotonic() of the read


class RouterMetrics:
    """The router's instruments (no-ops until ``setup_metrics`` installs a provider)."""

    def __init__(self) -> None:
        m = metrics.get_meter(__name__)
        self.latency = m.create_histogram(
            "conductor_router_decision_latency", unit="ms", description="snapshot read + policy, per request"
        )
        self.reuse = m.create_histogram(
            "conductor_router_reused_prefix_ratio", description="reused prompt tokens / prompt tokens, per decision"
        )
        self.decisions = m.create_counter(
            "conductor_router_decisions", description="placements, by prefill and decode instance"
        )
        self.rejections = m.create_counter("conductor_router_rejections", description="rejections, by reason")


class Router:
    """Decides one request at a time; holds no state a replica would need to share."""

    def __init__(
        self,
        settings: Settings,
        view: ViewReader,
        reservations: ReservationStore,
        *,
        policy: Policy | None = None,
        profile: ModelProfile | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.view = view
        self.reservations = reservations
        self.profile = profile or load_profile(settings.model_profile)
        # Validates the configured name and params at start-up (ConfigError otherwise).
        self.policy = policy or make_policy(settings.policy, settings.policy_params, self.profile)
        self.params = {k: v for k, v in self.policy.params.items() if isinstance(v, (bool, int, float, str))}
        self.clock = clock
        self.metrics = RouterMetrics()
        self._last: _LastView | None = None
        self._since: dict[str, int] = {}  # node → last heartbeat seen: the reservation cut-off
        # node → (state, prefix, reservations, Instance): most nodes look the same request after request
        self._instances: dict[str, tuple[NodeState, tuple[int, int, int], Load | None, Instance]] = {}
        self.ttl_s = settings.heartbeat_ttl_s

    async def start(self) -> None:
        """Start following the shared reservations (a no-op for in-memory ones)."""
        start = getattr(self.reservations, "start", None)
        if start is not None:
            await start(int(time.time() * 1000))

    async def close(self) -> None:
        """Share the last reservations and stop following."""
        close = getattr(self.reservations, "close", None)
        if close is not None:
            await close()

    # --- the request --------------------------------------------------------------

    def chain_of(self, req: RoutingRequest) -> list[int]:
        bs = self.settings.block_size
        if req.block_keys is not None:
            if req.block_size is not None and req.block_size != bs:
                raise InvalidRequest(f"chain of block size {req.block_size}, but the view indexes blocks of {bs}")
            full = req.prompt_tokens // bs
            if len(req.block_keys) > full:
                raise InvalidRequest(
                    f"chain of {len(req.block_keys)} blocks is longer than the {req.prompt_tokens}-token prompt "
                    f"({full} full blocks of {bs})"
                )
            return list(req.block_keys)
        assert req.token_ids is not None
        return chain_keys(req.token_ids, bs, lora_name=req.lora_name)

    def policy_request(self, req: RoutingRequest, chain_len: int) -> PolicyRequest:
        s = self.settings
        return PolicyRequest(
            request_id=req.request_id,
            prompt_tokens=req.prompt_tokens,
            chain_len=chain_len,
            expected_output_tokens=req.expected_output_tokens,
            ttft_slo_s=req.ttft_slo_s if req.ttft_slo_s is not None else s.ttft_slo_s,
            tbt_slo_ms=req.tbt_slo_ms if req.tbt_slo_ms is not None else s.tbt_slo_ms,
            priority=req.priority,
        )

    # --- the view -------------------------------------------------------------------

    async def _read(self, chain: Sequence[int]) -> tuple[ViewSnapshot, dict[str, Load]]:
        snap = await self.view.snapshot(chain)
        # A reservation counts until the node's heartbeat is newer than it.
        self._since = {n.node_id: n.last_heartbeat_ms for n in snap.nodes}
        return snap, await self.reservations.pending(self._since, snap.now_ms)

    def _cluster(self, snap: ViewSnapshot, pending: dict[str, Load], model: str, age_ms: float) -> ClusterSnapshot:
        insts = []
        cache = self._instances
        for n in snap.live_nodes(self.ttl_s):
            if n.model != model and n.role != "store":
                continue
            prefix = snap.prefix.get(n.node_id, (0, 0, 0))
            extra = pending.get(n.node_id)
            hit = cache.get(n.node_id)
            if hit is not None and hit[0] is n and hit[1] == prefix and hit[2] == extra:
                insts.append(hit[3])
                continue
            inst = _instance(n, prefix, extra)
            cache[n.node_id] = (n, prefix, extra, inst)
            insts.append(inst)
        return ClusterSnapshot(tuple(insts), self.settings.block_size, dict(snap.watermark), age_ms)

    # --- deciding -------------------------------------------------------------------

    async def route(self, req: RoutingRequest) -> RoutingDecision | RoutingRejection:
        """Place one request (or reject it with a reason); records the reservation."""
        t0 = time.perf_counter()
        seed = request_seed(self.settings.seed, req.request_id)
        try:
            chain = self.chain_of(req)
        except InvalidRequest as e:
            return self.reject(req.request_id, "invalid_request", str(e), seed=seed)
        preq = self.policy_request(req, len(chain))
        degraded = False
        age_ms = 0.0
        try:
            snap, pending = await self._read(chain)
            self._last = _LastView(ViewSnapshot(snap.now_ms, snap.nodes, {}, snap.watermark), self.clock())
        except (ViewStoreError, OSError, asyncio.TimeoutError) as e:
            last = self._last
            age_ms = (self.clock() - last.at) * 1000.0 if last else float("inf")
            if last is None or age_ms > self.settings.max_snapshot_age_s * 1000.0:
                return self.reject(
                    req.request_id, "view_unavailable",
                    f"the view is unreachable ({e}) and the last snapshot is "
                    + ("missing" if last is None else f"{age_ms / 1000:.1f}s old"),
                    seed=seed,
                )
            degraded = True
            snap = last.snapshot  # node states only: prefixes of this chain are unknown
            pending = await self.reservations.pending(self._since, snap.now_ms + int(age_ms))
        cluster = self._cluster(snap, pending, req.model, age_ms)
        decision = self.policy.decide(preq, cluster, random.Random(seed))
        self.metrics.latency.record((time.perf_counter() - t0) * 1000.0)
        if isinstance(decision, Rejection):
            return self.reject(req.request_id, decision.reason, decision.message, seed=seed,
                               watermark=cluster.watermark)
        await self._reserve(req, preq, decision, snap.now_ms + int(age_ms))
        reused = min(decision.reused_blocks * self.settings.block_size, req.prompt_tokens)
        self.metrics.reuse.record(reused / req.prompt_tokens if req.prompt_tokens else 0.0)
        self.metrics.decisions.add(1, {"prefill": decision.prefill, "decode": decision.decode})
        return RoutingDecision(
            request_id=req.request_id,
            prefill_instance=decision.prefill,
            decode_instance=decision.decode,
            reused_tokens=reused,
            reuse_source=decision.reuse_source,
            reuse_tier=decision.reuse_tier,  # type: ignore[arg-type]
            predicted_ttft_s=decision.predicted_ttft_s,
            predicted_tbt_ms=decision.predicted_tbt_ms,
            policy=self.policy.name,
            params=self.params,
            seed=seed,
            watermark=cluster.watermark,
            degraded=degraded,
            snapshot_age_ms=age_ms,
        )

    async def _reserve(self, req: RoutingRequest, preq: PolicyRequest, d: Placement, now_ms: int) -> None:
        bs = self.settings.block_size
        reused = min(d.reused_blocks * bs, req.prompt_tokens)
        resv = placement_reservations(
            d.prefill, d.decode,
            prefill_tokens=req.prompt_tokens - reused,
            context_tokens=req.prompt_tokens,
            kv_blocks=-(-(req.prompt_tokens + req.expected_output_tokens) // bs),
        )
        try:
            await self.reservations.reserve(resv, now_ms)
        except (ViewStoreError, OSError) as e:
            log.warning("reservation not recorded for %s: %s", req.request_id, e)

    def reject(self, request_id: str, reason: str, message: str, *, seed: int = 0,
               watermark: dict[str, int] | None = None) -> RoutingRejection:
        self.metrics.rejections.add(1, {"reason": reason})
        return RoutingRejection(
            request_id=request_id[:256] or "unknown",
            reason=reason,  # type: ignore[arg-type]
            message=message[:4096],
            policy=self.policy.name,
            params=self.params,
            seed=seed,
            watermark=watermark or {},
        )

    # --- one Kafka record --------------------------------------------------------------

    async def handle(self, value: bytes | None, key: bytes | None) -> tuple[str, Any]:
        """Turn one ``requests`` record into (dispatch key, body) or ("", DeadLetter reason).

        Returns the body to produce: a decision, a rejection, or ``None`` with the reason
        as the key when the record must be dead-lettered (no request id anywhere).
        """
        key_id = _key_text(key)
        try:
            env = decode(value or b"")
            body = env.body
            if not isinstance(body, RoutingRequest):
                raise DecodeError("wrong_kind", f"a {body.kind} record on the requests topic")
        except DecodeError as e:
            if not key_id:
                return "", e
            return key_id, self.reject(key_id, "invalid_request", str(e))
        try:
            out = await self.route(body)
        except Exception as e:  # a bug must not turn one request into a crash loop of every replica
            log.exception("routing %s failed", body.request_id)
            out = self.reject(body.request_id, "invalid_request", f"router error: {type(e).__name__}: {e}")
        return (out.prefill_instance if isinstance(out, RoutingDecision) else out.request_id), out


def default_router_id() -> str:
    return f"router-{socket.gethostname()}-{os.getpid()}"


def _key_text(key: bytes | None) -> str:
    if not key:
        return ""
    try:
        return key.decode("utf-8")[:256]
    except UnicodeDecodeError:
        return ""


def _instance(n: NodeState, prefix: tuple[int, int, int], extra: Load | None) -> Instance:
    e = extra or Load()
    return Instance(
        node_id=n.node_id,
        role=n.role,
        prefix_blocks=prefix,
        queued_prefill_tokens=n.queued_prefill_tokens + e.prefill_tokens,
        queued_requests=n.queue_depth + e.prefill_requests,
        running_requests=n.running_requests,
        batch_size=n.batch_size + e.decode_requests,
        decode_context_tokens=n.decode_context_tokens + e.decode_context_tokens,
        free_kv_blocks=max(n.free_kv_blocks - e.kv_blocks, 0),
        total_kv_blocks=n.total_kv_blocks,
        rack=n.rack,
        zone=n.zone,
    )


# --- the Kafka loop -------------------------------------------------------------------


class RouterWorker:
    """Consumes ``requests`` in a consumer group and produces onto ``dispatch``."""

    GROUP = "conductor-router"

    def __init__(self, settings: Settings, router: Router, *, router_id: str | None = None) -> None:

        self.settings = settings
        self.router = router
        self.topics = topics(settings)
        self.router_id = router_id or default_router_id()
        self._seq = 0
        self.routed = 0

    def _wrap(self, body: Any) -> Envelope:
        self._seq += 1
        return envelope(body, producer_id=self.router_id, producer_seq=self._seq, ts_ms=int(time.time() * 1000))

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:

        t = self.topics
        await ensure_topics(self.settings, (t.requests, t.dispatch, t.dead_letter))
        prod = producer(self.settings)
        cons = consumer(self.settings, t.requests.name, group_id=self.settings.topic_prefix + self.GROUP)
        await prod.start()
        await cons.start()
        await self.router.start()
        try:
            if ready is not None:
                ready.set()
            while not stop.is_set():
                batches = await cons.getmany(timeout_ms=200, max_records=500)
                if not batches:
                    continue
                sends = []
                n = self.settings.router_concurrency
                for tp, records in batches.items():
                    # Up to n view reads in flight at once; decisions still run one after another
                    # (nothing between a read's reply and its reservation yields), so each one
                    # sees the reservations of those before it. Outputs keep the input order.
                    handled = []
                    for i in range(0, len(records), n):
                        window = records[i : i + n]
                        handled += await asyncio.gather(*(self.router.handle(r.value, r.key) for r in window))
                    for rec, (key, out) in zip(records, handled):
                        if key == "":
                            dl = DeadLetter(
                                source_topic=tp.topic, partition=tp.partition, offset=rec.offset,
                                reason=getattr(out, "reason", "invalid"), error=str(out)[:4096],
                                original=(rec.value or b"")[:1_048_576],
                            )
                            env = self._wrap(dl)
                            sends.append(await prod.send(t.dead_letter.name, encode(env), key=tp.topic.encode(),
                                                         headers=headers(env)))
                            continue
                        env = self._wrap(out)
                        sends.append(await prod.send(t.dispatch.name, encode(env), key=key.encode(),
                                                     headers=headers(env)))
                        self.routed += 1
                await asyncio.gather(*sends)
                await cons.commit()
        finally:
            await self.router.close()
            await cons.stop()
            await prod.stop()


def redis_stores(settings: Settings, producer_id: str | None = None) -> tuple[Any, Any]:
    """The Redis view reader and reservation log of ``settings``, with short timeouts.

    Timeouts are short on purpose: a router that waits on a dead Redis answers nobody;
    one that fails fast answers from its last snapshot.
    """


    if not settings.redis_url:
        raise ViewStoreError("redis_url is not set (start the embedded stack with `conductor dev up`)")
    client = aioredis.from_url(
        settings.redis_url, decode_responses=False, socket_timeout=0.5, socket_connect_timeout=0.5,
        health_check_interval=0, connection_class=HiredisPackedConnection,
    )
    view = RedisViewStore(client, settings.view_namespace)
    # The raw reader speaks plain RESP; TLS (rediss://) and unix sockets read through redis-py.
    reader = (RawSnapshotReader(settings.redis_url, settings.view_namespace, store=view)
              if settings.redis_url.startswith("redis://") else view)
    return (reader,
            RedisReservations(client, settings.view_namespace, settings.reservation_ttl_s,
                              producer_id=producer_id or default_router_id()))


__all__ = [
    "InvalidRequest", "RawSnapshotReader", "Router", "RouterWorker", "default_router_id", "redis_stores", "request_seed",
]
