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
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from aiokafka import TopicPartition

from conductor.routing.control_log import control_records
from conductor.routing.decision import decision_reservations
from conductor.routing.policies import BasePolicy
from conductor.routing.router import Router
from conductor.routing.snapshot import ClusterSnapshot
from conductor.settings import Settings
from schemas import DecodeError, Envelope, RoutingDecision, RoutingRejection, RoutingRequest, decode
from schemas.errors import ConductorError
from state.memory import InMemoryViewStore
from state.reservations import InMemoryReservations
from state.view import ViewSnapshot
from streams.kafka import consumer
from streams.replay import replay_into
from streams.topics import topics


class AuditError(ConductorError):
    """The decision or its request cannot be found, or cannot be re-derived."""


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def read_topic(settings: Settings, name: str, idle_timeout_s: float = 1.0) -> list[Envelope]:
    """Every decodable record of a topic, in offset order per partition (bad ones skipped:
    the live workers dead-lettered them already)."""
    return [env for _, env in await read_records(settings, name, idle_timeout_s)]


async def read_records(settings: Settings, name: str, idle_timeout_s: float = 1.0) -> list[tuple[int, Envelope]]:
    """:func:`read_topic` with each record's offset."""
    c = consumer(settings.kafka(), group_id=None)
    await c.start()
    out: list[tuple[int, Envelope]] = []
    try:
        parts = c.partitions_for_topic(name) or set()
        if not parts:
            await c.topics()  # refresh metadata once
            parts = c.partitions_for_topic(name) or set()
        tps = [TopicPartition(name, p) for p in sorted(parts)]
        if not tps:
            return out
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        # No end offsets: the embedded broker's "latest" is wrong. Read until the topic is quiet.
        last = time.monotonic()
        while time.monotonic() - last < idle_timeout_s:
            got = await c.getmany(timeout_ms=200, max_records=5000)
            if not got:
                continue
            last = time.monotonic()
            for msgs in got.values():
                for m in msgs:
                    try:
                        out.append((m.offset, decode(m.value)))
                    except DecodeError:
                        continue
    finally:
        await c.stop()
    return out


class _ViewAt:
    """The replayed view, read at the decision's time instead of the wall clock."""

    def __init__(self, store: InMemoryViewStore, now_ms: int) -> None:
        self.store = store
        self.now_ms = now_ms

    async def snapshot(self, chain: Any, *, now_ms: int | None = None) -> ViewSnapshot:
        return self.store.snapshot_sync(chain, self.now_ms if now_ms is None else now_ms)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


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
    prefill.sort(key=lambda r: r.get("ttft_s", 0.0))
    decode_rows.sort(key=lambda r: r.get("tbt_ms", 0.0))
    return prefill, decode_rows


async def explain(settings: Settings, request_id: str) -> Explanation:
    """Re-derive the decision for ``request_id`` from the topics and explain it."""
    t = topics(settings.topic_config())
    dispatched = await read_topic(settings, t.dispatch.name)
    target: Envelope | None = None
    for env in dispatched:
        if isinstance(env.body, (RoutingDecision, RoutingRejection)) and env.body.request_id == request_id:
            target = env  # the last one wins if a request was routed twice
    if target is None:
        raise AuditError(f"no decision for request {request_id!r} on {t.dispatch.name}")
    rec = target.body
    assert isinstance(rec, (RoutingDecision, RoutingRejection))
    if isinstance(rec, RoutingRejection) and rec.policy is None:
        raise AuditError(f"request {request_id!r} was rejected before any policy ran ({rec.reason}: {rec.message})")
    # The last copy of a request id wins, as on dispatch; its offset is the ordinal the router had.
    requests: dict[str, tuple[int, RoutingRequest]] = {
        e.body.request_id: (off, e.body) for off, e in await read_records(settings, t.requests.name)
        if isinstance(e.body, RoutingRequest)
    }
    if request_id not in requests:
        raise AuditError(f"request {request_id!r} is not on {t.requests.name}")
    ordinal, req = requests[request_id]

    store = InMemoryViewStore()
    await replay_into(settings.kafka(), settings.topic_config(), store, until=dict(rec.watermark), idle_timeout_s=1.0)
    at_ms = _read_at(target)
    # The decision names its block size and profile (v2); older ones fall back to the settings.
    s = settings.model_copy(update={
        "policy": rec.policy, "policy_params": dict(rec.params),
        "block_size": rec.block_size or settings.block_size,
        "model_profile": rec.model_profile or settings.model_profile,
    })
    reservations = InMemoryReservations(settings.reservation_ttl_s)
    n_resv = 0
    for env in dispatched:
        d = env.body
        # Decisions made before this one: by sequence within one router (it decides in the
        # order it numbers, though its reads may come back in another), by time across
        # routers. Partitions interleave, so not by position.
        if env.producer_id == target.producer_id and env.epoch == target.epoch:
            earlier = env.producer_seq < target.producer_seq
        else:
            earlier = _read_at(env) < at_ms
        if not earlier or not isinstance(d, RoutingDecision) or _read_at(env) < at_ms - settings.reservation_ttl_s * 1000:
            continue
        r = requests.get(d.request_id)
        if r is None:
            continue
        reservations.reserve_sync(decision_reservations(r[1], d, s.block_size), _read_at(env))
        n_resv += 1
    router = Router(s, _ViewAt(store, at_ms), reservations, incremental=False)  # every instance, afresh
    # The control state the decision was made under: the same fold, up to the recorded offset.
    if rec.control_offset >= 0:
        for offset, cmd in await control_records(settings, rec.control_offset):
            router.apply_control(cmd, offset)
        if router.control.offset != rec.control_offset:
            raise AuditError(f"control offset {rec.control_offset} is not on {t.control.name} "
                             f"(read up to {router.control.offset})")
    chain = router.chain_of(req)
    snap, pending = await router.read(chain)
    cluster = router.cluster(snap, pending, req.model, 0.0, req.exclude)
    prefill_rows, decode_rows = _estimates(router, cluster, req, len(chain))
    again = await router.route(req, ordinal)
    if again.seed != rec.seed:
        raise AuditError(f"seed {again.seed} differs from the recorded {rec.seed}: is CONDUCTOR_SEED the same?")
    recorded, rederived = _outcome(rec), _outcome(again)
    diffs = _differences(recorded, rederived)
    return Explanation(
        request_id=request_id, recorded=recorded, rederived=rederived, matches=not diffs, differences=diffs,
        policy=rec.policy or "", seed=rec.seed, watermark=dict(rec.watermark), decided_at_ms=at_ms,
        prefill=prefill_rows, decode=decode_rows, reservations=n_resv,
        control_offset=rec.control_offset, control=router.control.as_dict(),
    )


def _read_at(env: Envelope) -> int:
    """When the router read the view for this decision (its ``view_now_ms``; before v3, the envelope's ts)."""
    at = getattr(env.body, "view_now_ms", None)
    return at if at is not None else env.ts_ms


__all__ = ["AuditError", "Explanation", "explain", "read_records", "read_topic"]
