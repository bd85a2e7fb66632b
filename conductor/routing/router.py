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

import dataclasses
import hashlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from opentelemetry import metrics

from conductor.costmodel.profiles import ModelProfile, load_profile
from conductor.errors import ViewStoreError
from conductor.routing.control import ControlState, apply_control
from conductor.routing.decision import decision_record, decision_reservations, rejection_record
from conductor.routing.decision_time import DecisionTime
from conductor.routing.index import ClusterIndex
from conductor.routing.own_load import OwnLoads
from conductor.routing.policies import Placement, Policy, Rejection, make_policy
from conductor.routing.policies.mode import ModeChoice, decide_mode
from conductor.routing.policies.prefill_plan import CACHE_FULL
from conductor.routing.policies.stages import CLUSTER, VIEW_READ, StageTimes
from conductor.routing.snapshot import ClusterSnapshot, Instance, InstanceMemo, PolicyRequest, Shape, build_cluster
from conductor.settings import Settings
from schemas import (
    ControlCommand,
    DecodeError,
    Endpoint,
    RejectReason,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
    decode,
    request_chain_keys,
)
from schemas.records import MAX_BLOCKS
from state.inflight import InflightLedger
from state.pending import PendingStore
from state.reservations import InMemoryReservations, Load, RedisReservations, Reservation, ReservationStore
from state.view import ViewReader, ViewSnapshot

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
    copyable: dict[str, Shape] | None = None
    """What other instances may copy where pending blocks extend a prefix (``decision_time.Seen``)."""


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
        self.left_holder = m.create_counter(
            "conductor_router_left_holder",
            description="decisions that left the holder of the request's longest prefix, by reason (better_ttft: "
            "another instance faster by more than the stay margin; cache_full: spilled to a capacity-group mate)",
        )
        self.lost_charges = m.create_counter(
            "conductor_router_lost_producer_charges",
            description="in-flight charges ended here for the process that made them, by producer and reason "
            "(gateway_lost: it went silent; gateway_restarted: this process's own id, left open by its earlier run)",
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
        pending: PendingStore | None = None,
        inflight: InflightLedger | None = None,
    ) -> None:
        """``incremental``: keep the cluster picture from read to read (a
        :class:`~conductor.routing.index.ClusterIndex` per model, when the reservations are
        held in memory or the loads are the ledger's); False rebuilds it from every read
        (``explain`` does, as the check).

        ``pending`` (decision-time prefixes): later decisions count the blocks earlier ones
        placed as held in HBM by the instances they were placed on, *trusted as if confirmed*
        for the store's TTL (the placing request's prefill puts them there, and a request that
        follows it queues behind it, so by the time it runs they are there; a failure releases
        them, the engine's own events confirm or evict them); every placement records its
        chain on its prefill instance and, disaggregated, on its decode instance, in the same
        step as its decision. ``inflight`` (Conductor's own load): each instance's load is, per
        quantity, the larger of its heartbeat and the ledger's in-flight work (over its
        capacity group), instead of heartbeat + reservations; every placement charges it.
        None (either): today's behaviour (the simulator and the tests that pass none)."""
        self.settings = settings
        self.view = view
        self.reservations = reservations
        self.profile = profile or load_profile(settings.model_profile)
        self.topology = settings.cluster_topology()
        # Validates the configured name and params at start-up (ConfigError otherwise).
        self.policy = policy or make_policy(settings.policy, settings.policy_params, self.profile, self.topology)
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
        self.decision_time = DecisionTime(settings, self.topology, pending, inflight)
        """Pending blocks, the in-flight ledger, sessions and the decision clock
        (:mod:`conductor.routing.decision_time`)."""
        self._incremental = incremental

    # What the decision-time stores hold, as the router's callers read them.
    @property
    def pending(self) -> PendingStore | None:
        return self.decision_time.pending

    @property
    def inflight(self) -> InflightLedger | None:
        return self.decision_time.inflight

    @property
    def own(self) -> OwnLoads | None:
        """The ledger as the picture reads it (None: heartbeats plus reservations)."""
        return self.decision_time.own

    @property
    def sessions(self) -> OrderedDict[str, str]:
        """Session key -> the prefill instance this router placed the session on last: the
        request's ``session_instance``, the stay rule's holder; each decision records it."""
        return self.decision_time.sessions

    @property
    def pending_ttl_ms(self) -> int:
        return self.decision_time.pending_ttl_ms

    @property
    def inflight_lease_ms(self) -> int:
        return self.decision_time.inflight_lease_ms

    def use_decision_time(self, pending: PendingStore | None, inflight: InflightLedger | None) -> None:
        """Decide with these pending blocks and this in-flight ledger from now on (None: without;
        ``explain`` gives the ones it re-derived from the log); the sessions are kept."""
        self.decision_time = DecisionTime(self.settings, self.topology, pending, inflight, self.decision_time.sessions)
        self._indexes.clear()  # their loads were counted the other way

    async def start(self) -> None:
        """Start following the shared reservations, pending blocks and ledger (a no-op for
        in-memory ones)."""
        now_ms = int(time.time() * 1000)
        if isinstance(self.reservations, SharedReservations):
            await self.reservations.start(now_ms)
        await self.decision_time.start(now_ms)

    async def close(self) -> None:
        """Share the last reservations, pending blocks and charges, and stop following (the
        reservations last: they close the followers' client, ``conductor.routing.stores``)."""
        await self.decision_time.close()
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
            session_instance=self.decision_time.session_of(req.session),
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
        if self._local is not None or self.own is not None:
            return snap, None
        return snap, await self.reservations.pending(_since(snap), snap.now_ms)

    def at_decision(self, snap: ViewSnapshot, chain: Sequence[int], age_ms: float = 0.0,
                    degraded: bool = False) -> tuple[ViewSnapshot, int]:
        """The read as the decision sees it, and the decision's time (``view_now_ms``):
        :meth:`DecisionTime.at_decision <conductor.routing.decision_time.DecisionTime.at_decision>`."""
        seen = self.decision_time.at_decision(snap, chain, age_ms, degraded)
        return seen.snap, seen.at_ms

    # --- deciding -------------------------------------------------------------------

    def cluster(self, snap: ViewSnapshot, pending: dict[str, Load] | None, model: str, age_ms: float,
                exclude: Collection[str] = ()) -> ClusterSnapshot:
        """The policy's picture of one read (:func:`~conductor.routing.snapshot.build_cluster`),
        without the cordoned and draining nodes (control) and the instances in ``exclude`` (a
        gateway's retry after one of them failed). ``pending`` None: the reservations are
        the in-memory ones, and the picture is the model's :class:`ClusterIndex` brought up
        to this read (the same instances, redone only where something changed). With the
        in-flight ledger (:attr:`own`), ``pending`` is None and the loads are its own instead."""
        if pending is None and self.own is not None:
            return self._cluster_own(self.own, snap, model, age_ms, exclude)
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

    def _cluster_own(self, own: OwnLoads, snap: ViewSnapshot, model: str, age_ms: float,
                     exclude: Collection[str]) -> ClusterSnapshot:
        """:meth:`cluster` with each instance's load the larger of its heartbeat and the ledger's."""
        now = snap.now_ms + int(age_ms)
        touched = own.take_touched(now)
        touched |= own.hear(snap.nodes)
        for index in self._indexes.values():
            index.touch(touched)
        if self._incremental and not exclude:
            key = (model, self.control.excluded)
            ix = self._indexes.get(key)
            if ix is None:
                if len(self._indexes) >= MAX_INDEXES:
                    self._indexes.clear()
                ix = self._indexes[key] = ClusterIndex(self.profile, block_size=self.settings.block_size,
                                                       ttl_s=self.ttl_s, model=model, exclude=key[1])
            ix.update(snap, _no_reservations, own.extra)
            return ix.snapshot(snap, age_ms)
        if self.control.excluded:
            exclude = self.control.excluded.union(exclude)
        return build_cluster(snap, own.extras(snap.nodes, now), block_size=self.settings.block_size, ttl_s=self.ttl_s,
                             model=model, age_ms=age_ms, memo=self._memo, exclude=exclude)

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
        seen = self.decision_time.at_decision(r.snap, chain, r.age_ms, r.degraded)
        snap, at = seen.snap, seen.at_ms
        if snap is not r.snap:
            r = _Read(snap, r.pending, r.degraded, r.age_ms, r.why, seen.copyable)
        times.mark(VIEW_READ)
        cluster, choice, exclude = self._decide(req, preq, r, seed, times)
        age_ms = r.age_ms
        answer = choice.decision
        if isinstance(answer, Rejection) and answer.reason == "no_live_instance":
            answer = Rejection(answer.reason, f"{answer.message} ({why_none(snap, self.ttl_s, req.model, exclude, self.control.excluded)})")
        self.metrics.latency.record((time.perf_counter() - t0) * 1000.0)
        self._report_stages(times)
        out = decision_record(req, answer, block_size=self.settings.block_size, policy=self.policy.name,
                              params=self.params, seed=seed, watermark=cluster.watermark, degraded=r.degraded,
                              age_ms=age_ms, degraded_reason=r.why if r.degraded else "",
                              rederivation={**self._rederivation(), "view_now_ms": at},
                              options=choice.options, endpoints=_endpoints(answer, _instance_of(cluster)))
        if isinstance(out, RoutingRejection):
            self.metrics.rejections.add(1, {"reason": out.reason})
            return out
        out = out.model_copy(update=self._decision_fields(out, cluster, decided_by, ordinal, preq))
        # Recorded in the same step as the decision (no await since the read): the next
        # decision, whichever router makes it, sees this one's blocks and work.
        self.decision_time.record(req, chain, out, at)
        if self.own is None:
            await self._reserve(req, out, at)
        self._count(req, out)
        return out

    def _decision_fields(self, out: RoutingDecision, cluster: ClusterSnapshot, decided_by: str | None,
                         ordinal: int, preq: PolicyRequest) -> dict[str, Any]:
        """What a placement's record adds to the policy's answer: who decided it and at which turn
        (a colocated router), how its pending blocks and loads were counted, and the work queued
        ahead of it on its prefill instance."""
        fields: dict[str, Any] = {}
        if decided_by is not None:
            fields["decided_by"] = decided_by
            fields["ordinal"] = ordinal
        if preq.session_instance is not None:
            fields["session_instance"] = preq.session_instance
        fields.update(self.decision_time.fields())
        if self.own is None and isinstance(self.reservations, RedisReservations):
            # What the replicas' reservations had reached here, and this one's number: taken next,
            # in this step (``_reserve`` numbers it before any wait).
            fields["seen_reservations"] = self.reservations.cut()
            fields["reservation_event"] = self.reservations.events.last + 1
            fields["reservation_producer"] = self.reservations.producer_id
        pre = _instance_of(cluster)(out.prefill_instance)
        if pre is not None:
            fields["queued_tokens_ahead"] = pre.queued_prefill_tokens
        return fields

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
            pending = (None if self.own is not None else
                       await self.reservations.pending(_since(snap), snap.now_ms + int(age_ms)))
            return _Read(snap, pending, True, age_ms, why)

    def _decide(self, req: RoutingRequest, preq: PolicyRequest, r: _Read, seed: int,
                times: StageTimes) -> tuple[ClusterSnapshot, ModeChoice, Collection[str]]:
        """The picture (:meth:`cluster`) and the decision on it, with the instances left out."""
        # Cordoned and draining nodes take no new requests; a retry names the instances that failed it;
        # a gateway's request names no engine it cannot reach.
        exclude: Collection[str] = req.exclude
        cluster = self._with_copyable(self.cluster(r.snap, r.pending, req.model, r.age_ms, exclude), r)
        times.mark(CLUSTER)
        choice = decide_mode(self.policy, preq, cluster, random.Random(seed), times.mark)
        if req.reachable is not None and _names_unreachable(choice.decision, _instance_of(cluster), req.reachable):
            # Rare (every engine announces its URL): decide again without the engines this
            # gateway cannot reach, so the answer is the same whenever it is re-derived.
            reachable = set(req.reachable)
            exclude = {i.node_id for i in cluster.instances
                       if i.endpoint is None and i.role != "store" and i.node_id not in reachable}.union(exclude)
            cluster = self._with_copyable(self.cluster(r.snap, r.pending, req.model, r.age_ms, exclude), r)
            times.mark(CLUSTER)
            choice = decide_mode(self.policy, preq, cluster, random.Random(seed), times.mark)
        return cluster, choice, exclude

    @staticmethod
    def _with_copyable(cluster: ClusterSnapshot, r: _Read) -> ClusterSnapshot:
        """``cluster`` saying what may be copied where pending blocks extend a prefix."""
        return cluster if not r.copyable else dataclasses.replace(cluster, copyable=r.copyable)

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
        if out.left_holder:
            self.metrics.left_holder.add(1, {"reason": "cache_full" if out.left_holder.startswith(CACHE_FULL)
                                             else "better_ttft"})

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

    async def unreserve(self, req: RoutingRequest, d: RoutingDecision) -> None:
        """Take back the reservation of a decision that will not be served (the log did not take
        it): the same amounts negated, at the same time as the reservation, so that every window
        that counts the one counts the other, on this router and on every replica that follows."""
        if self.own is not None or d.view_now_ms is None:
            return  # an own-load ledger charged it instead (released by decision_time.end)
        back = [Reservation(r.node, Load(*(-a for a in r.load.as_tuple())))
                for r in decision_reservations(req, d, self.settings.block_size)]
        try:
            await self.reservations.reserve(back, d.view_now_ms)
        except (ViewStoreError, OSError) as e:
            log.warning("reservation of %s not taken back: %s", req.request_id, e)

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


def _no_reservations(node: str, since_ms: int, now_ms: int) -> tuple[Load | None, int | None]:
    return None, None


DECIDED = object()
"""What :meth:`Router.handle_with_reply` returns for a request decided where it arrived (its
``decided_by``'s own decision is on ``dispatch`` already): nothing to produce."""


@dataclass(frozen=True)
class Unreadable:
    """A ``requests`` record that is no request: dead-lettered with ``error``'s reason, and
    ``rejection`` (when its key names a request id) sent to dispatch as any rejection."""

    error: DecodeError
    rejection: RoutingRejection | None


def _key_text(key: bytes | None) -> str:
    if not key:
        return ""
    try:
        return key.decode("utf-8")[:256]
    except UnicodeDecodeError:
        return ""


__all__ = ["InvalidRequest", "Router", "request_seed"]
