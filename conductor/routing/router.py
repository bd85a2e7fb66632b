"""The stateless routing worker: ``requests`` → policy → ``dispatch``.

Per request: compute (or take) the block-key chain, read the view for that chain
(one round trip), add the in-flight reservations not yet in heartbeats (held in
memory, shared between replicas through a Redis stream: see
``state.reservations``), build the policy's
:class:`~conductor.routing.snapshot.ClusterSnapshot`, decide, reserve the placement, and
produce the decision keyed by the prefill instance (a rejection keyed by the
request id) onto ``dispatch``.

Failure modes: a record that does not decode or validate is dead-lettered (whatever its
bytes or key: ``schemas.DeadLetter.of`` never fails) and, when its Kafka key reads as a
request id, also answered with an ``invalid_request`` rejection under that id; the worker
goes on. When
Redis is unreachable the worker answers from its last snapshot's node states
(prefixes unknown), marks the decisions ``degraded`` with the snapshot's age, and
rejects with ``view_unavailable`` once that age passes ``max_snapshot_age_s``.

Delivery is at least once: offsets are committed after the batch's decisions are
acknowledged by the broker, so a crash may decide a request twice (the same seed,
possibly a newer view); dispatchers drop a second decision for a request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from aiokafka import TopicPartition
from opentelemetry import metrics

from conductor.costmodel.profiles import ModelProfile, load_profile
from conductor.errors import ConfigError, ViewStoreError
from conductor.routing.control import ControlState, apply_control
from conductor.routing.decision import decision_record, decision_reservations, rejection_record
from conductor.routing.index import ClusterIndex
from conductor.routing.policies import Placement, Policy, Rejection, make_policy
from conductor.routing.policies.mode import ModeChoice, decide_mode
from conductor.routing.policies.stages import CLUSTER, VIEW_READ, StageTimes
from conductor.routing.snapshot import ClusterSnapshot, Instance, InstanceMemo, PolicyRequest, build_cluster
from conductor.settings import Settings
from schemas import (
    ControlCommand,
    DecodeError,
    Endpoint,
    Envelope,
    RejectReason,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
    decode,
    encode,
    envelope,
    headers,
    request_chain_keys,
)
from schemas.records import MAX_BLOCKS
from state.connect import HiredisPackedConnection, open_client
from state.decisions import DecisionIndex, DecisionPosition, RedisDecisionIndex
from state.reader import RawSnapshotReader
from state.redis_view import RedisViewStore
from state.reservations import InMemoryReservations, Load, RedisReservations, ReservationStore
from state.tracking import TrackingSnapshotReader
from state.view import ViewReader, ViewSnapshot
from streams.dead_letters import DeadLetters
from streams.kafka import acknowledged, consumer, end_offsets, ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)


def request_seed(base_seed: int, request_id: str) -> int:
    """The tie-break seed of one request: a stable 64-bit hash of the base seed and its id."""
    h = hashlib.blake2b(f"{base_seed}\x1f{request_id}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


HEALTH_EVERY_S = 0.25
"""How often a router asks whether the view is lost or being rebuilt (``Router.view_health``)."""


MAX_INDEXES = 16
"""Cluster indexes one router keeps (one per model and set of excluded nodes)."""


def _since(snap: ViewSnapshot) -> dict[str, int]:
    """Per node, the reservation cut-off: a reservation counts until the node's heartbeat is newer."""
    return {n.node_id: n.last_heartbeat_ms for n in snap.nodes}


class _Unhealthy(Exception):
    """The view answers but is not the truth (lost, or partitions being rebuilt from the log)."""


class InvalidRequest(ValueError):
    """A request the router cannot place as given; the message goes back to the caller."""


InstanceOf = Callable[[str], "Instance | None"]
"""node → its instance in one cluster picture (None: not in it)."""


def _named(answer: Placement | Rejection) -> tuple[str, ...]:
    if isinstance(answer, Rejection):
        return ()
    return (answer.prefill, answer.decode, *answer.prefill_group)


def _instance_of(cluster: ClusterSnapshot) -> InstanceOf:
    """node → its instance in ``cluster``: the index's map when there is one, else a map made on
    first use (one scan, only when a decision names a node)."""
    if cluster.index is not None:
        return cluster.index.base.get
    found: dict[str, Instance] | None = None

    def of(node: str) -> Instance | None:
        nonlocal found
        if found is None:
            found = {i.node_id: i for i in cluster.instances}
        return found.get(node)

    return of


def _names_unreachable(answer: Placement | Rejection, of: InstanceOf, reachable: Collection[str]) -> bool:
    """Whether ``answer`` names an engine that announces no endpoint and is not in ``reachable``."""
    return any((i := of(n)) is not None and i.endpoint is None and n not in reachable for n in _named(answer))


def _endpoints(answer: Placement | Rejection, of: InstanceOf) -> dict[str, Endpoint]:
    """How to reach each engine ``answer`` names, for those that announce it."""
    out = {}
    for n in _named(answer):
        i = of(n)
        if i is not None and i.endpoint and n not in out:
            out[n] = Endpoint(url=i.endpoint, dp_rank=i.dp_rank, bootstrap_port=i.bootstrap_port)
    return out


def why_none(snap: ViewSnapshot, ttl_s: float, model: str, exclude: Collection[str],
             cordoned: Collection[str]) -> str:
    """Why a read's nodes were left out of the policy's picture, counted by cause (what a
    ``no_live_instance`` rejection says, so an operator sees where the instances went)."""
    causes: dict[str, list[str]] = {}
    for n in snap.nodes:
        if n.role == "store":
            continue
        if not n.is_live(snap.now_ms, ttl_s):
            cause = "no heartbeat within the TTL"
        elif n.model != model:
            cause = f"serving another model ({n.model})"
        elif n.node_id in cordoned:
            cause = "cordoned or draining"
        elif n.node_id in exclude:
            cause = "excluded (failed this request, or not reachable by the gateway)"
        else:
            continue
        causes.setdefault(cause, []).append(n.node_id)
    if not causes:
        return f"the view has {sum(n.role != 'store' for n in snap.nodes)} engine(s)" if snap.nodes else \
            "the view has no node: are the bridges and the stream worker running?"
    return "; ".join(f"{len(v)} {k}: {', '.join(sorted(v)[:5])}{' ...' if len(v) > 5 else ''}"
                     for k, v in causes.items())


@dataclass(slots=True)
class _LastView:
    snapshot: ViewSnapshot
    at: float  # time.monotonic() of the read


@dataclass(frozen=True, slots=True)
class _Read:
    """What a decision is made on: a read (or, degraded, the last one's node states) and its age."""

    snap: ViewSnapshot
    pending: dict[str, Load] | None
    degraded: bool
    age_ms: float
    why: str


@runtime_checkable
class SharedReservations(Protocol):
    """Reservations shared between replicas (``state.reservations.RedisReservations``): a local
    copy kept current by following the others', started and closed with the router."""

    @property
    def local(self) -> InMemoryReservations: ...
    async def start(self, now_ms: int) -> None: ...
    async def close(self) -> None: ...


@runtime_checkable
class HealthTellingView(Protocol):
    """A view that can say whether it is the truth (``state.redis_view.RedisViewStore``)."""

    async def view_health(self) -> tuple[bool, str]: ...


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
        self.predicted_reuse = m.create_counter(
            "conductor_router_predicted_reused_tokens",
            description="prompt tokens decisions predicted the prefill instance reads from its own cache, by node "
            "(against the engine's own count, conductor_bridge_engine_prefix_cache_hit_tokens)",
        )
        self.routed_prompt = m.create_counter(
            "conductor_router_routed_prompt_tokens", description="prompt tokens placed, by prefill instance"
        )
        self.stages = m.create_histogram(
            "conductor_router_stage_latency", unit="ms",
            description="each stage of a decision (view_read, cluster, the policy's stages, mode), by stage",
        )


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
        incremental: bool = True,
    ) -> None:
        """``incremental``: keep the cluster picture from read to read (a
        :class:`~conductor.routing.index.ClusterIndex` per model, when the reservations are
        held in memory); False rebuilds it from every read (``explain`` does, as the check)."""
        self.settings = settings
        self.view = view
        self.reservations = reservations
        self.profile = profile or load_profile(settings.model_profile)
        # Validates the configured name and params at start-up (ConfigError otherwise).
        self.policy = policy or make_policy(settings.policy, settings.policy_params, self.profile,
                                            settings.cluster_topology())
        self.params = {k: v for k, v in self.policy.params.items() if isinstance(v, (bool, int, float, str))}
        self.clock = clock
        self.metrics = RouterMetrics()
        self._last: _LastView | None = None
        self._memo: InstanceMemo = {}
        local = reservations.local if isinstance(reservations, SharedReservations) else reservations
        self._local = local if incremental and isinstance(local, InMemoryReservations) else None
        self.on_stages: Callable[[dict[str, float]], None] | None = None
        """Told each decision's stage times, in ms (``explain``, the route bench)."""
        self._indexes: dict[tuple[str | None, frozenset[str]], ClusterIndex] = {}
        self._health: tuple[float, bool, str] | None = None  # (clock, healthy, reason) of the last check
        self.ttl_s = settings.heartbeat_ttl_s
        self.control = ControlState()

    async def start(self) -> None:
        """Start following the shared reservations (a no-op for in-memory ones)."""
        if isinstance(self.reservations, SharedReservations):
            await self.reservations.start(int(time.time() * 1000))

    async def close(self) -> None:
        """Share the last reservations and stop following."""
        if isinstance(self.reservations, SharedReservations):
            await self.reservations.close()

    # --- runtime control (the control topic, in log order) ------------------------------

    def check_policy(self, name: str | None, params: dict[str, Any]) -> None:
        """Raise ConfigError when ``name`` (None: the configured policy) and ``params`` do not build."""
        make_policy(name or self.settings.policy, params, self.profile)

    def apply_control(self, cmd: ControlCommand, offset: int) -> None:
        """Fold one control record in; swap the policy when it changed. Later decisions record ``offset``."""
        before = self.control
        after = apply_control(before, cmd, offset, self.check_policy)
        self.control = after
        if after.last_error:
            log.error("control %s", after.last_error)
        new_profile = after.profile is not None and after.profile != before.profile
        if new_profile:
            assert after.profile is not None
            self.profile = after.profile
            self._indexes.clear()  # they cost queues with the old profile
            log.info("control offset %d: cost model %s", offset, self.profile.name)
        if new_profile or (after.policy, after.params) != (before.policy, before.params):
            name = after.policy or self.settings.policy
            params = dict(after.params) if after.params is not None else self.settings.policy_params
            self.policy = make_policy(name, params, self.profile, self.settings.cluster_topology())
            self.params = {k: v for k, v in self.policy.params.items() if isinstance(v, (bool, int, float, str))}
            log.info("control offset %d: policy %s %s", offset, self.policy.name, self.params)
        if after.excluded != before.excluded:
            self._indexes.clear()  # kept per set of excluded nodes: the old ones are of no more use
            log.info("control offset %d: not routing to %s", offset, sorted(after.excluded) or "-")

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
        if len(req.token_ids) // bs > MAX_BLOCKS:
            raise InvalidRequest(f"{len(req.token_ids)} token ids make {len(req.token_ids) // bs} blocks of {bs}; "
                                 f"at most {MAX_BLOCKS} blocks per request")
        return request_chain_keys(req, bs)

    def policy_request(self, req: RoutingRequest, chain_len: int, ordinal: int = 0) -> PolicyRequest:
        s = self.settings
        return PolicyRequest(
            request_id=req.request_id,
            prompt_tokens=req.prompt_tokens,
            chain_len=chain_len,
            expected_output_tokens=req.expected_output_tokens,
            ttft_slo_s=req.ttft_slo_s if req.ttft_slo_s is not None else s.ttft_slo_s,
            tbt_slo_ms=req.tbt_slo_ms if req.tbt_slo_ms is not None else s.tbt_slo_ms,
            priority=req.priority,
            ordinal=ordinal,
        )

    # --- the view -------------------------------------------------------------------

    async def read(self, chain: Sequence[int], after: Awaitable[Any] | None = None,
                   ) -> tuple[ViewSnapshot, dict[str, Load] | None]:
        """One view read and the reservations pending against it (None: kept by the cluster
        index, taken in :meth:`cluster`); with ``after``, the reservations are taken once
        ``after`` is done (the decision before this one has reserved)."""
        snap = await self.view.snapshot(chain)
        if after is not None:
            await after
        if self._local is not None:
            return snap, None
        return snap, await self.reservations.pending(_since(snap), snap.now_ms)

    # --- deciding -------------------------------------------------------------------

    def cluster(self, snap: ViewSnapshot, pending: dict[str, Load] | None, model: str, age_ms: float,
                exclude: Collection[str] = ()) -> ClusterSnapshot:
        """The policy's picture of one read (:func:`~conductor.routing.snapshot.build_cluster`),
        without the cordoned and draining nodes (control) and the instances in ``exclude`` (a
        gateway's retry after one of them failed). ``pending`` None: the reservations are
        the in-memory ones, and the picture is the model's :class:`ClusterIndex` brought up
        to this read (the same instances, redone only where something changed)."""
        if pending is None:
            local = self._local
            assert local is not None
            touched = local.take_touched()
            for index in self._indexes.values():
                index.touch(touched)
            if not exclude:
                key = (model, self.control.excluded)
                ix = self._indexes.get(key)
                if ix is None:
                    if len(self._indexes) >= MAX_INDEXES:
                        self._indexes.clear()
                    ix = self._indexes[key] = ClusterIndex(self.profile, block_size=self.settings.block_size,
                                                           ttl_s=self.ttl_s, model=model, exclude=key[1])
                ix.update(snap, local.pending_one)
                return ix.snapshot(snap, age_ms)
            pending = local.pending_sync(_since(snap), snap.now_ms)
        if self.control.excluded:
            exclude = self.control.excluded.union(exclude)
        return build_cluster(snap, pending, block_size=self.settings.block_size, ttl_s=self.ttl_s, model=model,
                             age_ms=age_ms, memo=self._memo, exclude=exclude)

    async def route(self, req: RoutingRequest, ordinal: int = 0, after: Awaitable[Any] | None = None, *,
                    decided_by: str | None = None) -> RoutingDecision | RoutingRejection:
        """Place one request (or reject it with a reason); records the reservation.

        ``ordinal`` is the request's position in the log (its ``requests`` offset), which
        order-based policies rotate by. ``after``: when several reads are in flight at once,
        what this decision waits for between its read and its decision (the previous
        request's decision), so decisions happen, and reserve, in the log's order whatever
        order the reads come back in: the order `explain` re-derives them in. ``decided_by``: the
        process deciding where the request arrived (:mod:`conductor.routing.local`); its decision
        records it and ``ordinal``, which is then not the request's offset."""
        t0 = time.perf_counter()
        times = StageTimes(time.perf_counter)
        seed = request_seed(self.settings.seed, req.request_id)
        try:
            chain = self.chain_of(req)
        except InvalidRequest as e:
            return self.reject(req.request_id, "invalid_request", str(e), seed=seed)
        preq = self.policy_request(req, len(chain), ordinal)
        times.start()
        r = await self._read_or_last(req, chain, after, seed)
        if isinstance(r, RoutingRejection):
            return r
        times.mark(VIEW_READ)
        cluster, choice, exclude = self._decide(req, preq, r, seed, times)
        snap, age_ms = r.snap, r.age_ms
        answer = choice.decision
        if isinstance(answer, Rejection) and answer.reason == "no_live_instance":
            answer = Rejection(answer.reason, f"{answer.message} ({why_none(snap, self.ttl_s, req.model, exclude, self.control.excluded)})")
        self.metrics.latency.record((time.perf_counter() - t0) * 1000.0)
        self._report_stages(times)
        out = decision_record(req, answer, block_size=self.settings.block_size, policy=self.policy.name,
                              params=self.params, seed=seed, watermark=cluster.watermark, degraded=r.degraded,
                              age_ms=age_ms, degraded_reason=r.why if r.degraded else "",
                              rederivation={**self._rederivation(), "view_now_ms": snap.now_ms + int(age_ms)},
                              options=choice.options, endpoints=_endpoints(answer, _instance_of(cluster)))
        if decided_by is not None and isinstance(out, RoutingDecision):
            out = out.model_copy(update={"decided_by": decided_by, "ordinal": ordinal})
        if isinstance(out, RoutingRejection):
            self.metrics.rejections.add(1, {"reason": out.reason})
            return out
        await self._reserve(req, out, snap.now_ms + int(age_ms))
        self._count(req, out)
        return out

    async def _read_or_last(self, req: RoutingRequest, chain: Sequence[int], after: Awaitable[Any] | None,
                            seed: int) -> _Read | RoutingRejection:
        """One view read and the reservations pending against it; when the view is unreachable or
        not the truth, the last read's node states (degraded, prefixes unknown) while they are
        younger than ``max_snapshot_age_s``, else the rejection that says so."""
        why = ""
        try:
            healthy, why = await self.view_health()
            if not healthy:  # lost or being rebuilt: an empty or partial view is not the truth
                raise _Unhealthy(why)
            snap, pending = await self.read(chain, after)
            self._last = _LastView(ViewSnapshot(snap.now_ms, snap.nodes, {}, snap.watermark), self.clock())
            return _Read(snap, pending, False, 0.0, why)
        except (ViewStoreError, OSError, TimeoutError, _Unhealthy) as e:
            last = self._last
            age_ms = (self.clock() - last.at) * 1000.0 if last else float("inf")
            rebuilding = isinstance(e, _Unhealthy)
            why = str(e) if rebuilding else f"view unreachable: {e}"
            if last is None or age_ms > self.settings.max_snapshot_age_s * 1000.0:
                return self.reject(
                    req.request_id, "view_rebuilding" if rebuilding else "view_unavailable",
                    (f"the view is not the truth yet ({e})" if rebuilding else f"the view is unreachable ({e})")
                    + " and the last snapshot is " + ("missing" if last is None else f"{age_ms / 1000:.1f}s old"),
                    seed=seed,
                )
            if after is not None:
                await after
            snap = last.snapshot  # node states only: prefixes of this chain are unknown
            pending = await self.reservations.pending(_since(snap), snap.now_ms + int(age_ms))
            return _Read(snap, pending, True, age_ms, why)

    def _decide(self, req: RoutingRequest, preq: PolicyRequest, r: _Read, seed: int,
                times: StageTimes) -> tuple[ClusterSnapshot, ModeChoice, Collection[str]]:
        """The picture (:meth:`cluster`) and the decision on it, with the instances left out."""
        # Cordoned and draining nodes take no new requests; a retry names the instances that failed it;
        # a gateway's request names no engine it cannot reach.
        exclude: Collection[str] = req.exclude
        cluster = self.cluster(r.snap, r.pending, req.model, r.age_ms, exclude)
        times.mark(CLUSTER)
        choice = decide_mode(self.policy, preq, cluster, random.Random(seed), times.mark)
        if req.reachable is not None and _names_unreachable(choice.decision, _instance_of(cluster), req.reachable):
            # Rare (every engine announces its URL): decide again without the engines this
            # gateway cannot reach, so the answer is the same whenever it is re-derived.
            reachable = set(req.reachable)
            exclude = {i.node_id for i in cluster.instances
                       if i.endpoint is None and i.role != "store" and i.node_id not in reachable}.union(exclude)
            cluster = self.cluster(r.snap, r.pending, req.model, r.age_ms, exclude)
            times.mark(CLUSTER)
            choice = decide_mode(self.policy, preq, cluster, random.Random(seed), times.mark)
        return cluster, choice, exclude

    def _report_stages(self, times: StageTimes) -> None:
        """Each stage's time into the metrics (and to :attr:`on_stages`)."""
        ms = times.ms()
        for stage, v in ms.items():
            self.metrics.stages.record(v, {"stage": stage})
        if self.on_stages is not None:
            self.on_stages(ms)

    def _count(self, req: RoutingRequest, out: RoutingDecision) -> None:
        """A placement into the metrics: reuse, the instances, the prompt tokens routed and reused."""
        self.metrics.reuse.record(out.reused_tokens / req.prompt_tokens if req.prompt_tokens else 0.0)
        self.metrics.decisions.add(1, {"prefill": out.prefill_instance, "decode": out.decode_instance})
        node = {"node": out.prefill_instance}
        self.metrics.routed_prompt.add(req.prompt_tokens, node)
        if out.reuse_source == out.prefill_instance:
            self.metrics.predicted_reuse.add(out.reused_tokens, node)

    async def view_health(self) -> tuple[bool, str]:
        """Whether the view is the truth (it has a generation and no partition is being rebuilt
        from the log), asked of the view at most every ``HEALTH_EVERY_S``; views that cannot
        tell (in-memory, replays) are always healthy."""
        view = self.view
        if not isinstance(view, HealthTellingView):
            return True, ""
        now = self.clock()
        if self._health is None or now - self._health[0] >= HEALTH_EVERY_S:
            healthy, why = await view.view_health()
            if not healthy and why.startswith("view unreachable"):
                healthy = True  # the read itself fails and says so (view_unavailable)
            if (healthy, why) != (self._health or (0, True, ""))[1:]:
                (log.info if healthy else log.warning)("view %s", "healthy again" if healthy else why)
            self._health = (now, healthy, why)
        return self._health[1], self._health[2]

    def _rederivation(self) -> dict[str, Any]:
        """What `explain` needs besides the log: the control offset, block size and profile."""
        return {"control_offset": self.control.offset, "block_size": self.settings.block_size,
                "model_profile": self.settings.model_profile}

    async def _reserve(self, req: RoutingRequest, d: RoutingDecision, now_ms: int) -> None:
        try:
            await self.reservations.reserve(decision_reservations(req, d, self.settings.block_size), now_ms)
        except (ViewStoreError, OSError) as e:
            log.warning("reservation not recorded for %s: %s", req.request_id, e)

    def reject(self, request_id: str, reason: RejectReason, message: str, *, seed: int = 0,
               watermark: dict[str, int] | None = None) -> RoutingRejection:
        self.metrics.rejections.add(1, {"reason": reason})
        return rejection_record(request_id, reason, message, policy=self.policy.name, params=self.params, seed=seed,
                                watermark=watermark, rederivation=self._rederivation())

    # --- one Kafka record --------------------------------------------------------------

    async def handle(self, value: bytes | None, key: bytes | None, offset: int = 0) -> tuple[str, Any]:
        """Turn one ``requests`` record (at ``offset``) into (dispatch key, body) or ("", DecodeError).

        Returns the body to produce: a decision, a rejection (an unreadable record whose key
        names a request id, too), the record's :class:`DecodeError` when no request id is
        anywhere (the record is only dead-lettered), or :data:`DECIDED` for a request its
        ``decided_by`` decided and logged already (nothing to produce).
        """
        key_out, out, _ = await self.handle_with_reply(value, key, offset)
        if isinstance(out, Unreadable):
            return key_out, out.rejection or out.error
        return key_out, out

    async def handle_with_reply(self, value: bytes | None, key: bytes | None, offset: int = 0,
                                after: Awaitable[Any] | None = None) -> tuple[str, Any, str | None]:
        """:meth:`handle`, plus the gateway id the answer also goes to (the request's ``reply_to``);
        ``after`` as in :meth:`route`. An unreadable record comes back :class:`Unreadable` (to
        dead-letter; with a rejection to dispatch under ``key`` when it names a request id)."""
        key_id = _key_text(key)
        try:
            env = decode(value or b"")
            body = env.body
            if not isinstance(body, RoutingRequest):
                raise DecodeError("wrong_kind", f"a {body.kind} record on the requests topic")
        except DecodeError as e:
            if not key_id:
                return "", Unreadable(e, None), None
            return key_id, Unreadable(e, self.reject(key_id, "invalid_request", str(e))), None
        if body.decided_by is not None:
            return "", DECIDED, None
        try:
            out = await self.route(body, offset, after)
        except Exception as e:  # a bug must not turn one request into a crash loop of every replica
            log.exception("routing %s failed", body.request_id)
            out = self.reject(body.request_id, "invalid_request", f"router error: {type(e).__name__}: {e}")
        return (out.prefill_instance if isinstance(out, RoutingDecision) else out.request_id), out, body.reply_to


DECIDED = object()
"""What :meth:`Router.handle_with_reply` returns for a request decided where it arrived (its
``decided_by``'s own decision is on ``dispatch`` already): nothing to produce."""


@dataclass(frozen=True)
class Unreadable:
    """A ``requests`` record that is no request: dead-lettered with ``error``'s reason, and
    ``rejection`` (when its key names a request id) sent to dispatch as any rejection."""

    error: DecodeError
    rejection: RoutingRejection | None


def default_router_id() -> str:
    return f"router-{socket.gethostname()}-{os.getpid()}"


def _key_text(key: bytes | None) -> str:
    if not key:
        return ""
    try:
        return key.decode("utf-8")[:256]
    except UnicodeDecodeError:
        return ""


# --- the Kafka loop -------------------------------------------------------------------


class RouterWorker:
    """Consumes ``requests`` in a consumer group and produces onto ``dispatch``."""

    GROUP = "conductor-router"

    def __init__(self, settings: Settings, router: Router, *, router_id: str | None = None,
                 decisions: DecisionIndex | None = None) -> None:

        self.settings = settings
        self.router = router
        self.decisions = decisions
        """Where each decision landed on dispatch, for `explain` (written after the broker's ack,
        in the background; None: not kept, explain scans)."""
        self._indexing: asyncio.Task[None] | None = None
        self.topics = topics(settings.topic_config())
        self.router_id = router_id or default_router_id()
        self._seq = 0
        self.routed = 0
        self.lag: dict[int, int] = {}  # requests partition → records not yet routed (the last fetch's view)

        def observe_lag(_: Any) -> list[metrics.Observation]:
            return [metrics.Observation(v, {"partition": str(p)}) for p, v in self.lag.items()]

        metrics.get_meter(__name__).create_observable_gauge(
            "conductor_router_consumer_lag", callbacks=[observe_lag],
            description="requests not yet routed by this router, per partition")

    def _wrap(self, body: Any) -> Envelope:
        self._seq += 1
        return envelope(body, producer_id=self.router_id, producer_seq=self._seq, ts_ms=int(time.time() * 1000))

    def _in_order(self, records: Sequence[Any]) -> list[Awaitable[tuple[str, Any, str | None]]]:
        """One handling per record, each deciding only after the one before it is done."""
        loop = asyncio.get_running_loop()
        out: list[Awaitable[tuple[str, Any, str | None]]] = []
        before: asyncio.Future[None] | None = None
        for rec in records:
            done: asyncio.Future[None] = loop.create_future()
            out.append(self._handle_then(rec, before, done))
            before = done
        return out

    async def _handle_then(self, rec: Any, after: asyncio.Future[None] | None,
                           done: asyncio.Future[None]) -> tuple[str, Any, str | None]:
        try:
            return await self.router.handle_with_reply(rec.value, rec.key, rec.offset, after)
        finally:
            if after is not None:
                await after  # a rejection may return early: the next decision still waits for the earlier ones
            if not done.done():
                done.set_result(None)

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:

        t = self.topics
        await ensure_topics(self.settings.kafka(), (t.requests, t.dispatch, t.dead_letter, t.control))
        prod = producer(self.settings.kafka(), linger_ms=0)  # a waiting gateway's reply goes out at once
        # The embedded broker answers a fetch only when its wait runs out, new records or not:
        # a short wait keeps a waiting gateway's decision from sitting there (Kafka returns early).
        cons = consumer(self.settings.kafka(), t.requests.name, group_id=self.settings.topic_prefix + self.GROUP,
                        **({"fetch_max_wait_ms": self.settings.embedded_fetch_wait_ms} if self.settings.embedded else {}))
        control = ControlFollower(self.settings, self.router)
        letters = DeadLetters(self.settings.kafka(), t.dead_letter, self.router_id, producer=prod, wrap=self._wrap)
        await prod.start()
        await control.start()  # caught up with every control record before the first decision
        await cons.start()
        await self.router.start()
        try:
            if ready is not None:
                ready.set()
            while not stop.is_set():
                await control.poll()
                batches = await cons.getmany(timeout_ms=200, max_records=500)
                if not batches:
                    continue
                sends = []
                placed: list[tuple[int, Envelope, Any, int, int]] = []  # (send, env, decision, request position)
                n = self.settings.router_concurrency
                for tp, records in batches.items():
                    hw = cons.highwater(tp)
                    if hw is not None:
                        self.lag[tp.partition] = max(0, hw - records[-1].offset - 1)
                    # Up to n view reads in flight at once; the decisions still happen one after
                    # another in offset order (each waits for the one before it between its read
                    # and its decision), so each sees the reservations of those before it, and
                    # the order of dispatch is the order they were made in.
                    handled = []
                    for i in range(0, len(records), n):
                        handled += await asyncio.gather(*self._in_order(records[i : i + n]))
                    # Metadata of every reply topic first, before this batch's first send: a new
                    # topic's metadata fetch that ran while a dispatch batch waited in the producer was
                    # seen to strand that batch (its delivery never came, the loop stalled for good).
                    for gateway in {r for _, _, r in handled if r}:
                        with contextlib.suppress(ValueError):
                            await prod.partitions_for(t.replies(gateway).name)
                    for rec, (key, out, reply_to) in zip(records, handled):
                        if out is DECIDED:
                            continue
                        if isinstance(out, Unreadable):
                            sends.append(await letters.send(tp.topic, tp.partition, rec.offset, out.error.reason,
                                                            str(out.error), rec.value, rec.key))
                            if out.rejection is None:
                                continue
                            out = out.rejection
                        env = self._wrap(out)
                        raw, hdrs = encode(env), headers(env)
                        placed.append((len(sends), env, out, tp.partition, rec.offset))
                        sends.append(await prod.send(t.dispatch.name, raw, key=key.encode(), headers=hdrs))
                        if reply_to:
                            # The waiting gateway reads only its own topic; dispatch stays the audit log.
                            try:
                                reply = t.replies(reply_to)
                            except ValueError as e:
                                log.warning("request %s: no reply sent: %s", out.request_id, e)
                            else:
                                sends.append(await prod.send(reply.name, raw, key=out.request_id.encode(),
                                                             headers=hdrs))
                        self.routed += 1
                await acknowledged(prod, sends, warn_after_s=10.0, what="dispatch record(s)")
                await self._index(sends, placed)
                await cons.commit()
        finally:
            if self._indexing is not None:
                with contextlib.suppress(Exception):
                    await self._indexing
            await self.router.close()
            await cons.stop()
            await control.stop()
            await prod.stop()


    async def _index(self, sends: Sequence[Any], placed: Sequence[tuple[int, Envelope, Any, int, int]]) -> None:
        """Hand the batch's dispatch positions to the decision index, in the background; a
        batch waits only if the one before it is still being written (Redis slower than routing)."""
        if self.decisions is None or not placed:
            return
        positions = []
        for i, env, out, req_partition, req_offset in placed:
            md = sends[i].result()
            positions.append(DecisionPosition(out.request_id, md.partition, md.offset, env.ts_ms, req_partition,
                                              req_offset))
        if self._indexing is not None and not self._indexing.done():
            await asyncio.wait([self._indexing])
        self._indexing = asyncio.create_task(self._write_index(self.decisions, positions))

    @staticmethod
    async def _write_index(index: DecisionIndex, positions: list[DecisionPosition]) -> None:
        try:
            await index.record(positions)
        except ViewStoreError as e:  # explain falls back to a scan for these
            log.warning("%s", e)


class ControlFollower:
    """Reads the one-partition ``control`` topic from the start (every replica, no group) and
    hands each record to :meth:`Router.apply_control` in offset order."""

    def __init__(self, settings: Settings, router: Router) -> None:
        self.settings = settings
        self.router = router
        self.topic = topics(settings.topic_config()).control
        self._cons: Any = None
        self.position = 0  # the next offset to read

    async def start(self, catch_up_timeout_s: float = 10.0) -> None:
        tp = TopicPartition(self.topic.name, 0)
        self._cons = consumer(self.settings.kafka(), group_id=None)
        await self._cons.start()
        self._cons.assign([tp])
        end = (await end_offsets(self._cons, [tp]))[tp]
        await self._cons.seek_to_beginning(tp)
        deadline = time.monotonic() + catch_up_timeout_s
        while self.position < end and time.monotonic() < deadline:
            await self.poll(timeout_ms=200)

    async def poll(self, timeout_ms: int = 0) -> None:
        got = await self._cons.getmany(timeout_ms=timeout_ms, max_records=100)
        for msgs in got.values():
            for m in msgs:
                self.position = m.offset + 1
                try:
                    env = decode(m.value or b"")
                except DecodeError as e:
                    log.error("control offset %d unreadable, skipped: %s", m.offset, e)
                    continue
                if isinstance(env.body, ControlCommand):
                    self.router.apply_control(env.body, m.offset)

    async def stop(self) -> None:
        if self._cons is not None:
            await self._cons.stop()


def redis_stores(settings: Settings, producer_id: str | None = None) -> tuple[Any, Any]:
    """The Redis view reader and reservation log of ``settings``, with short timeouts.

    Timeouts are short on purpose: a router that waits on a dead Redis answers nobody;
    one that fails fast answers from its last snapshot.
    """


    if not settings.redis_url:
        raise ViewStoreError("redis_url is not set (start the embedded stack with `conductor dev up`)")
    url = settings.redis().connection_url()
    client = open_client(
        url, decode_responses=False, **settings.redis().tls_options(), socket_timeout=0.5, socket_connect_timeout=0.5,
        health_check_interval=0, connection_class=HiredisPackedConnection,
    )
    view = RedisViewStore(client, settings.view_namespace)
    # The raw reader speaks plain RESP (with AUTH user password), to one server or to the
    # primary of the namespace's one slot of a Redis Cluster; TLS (rediss://) and unix sockets
    # read through redis-py.
    raw = url.startswith(("redis://", "redis+cluster://"))
    if settings.view_reader == "tracking":
        if not raw:
            raise ConfigError("view_reader (CONDUCTOR_VIEW_READER) 'tracking' needs a redis:// or redis+cluster:// "
                              f"URL (CONDUCTOR_REDIS_URL is {url.split('://')[0]}://); use 'raw'")
        reader: Any = TrackingSnapshotReader(url, settings.view_namespace, cache_keys=settings.view_cache_keys,
                                             store=view)
    else:
        reader = RawSnapshotReader(url, settings.view_namespace, store=view) if raw else view
    return (reader,
            RedisReservations(client, settings.view_namespace, settings.reservation_ttl_s,
                              producer_id=producer_id or default_router_id()))


def decision_index(settings: Settings, client: Any = None) -> RedisDecisionIndex | None:
    """The decision index of ``settings`` (None when ``decision_index_ttl_s`` is 0), on ``client``
    (the reservations' connection, for a router) or on a connection of its own."""
    ttl_s = settings.decision_index_ttl_s
    if settings.audit_retention_ms >= 0:
        ttl_s = min(ttl_s, settings.audit_retention_ms / 1000)
    if ttl_s <= 0 or not settings.redis_url:
        return None
    if client is None:
        client = open_client(settings.redis().connection_url(), decode_responses=False,
                             **settings.redis().tls_options(), socket_timeout=5.0, socket_connect_timeout=5.0)
    return RedisDecisionIndex(client, settings.view_namespace, ttl_s)


__all__ = [
    "InvalidRequest", "RawSnapshotReader", "Router", "RouterWorker", "decision_index", "default_router_id",
    "redis_stores", "request_seed",
]
