"""Re-derive and explain a past routing decision from the log (``conductor explain``).

A decision on ``dispatch`` names the view watermark it was made on, the policy, its
parameters and the seed. From the topics alone this module rebuilds what the router
saw: the view as of that watermark (``kv-events`` and ``heartbeats`` replayed up to
the recorded offsets into an in-memory store), the in-flight reservations (every
earlier decision on ``dispatch`` still unconfirmed by its nodes' heartbeats), the
request (from ``requests``); then it runs the same :class:`conductor.routing.router.Router`
with the same policy and seed, compares, and lays out the policy's per-instance
estimates so an operator can see *why*.

The instant of the original read is the decision's ``view_now_ms`` (the view's clock the
router read at and stamped its reservations with; decisions older than v3 fall back to
the envelope's timestamp, set a few ms later). What the log cannot give back:
reservations of decisions whose records were lost. A mismatch is reported, never hidden.

A decision made with decision-time knowledge (v5: ``pending_ttl_ms``, ``inflight_lease_ms``)
is re-derived with it, rebuilt from the log by the stores' own folds
(:func:`state.pending.pending_from_log`, :func:`state.inflight.inflight_from_log`): each
earlier decision places its request's chain on its instances and charges its work at its
``view_now_ms``; each ``request-outcomes`` record ends its attempts' work at
``first_token_view_ms`` / ``finished_view_ms`` and, for a failed request, releases its blocks.
Which of those operations count is what the decision's router had applied when it decided, not
what was stamped by then: they reach a router a flush and a round trip after they are made, so
a release stamped before a decision can arrive after it. A v6 decision records, per producer on
each shared stream, the last event it had applied (``seen_pending``, ``seen_inflight``,
``seen_reservations``: the cut, :mod:`state.events`) and its own events; an outcome its releases'. An operation counts
when the cut covers its event (whatever its stamp); one without a number (older records) when
it was stamped by the decision's time. (Confirmations by KV events are not replayed: they change
what a decision sees only for a block evicted within the TTL of being placed; a retried
request's earlier attempts end when the request does.)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from aiokafka import TopicPartition

from conductor.routing.control_log import control_records
from conductor.routing.decision import decision_reservations
from conductor.routing.decision_time import kv_event_capacity, releases_its_work
from conductor.routing.policies import BasePolicy
from conductor.routing.router import Router
from conductor.routing.snapshot import ClusterSnapshot
from conductor.routing.stores import decision_index
from conductor.settings import Settings
from schemas import DecodeError, Envelope, RequestOutcome, RoutingDecision, RoutingRejection, RoutingRequest, decode
from schemas.errors import ConductorError, ViewStoreError
from state.decisions import DecisionIndex, DecisionPosition
from state.inflight import Charged, Finished, FirstToken, InflightOp, inflight_from_log
from state.memory import InMemoryViewStore
from state.pending import PendingOp, Placed, Released, pending_from_log
from state.reservations import InMemoryReservations
from state.view import NodeState, ViewSnapshot
from streams.ingest import Ingestor, RawRecord
from streams.spans import LogReadError, Span, SpanReader
from streams.topics import topics

log = logging.getLogger(__name__)


class AuditError(ConductorError):
    """The decision or its request cannot be found, or cannot be re-derived."""


class ReadLimitExceeded(AuditError):
    """Re-deriving the decision would read more records than the caller allows."""


@dataclass
class Explanation:
    request_id: str
    recorded: dict[str, Any]
    rederived: dict[str, Any]
    matches: bool
    differences: list[str]
    policy: str
    seed: int
    watermark: dict[str, int]
    decided_at_ms: int
    prefill: list[dict[str, Any]] = field(default_factory=list)
    """Per prefill-capable instance: queue wait, reuse plan and predicted TTFT."""
    decode: list[dict[str, Any]] = field(default_factory=list)
    """Per decode-capable instance: batch, free blocks and predicted TBT."""
    reservations: int = 0
    control_offset: int = -1
    """The control offset the decision was made under (-1: no control record yet)."""
    control: dict[str, Any] = field(default_factory=dict)
    """The control state re-derived at that offset (policy, params, cordoned and draining nodes)."""
    stage_ms: dict[str, float] = field(default_factory=dict)
    """Each stage's time in this re-derivation, in ms (``policies/stages.py``; this process's
    times: the deciding router's are in its metrics, ``conductor_router_stage_latency``)."""
    pending_placements: int = 0
    """Earlier decisions whose placements were re-derived as pending blocks (0: none, or the
    decision counted none)."""
    in_flight: int = 0
    """Earlier decisions charged to the re-derived in-flight ledger (0: none, or reservations)."""
    outcomes: int = 0
    """``request-outcomes`` records whose first token, end or failure the re-derivation applied."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


CLOCK_SLACK_MS = 60_000
"""Reads by time compare record timestamps (each producer's clock) with a decision's view time
(Redis's clock): every window starts this much earlier and ends this much later."""

REQUEST_WAIT_MS = 300_000
"""Without the decision index, a decision's request is first looked for this far before the
decision (a router that lagged longer: the search steps further back, to the topic's start)."""

SCAN_STEP = 20_000
"""Records per partition in the first step of a backward scan (each next step doubles)."""


class _Reads:
    """The explain's log reads, counted against its record limit."""

    def __init__(self, log: SpanReader, limit: int | None, limit_name: str) -> None:
        self.log = log
        self.limit = limit
        self.limit_name = limit_name

    def check(self, more: int = 0) -> None:
        if self.limit is not None and self.log.records_read + more > self.limit:
            raise ReadLimitExceeded(f"explaining this decision needs more than {self.limit} log records "
                             f"({self.log.records_read} read, {more} more to read): raise {self.limit_name}")

    async def read(self, spans: Mapping[TopicPartition, Span]) -> AsyncIterator[Sequence[Any]]:
        self.check(0)
        async for batch in self.log.read(spans):
            self.check(0)
            yield batch

    async def envelopes(self, spans: Mapping[TopicPartition, Span]) -> AsyncIterator[tuple[Any, Envelope]]:
        """(record, envelope) of every decodable record (the bad ones were dead-lettered live)."""
        async for batch in self.read(spans):
            for m in batch:
                try:
                    yield m, decode(m.value)
                except DecodeError:
                    continue

    async def window(self, name: str, lo_ms: int, hi_ms: int) -> dict[TopicPartition, Span]:
        """Each partition of ``name`` from its first record at ``lo_ms`` to its first after ``hi_ms``."""
        bounds = await self.log.bounds(await self.log.partitions(name))
        start = await self.log.offsets_at(lo_ms, bounds)
        stop = await self.log.offsets_at(hi_ms + 1, bounds)
        return {tp: Span(start[tp], stop[tp]) for tp in bounds}


async def _indexed(index: DecisionIndex | None, request_ids: Sequence[str]) -> dict[str, DecisionPosition]:
    """The index's entries for ``request_ids``; none when there is no index or it is unreachable
    (the reads fall back to bounded scans)."""
    if index is None:
        return {}
    try:
        return await index.lookup(request_ids)
    except ViewStoreError as e:
        log.warning("decision index unreachable, scanning instead: %s", e)
        return {}


async def _decision(reads: _Reads, name: str, request_id: str, at: DecisionPosition | None) -> tuple[Any, Envelope]:
    """The decision for ``request_id``: at its indexed position, else the newest found by a
    backward scan of ``name`` (the latest one wins if a request was routed twice)."""

    def is_it(env: Envelope) -> bool:
        return isinstance(env.body, (RoutingDecision, RoutingRejection)) and env.body.request_id == request_id

    if at is not None:
        async for m, env in reads.envelopes({TopicPartition(name, at.partition): Span(at.offset, at.offset + 1)}):
            if is_it(env):
                return m, env
    bounds = await reads.log.bounds(await reads.log.partitions(name))
    stop = {tp: b.stop for tp, b in bounds.items()}
    step = SCAN_STEP
    while any(stop[tp] > b.start for tp, b in bounds.items()):
        spans = {tp: Span(max(b.start, stop[tp] - step), stop[tp]) for tp, b in bounds.items() if stop[tp] > b.start}
        found = [(env.ts_ms, m.offset, m, env) async for m, env in reads.envelopes(spans) if is_it(env)]
        if found:
            _, _, m, env = max(found, key=lambda f: (f[0], f[1]))
            return m, env
        stop.update({tp: s.start for tp, s in spans.items()})
        step *= 2
    raise AuditError(f"no decision for request {request_id!r} on {name}")


async def _earlier_decisions(reads: _Reads, name: str, target: Envelope, at_ms: int,
                             ttl_ms: int) -> list[Envelope]:
    """The decisions made before ``target`` whose reservations were still counting when it was
    made (within ``ttl_ms``), in log order: the dispatch records around its time only."""
    body = target.body
    assert isinstance(body, (RoutingDecision, RoutingRejection))
    cut = isinstance(body, RoutingDecision) and any(
        c is not None for c in (body.seen_pending, body.seen_inflight, body.seen_reservations))
    found: list[tuple[int, int, Envelope]] = []
    spans = await reads.window(name, at_ms - ttl_ms - CLOCK_SLACK_MS, at_ms + CLOCK_SLACK_MS)
    async for m, env in reads.envelopes(spans):
        if not isinstance(env.body, RoutingDecision) or _read_at(env) < at_ms - ttl_ms:
            continue
        # Decisions made before this one: by sequence within one router (it decides in the
        # order it numbers, though its reads may come back in another), by time across
        # routers, unless the target recorded what it had seen of the shared streams (then
        # every other decision is a candidate and that cut decides: ``_Seen``). Partitions
        # interleave, so not by position.
        if env.producer_id == target.producer_id and env.epoch == target.epoch:
            earlier = env.producer_seq < target.producer_seq
        else:
            earlier = _read_at(env) < at_ms or (cut and env.body.request_id != body.request_id)
        if earlier:
            found.append((m.partition, m.offset, env))
    return [env for _, _, env in sorted(found, key=lambda f: (f[0], f[1]))]


async def _requests(reads: _Reads, name: str, wanted: set[str], indexed: Mapping[str, DecisionPosition],
                    at_ms: int, ttl_ms: int) -> dict[str, tuple[int, RoutingRequest]]:
    """Each wanted request as the router routed it, with its offset (the ordinal it had): at
    its indexed position, else the last copy on ``name`` before the decision's time, looked for
    backwards from ``REQUEST_WAIT_MS`` before it."""
    out: dict[str, tuple[int, RoutingRequest]] = {}
    at: dict[TopicPartition, dict[int, str]] = {}
    for rid, pos in indexed.items():
        if rid in wanted:
            at.setdefault(TopicPartition(name, pos.request_partition), {})[pos.request_offset] = rid
    spans = {tp: Span(min(offs), max(offs) + 1) for tp, offs in at.items()}
    async for m, env in reads.envelopes(spans):
        named = at[TopicPartition(m.topic, m.partition)].get(m.offset)
        if named is not None and isinstance(env.body, RoutingRequest) and env.body.request_id == named:
            out[named] = (m.offset, env.body)
    missing = wanted - set(out)
    if not missing:
        return out
    window = await reads.window(name, at_ms - ttl_ms - CLOCK_SLACK_MS - REQUEST_WAIT_MS, at_ms + CLOCK_SLACK_MS)
    bounds = await reads.log.bounds(list(window))
    step = SCAN_STEP
    while missing and window:
        found: dict[str, tuple[int, RoutingRequest]] = {}
        async for m, env in reads.envelopes(window):
            if isinstance(env.body, RoutingRequest) and env.body.request_id in missing and (
                    env.body.request_id not in found or m.offset > found[env.body.request_id][0]):
                found[env.body.request_id] = (m.offset, env.body)  # the last copy wins
        out.update(found)
        missing -= set(found)
        window = {tp: Span(max(bounds[tp].start, s.start - step), s.start)
                  for tp, s in window.items() if s.start > bounds[tp].start}
        step *= 2
    return out


async def _view_at(reads: _Reads, settings: Settings, watermark: Mapping[str, int], at_ms: int) -> InMemoryViewStore:
    """The view as of ``watermark``: every ``kv-events`` record up to it (blocks stay until an
    event removes them: the whole history is needed), and the ``heartbeats`` of the last
    ``heartbeat_ttl_s`` (plus the clock slack) before the decision's time (an older heartbeat
    is overwritten by a newer one, or leaves its node dead at that time, where the policy does
    not see it; only a ``no_live_instance`` rejection's message, which lists the dead nodes,
    may name fewer). Partitions the watermark does not name contribute nothing."""
    t = topics(settings.topic_config())
    spans: dict[TopicPartition, Span] = {}
    for name, since_ms in ((t.kv_events.name, None),
                           (t.heartbeats.name, at_ms - int(settings.heartbeat_ttl_s * 1000) - CLOCK_SLACK_MS)):
        bounds = await reads.log.bounds(await reads.log.partitions(name))
        upto = {tp: Span(b.start, min(b.stop, watermark.get(f"{tp.topic}:{tp.partition}", -1) + 1))
                for tp, b in bounds.items()}
        start = await reads.log.offsets_at(since_ms, upto) if since_ms is not None else {}
        spans.update({tp: Span(start.get(tp, s.start), s.stop) for tp, s in upto.items()})
    reads.check(sum(len(s) for s in spans.values()))
    store = InMemoryViewStore()
    ingestor = Ingestor(t, store)
    for tp, span in spans.items():  # one partition after another: the same log folds to one view, node order too
        async for batch in reads.read({tp: span}):
            await ingestor.process([RawRecord(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp or 0)
                                    for m in batch])
    return store


class _ViewAt:
    """The replayed view, read at the decision's time instead of the wall clock."""

    def __init__(self, store: InMemoryViewStore, now_ms: int) -> None:
        self.store = store
        self.now_ms = now_ms

    async def snapshot(self, chain: Any, *, now_ms: int | None = None) -> ViewSnapshot:
        return self.store.snapshot_sync(chain, self.now_ms if now_ms is None else now_ms)

    async def nodes(self) -> list[NodeState]:
        return await self.store.nodes()

    async def watermark(self) -> dict[str, int]:
        return await self.store.watermark()

    async def dump(self) -> dict[str, Any]:
        return await self.store.dump()


def _outcome(rec: RoutingDecision | RoutingRejection) -> dict[str, Any]:
    if isinstance(rec, RoutingRejection):
        return {"rejected": True, "reason": rec.reason, "message": rec.message}
    return {
        "rejected": False,
        "prefill_instance": rec.prefill_instance,
        "decode_instance": rec.decode_instance,
        "reused_tokens": rec.reused_tokens,
        "reuse_source": rec.reuse_source,
        "reuse_tier": rec.reuse_tier,
        "prefill_group": rec.prefill_group,
        "chunk_boundaries": rec.chunk_boundaries,
        "predicted_ttft_s": rec.predicted_ttft_s,
        "predicted_tbt_ms": rec.predicted_tbt_ms,
        "mode": rec.mode,
        "options": [o.model_dump() for o in rec.options],
        "decided_by": rec.decided_by,
        "left_holder": rec.left_holder,
    }


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    keys = ["rejected", "reason", "prefill_instance", "decode_instance", "mode", "reused_tokens", "reuse_source",
            "reuse_tier", "prefill_group", "chunk_boundaries"]
    diffs = [f"{k}: recorded {a.get(k)!r}, re-derived {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
    for k, tol in (("predicted_ttft_s", 1e-6), ("predicted_tbt_ms", 1e-3)):
        if k in a and k in b and abs(a[k] - b[k]) > tol * max(1.0, abs(a[k])):
            diffs.append(f"{k}: recorded {a[k]}, re-derived {b[k]}")
    return diffs


def _estimates(router: Router, cluster: ClusterSnapshot, req: RoutingRequest,
               chain_len: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The policy's cost model, instance by instance (what the choice was made from)."""
    costs = router.policy.costs if isinstance(router.policy, BasePolicy) else None
    preq = router.policy_request(req, chain_len)
    bs = cluster.block_size
    prefill: list[dict[str, Any]] = []
    decode_rows: list[dict[str, Any]] = []
    for inst in cluster.instances:
        if inst.role in ("prefill", "both"):
            row: dict[str, Any] = {
                "instance": inst.node_id,
                "queued_prefill_tokens": inst.queued_prefill_tokens,
                "cached_blocks": list(inst.prefix_blocks),
            }
            if costs is not None:
                wait = costs.queue_wait_s(inst)
                best = costs.local_reuse(inst, preq, bs)
                for holder in cluster.instances:  # a prefix copied from elsewhere, if cheaper
                    if holder.node_id == inst.node_id or holder.prefix_blocks[2] <= 0:
                        continue
                    r = costs.remote_reuse(holder, preq, bs, costs.link_index(holder, inst))
                    if r is not None and r.cost_s < best.cost_s:
                        best = r
                row.update(queue_wait_s=wait, reuse_blocks=best.blocks, reuse_tier=best.tier,
                           reuse_source=best.source, load_and_compute_s=best.cost_s, ttft_s=wait + best.cost_s)
            prefill.append(row)
        if inst.role in ("decode", "both"):
            row = {"instance": inst.node_id, "batch_size": inst.batch_size,
                   "context_tokens": inst.decode_context_tokens, "free_kv_blocks": inst.free_kv_blocks}
            if costs is not None:
                row.update(fits=costs.decode_fits(inst, preq, bs), tbt_ms=costs.tbt_ms(inst, preq))
            decode_rows.append(row)
    prefill.sort(key=lambda r: (r.get("ttft_s", 0.0), r["instance"]))
    decode_rows.sort(key=lambda r: (r.get("tbt_ms", 0.0), r["instance"]))
    return prefill, decode_rows


async def explain(settings: Settings, request_id: str, *, max_records: int | None = None,
                  limit_name: str = "the record limit", index: DecisionIndex | None | bool = True) -> Explanation:
    """Re-derive the decision for ``request_id`` from the topics and explain it.

    Every read ends at the end offsets taken when it starts; the decision and its request are
    found through the routers' decision index (``index``: True = the settings' index, an index,
    or None/False = none: a bounded backward scan), the in-flight decisions and their requests
    around the decision's time, the heartbeats of the last TTL before it by time, the
    ``kv-events`` up to the decision's watermark. ``max_records`` caps what is read (AuditError
    naming ``limit_name`` beyond it)."""
    t = topics(settings.topic_config())
    ttl_ms = resv_ms = int(settings.reservation_ttl_s * 1000)
    idx = decision_index(settings) if index is True else (index or None)
    outcomes: list[RequestOutcome] = []
    async with SpanReader(settings.kafka(), deadline_s=600.0) as log:
        reads = _Reads(log, max_records, limit_name)
        try:
            pos = (await _indexed(idx, [request_id])).get(request_id)
            _, target = await _decision(reads, t.dispatch.name, request_id, pos)
            rec = target.body
            assert isinstance(rec, (RoutingDecision, RoutingRejection))
            if isinstance(rec, RoutingRejection) and rec.policy is None:
                raise AuditError(f"request {request_id!r} was rejected before any policy ran ({rec.reason}: "
                                 f"{rec.message})")
            at_ms = _read_at(target)
            if isinstance(rec, RoutingDecision):  # how far back earlier decisions still count
                ttl_ms = max(ttl_ms, rec.pending_ttl_ms or 0, rec.inflight_lease_ms or 0)
            earlier = await _earlier_decisions(reads, t.dispatch.name, target, at_ms, ttl_ms)
            wanted = {request_id} | {e.body.request_id for e in earlier if isinstance(e.body, RoutingDecision)}
            indexed = await _indexed(idx, sorted(wanted))
            requests = await _requests(reads, t.requests.name, wanted, indexed, at_ms, ttl_ms)
            if request_id not in requests:
                raise AuditError(f"request {request_id!r} is not on {t.requests.name}")
            ordinal, req = requests[request_id]
            if isinstance(rec, RoutingDecision) and rec.ordinal is not None:
                ordinal = rec.ordinal  # decided where it arrived, before its request had an offset
            store = await _view_at(reads, settings, rec.watermark, at_ms)
            if isinstance(rec, RoutingDecision) and rec.inflight_lease_ms is not None:
                outcomes = await _outcomes(reads, t.request_outcomes.name, at_ms, ttl_ms)
        except (LogReadError, ViewStoreError) as e:
            raise AuditError(f"cannot re-derive the decision for {request_id!r}: {e}") from e
        finally:
            if idx is not None and index is True:
                await idx.close()
    # The decision names its block size and profile (v2); older ones fall back to the settings.
    s = settings.model_copy(update={
        "policy": rec.policy, "policy_params": dict(rec.params),
        "block_size": rec.block_size or settings.block_size,
        "model_profile": rec.model_profile or settings.model_profile,
    })
    own = isinstance(rec, RoutingDecision) and rec.inflight_lease_ms is not None
    reservations, n_resv = _reservations(settings, s.block_size, earlier, requests, at_ms - resv_ms, own,
                                         _Seen(rec.seen_reservations if isinstance(rec, RoutingDecision) else None,
                                               at_ms))
    router = Router(s, _ViewAt(store, at_ms), reservations, incremental=False)  # every instance, afresh
    counts = (0, 0, 0)
    if isinstance(rec, RoutingDecision):
        capacity = {n.node_id: c for n in await store.nodes()
                    if (c := kv_event_capacity(n, s.pending_lru_blocks)) is not None}
        counts = _decision_time(router, rec, at_ms, earlier, requests, outcomes, capacity)
    await _control_at(router, settings, rec.control_offset, t.control.name)
    chain = router.chain_of(req)
    snap, pending = await router.read(chain)
    snap, _ = router.at_decision(snap, chain)
    cluster = router.cluster(snap, pending, req.model, 0.0, req.exclude)
    prefill_rows, decode_rows = _estimates(router, cluster, req, len(chain))
    stage_ms: dict[str, float] = {}
    router.on_stages = stage_ms.update
    if isinstance(rec, RoutingDecision) and req.session is not None and rec.session_instance is not None:
        router.sessions[req.session] = rec.session_instance  # the router's memory of its session, as recorded
    again = await router.route(req, ordinal)
    if again.seed != rec.seed:
        raise AuditError(f"seed {again.seed} differs from the recorded {rec.seed}: is CONDUCTOR_SEED the same?")
    recorded, rederived = _outcome(rec), _outcome(again)
    diffs = _differences(recorded, rederived)
    return Explanation(
        request_id=request_id, recorded=recorded, rederived=rederived, matches=not diffs, differences=diffs,
        policy=rec.policy or "", seed=rec.seed, watermark=dict(rec.watermark), decided_at_ms=at_ms,
        prefill=prefill_rows, decode=decode_rows, reservations=n_resv,
        control_offset=rec.control_offset, control=router.control.as_dict(), stage_ms=stage_ms,
        pending_placements=counts[0], in_flight=counts[1], outcomes=counts[2],
    )


def _reservations(settings: Settings, block_size: int, earlier: Sequence[Envelope],
                  requests: Mapping[str, tuple[int, RoutingRequest]], since_ms: int,
                  own: bool, seen: _Seen) -> tuple[InMemoryReservations, int]:
    """The reservations the earlier decisions (made from ``since_ms`` on) still held, and how many:
    those the decision's router had applied (``seen``: by its cut of the reservations' stream, else
    by time); none for a decision that counted its load with the in-flight ledger (``own``)."""
    reservations = InMemoryReservations(settings.reservation_ttl_s)
    n = 0
    for env in earlier:
        d = env.body
        assert isinstance(d, RoutingDecision)
        r = requests.get(d.request_id)
        t0 = _read_at(env)
        if r is None or own or t0 < since_ms or not seen.has(d.reservation_producer, d.reservation_event, t0):
            continue
        reservations.reserve_sync(decision_reservations(r[1], d, block_size), _read_at(env))
        n += 1
    return reservations, n


async def _control_at(router: Router, settings: Settings, control_offset: int, topic: str) -> None:
    """Give ``router`` the control state the decision was made under: the same fold, up to the
    recorded offset."""
    if control_offset < 0:
        return
    for offset, cmd in await control_records(settings, control_offset):
        router.apply_control(cmd, offset)
    if router.control.offset != control_offset:
        raise AuditError(f"control offset {control_offset} is not on {topic} (read up to {router.control.offset})")


async def _outcomes(reads: _Reads, name: str, at_ms: int, window_ms: int) -> list[RequestOutcome]:
    """The outcomes of requests that may have been in flight at ``at_ms``: those logged from
    ``window_ms`` before it (plus the clock slack) to ``window_ms`` after (a request decided
    within the lease before ``at_ms`` is logged within the lease after its decision)."""
    spans = await reads.window(name, at_ms - window_ms - CLOCK_SLACK_MS, at_ms + window_ms + CLOCK_SLACK_MS)
    return [env.body async for _, env in reads.envelopes(spans) if isinstance(env.body, RequestOutcome)]


def _decision_time(router: Router, rec: RoutingDecision, at_ms: int, earlier: Sequence[Envelope],
                   requests: Mapping[str, tuple[int, RoutingRequest]],
                   outcomes: Sequence[RequestOutcome], capacity: Mapping[str, int]) -> tuple[int, int, int]:
    """Give ``router`` the pending blocks and in-flight ledger ``rec`` was decided with, folded
    from the earlier decisions and the outcomes (``capacity``: the nodes without KV events);
    (placements, charges, outcomes) counted."""
    if rec.pending_ttl_ms is None and rec.inflight_lease_ms is None:
        return 0, 0, 0
    placed: list[PendingOp] = []
    charged: list[InflightOp] = []
    pend_seen, infl_seen = _Seen(rec.seen_pending, at_ms), _Seen(rec.seen_inflight, at_ms)
    for env in earlier:
        d = env.body
        assert isinstance(d, RoutingDecision)
        r = requests.get(d.request_id)
        t0 = _read_at(env)
        if r is None:
            continue
        req = r[1]
        if (rec.pending_ttl_ms is not None and d.pending_ttl_ms is not None and t0 > at_ms - rec.pending_ttl_ms
                and pend_seen.has(d.event_producer, d.event, t0)):
            chain = tuple(router.chain_of(req))
            if chain:
                placed.extend(Placed(d.request_id, t0, node, chain)
                              for node in dict.fromkeys((d.prefill_instance, d.decode_instance)))
        if (rec.inflight_lease_ms is not None and d.inflight_lease_ms is not None and releases_its_work(req)
                and infl_seen.has(d.event_producer, d.event, t0)):
            charged.append(Charged(d.request_id, t0, d.prefill_instance, d.decode_instance,
                                   max(req.prompt_tokens - d.reused_tokens, 0), req.prompt_tokens))
    applied = 0
    for o in outcomes:
        attempts = o.attempts or [o.request_id]
        used = False
        by = o.release_producer
        if o.first_token_view_ms is not None and infl_seen.has(by, o.first_token_event, o.first_token_view_ms):
            charged.append(FirstToken(attempts[-1], o.first_token_view_ms))
            used = True
        if o.finished_view_ms is not None:
            if infl_seen.has(by, o.finished_event, o.finished_view_ms):
                charged.extend(Finished(a, o.finished_view_ms) for a in attempts)
                used = True
            if o.error is not None and pend_seen.has(by, o.finished_event, o.finished_view_ms):
                placed.extend(Released(a, o.finished_view_ms) for a in attempts)
                used = True
        applied += used
    # With a recorded cut every operation it names counts, whatever its stamp (the router applied
    # it when it came); without one, those stamped by the decision's time.
    pending = (None if rec.pending_ttl_ms is None else
               pending_from_log(placed, at_ms, rec.pending_ttl_ms, capacity, any_stamp=pend_seen.recorded))
    inflight = (None if rec.inflight_lease_ms is None else
                inflight_from_log(charged, at_ms, rec.inflight_lease_ms, any_stamp=infl_seen.recorded))
    router.use_decision_time(pending, inflight)
    return (sum(isinstance(op, Placed) for op in placed),
            sum(isinstance(op, Charged) for op in charged), applied)


class _Seen:
    """Whether a decision's router had applied a shared operation: by the decision's cut of that
    stream (``seen_pending`` / ``seen_inflight``) when it recorded one and the operation has a
    number, else by time (stamped no later than the decision)."""

    def __init__(self, cut: Mapping[str, int] | None, at_ms: int) -> None:
        self.cut = cut
        self.at_ms = at_ms

    @property
    def recorded(self) -> bool:
        return self.cut is not None

    def has(self, producer: str | None, event: int | None, stamped_ms: int) -> bool:
        if self.cut is None or producer is None or event is None:
            return stamped_ms <= self.at_ms
        return self.cut.get(producer, -1) >= event


def _read_at(env: Envelope) -> int:
    """When the router read the view for this decision (its ``view_now_ms``; before v3, the envelope's ts)."""
    body = env.body
    at = body.view_now_ms if isinstance(body, (RoutingDecision, RoutingRejection)) else None
    return at if at is not None else env.ts_ms


__all__ = ["AuditError", "Explanation", "ReadLimitExceeded", "explain"]
