"""``conductor balance``: the KVCache balance worker.

Reads ``requests`` in its own consumer group to learn which prefixes are hot,
reads the view for the prefixes that matter, and publishes the commands that
:func:`conductor.balance.planner.plan` returns on ``kv-commands`` (keyed by the node
that must act). Heat is kept in event time (the requests' timestamps), so a
replay of ``requests`` plans the same commands.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence

from opentelemetry import metrics

from conductor.balance.planner import BalanceParams, Cooldown, HeatTracker, plan
from conductor.profiles import load_profile
from conductor.settings import Settings
from schemas import (
    DecodeError,
    KvCommand,
    RoutingRequest,
    decode,
    encode,
    envelope,
    headers,
    request_chain_keys,
)
from state.redis_view import RedisViewStore
from state.reservations import RedisReservations, ReservationStore
from streams import kafka
from streams.topics import topics

log = logging.getLogger("conductor.balance")


def request_chain(req: RoutingRequest, block_size: int) -> list[int]:
    if req.block_keys is not None:
        return list(req.block_keys)
    return request_chain_keys(req, req.block_size or block_size)


class Balancer:
    """The I/O shell around the pure planner; one instance per process."""

    def __init__(self, settings: Settings, params: BalanceParams, producer_id: str | None = None) -> None:
        self.settings = settings
        self.params = params
        self.tracker = HeatTracker(params)
        self.cooldown = Cooldown()
        # Replicas are copied over the cheapest path when the cluster's topology is known.
        self.topology = settings.cluster_topology()
        self.kv_bytes_per_block = load_profile(settings.model_profile).kv_bytes_per_token * settings.block_size
        self.producer_id = producer_id or f"balancer-{uuid.uuid4().hex[:8]}"
        self.seq = 0
        self.event_now_s = 0.0
        self.tokens: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()
        """Block → (block size, tokens) of the last request through it that carried tokens,
        so a replicate can name the tokens (engines key blocks by their own hashes)."""
        m = metrics.get_meter(__name__)
        self._commands = m.create_counter("conductor_kv_commands", description="KV commands published, by action")
        self._bad = m.create_counter("conductor_balance_skipped_records", description="request records not understood")

    def observe(self, raw: bytes) -> None:
        try:
            env = decode(raw)
        except DecodeError as e:
            self._bad.add(1, {"reason": e.reason})
            return  # the router dead-letters bad requests; here they only carry no heat
        if not isinstance(env.body, RoutingRequest):
            self._bad.add(1, {"reason": "wrong_kind"})
            return
        self.event_now_s = max(self.event_now_s, env.ts_ms / 1000)
        req = env.body
        chain = request_chain(req, self.settings.block_size)
        self.tracker.record(chain, env.ts_ms / 1000)
        if chain and req.token_ids is not None:
            bs = req.block_size or self.settings.block_size
            toks = list(req.token_ids[: self.params.max_prefix_blocks * bs])
            for key in reversed(chain[: self.params.max_prefix_blocks]):
                self.tokens[key] = (bs, toks)  # one list shared by the chain's blocks
                self.tokens.move_to_end(key)
            while len(self.tokens) > self.params.max_tracked:
                self.tokens.popitem(last=False)

    def with_tokens(self, cmd: KvCommand) -> KvCommand:
        """``cmd`` with its prefix's tokens when a request under its head carried them."""
        known = self.tokens.get(cmd.block_keys[-1])
        if cmd.token_ids is not None or known is None:
            return cmd
        bs, toks = known
        need = len(cmd.block_keys) * bs
        if len(toks) < need:
            return cmd
        return cmd.model_copy(update={"token_ids": toks[:need], "block_size": bs})

    async def plan_round(self, store: RedisViewStore, reservations: ReservationStore | None = None) -> list[KvCommand]:
        now_s = self.event_now_s
        hot = self.tracker.hot(now_s)[: self.params.max_commands * 2]
        cold = self.tracker.cold(now_s)[: self.params.max_commands * 2]
        chains: Sequence[tuple[int, ...]] = [c for c, _ in hot] + list(cold)
        snapshots = {c: await store.snapshot(c) for c in chains}
        reserved: dict[str, int] = {}
        if reservations is not None and snapshots:
            # Load the routers placed since each node's last heartbeat (what it does not show yet).
            snap = next(iter(snapshots.values()))
            since = {n.node_id: n.last_heartbeat_ms for n in snap.nodes}
            pending = await reservations.pending(since, snap.now_ms)
            reserved = {node: load.prefill_tokens for node, load in pending.items()}
        cmds = plan(hot, cold, snapshots, ttl_s=self.settings.heartbeat_ttl_s, now_s=now_s,
                    params=self.params, cooldown=self.cooldown, reserved=reserved, topology=self.topology,
                    kv_bytes_per_block=self.kv_bytes_per_block)
        for c in cold:
            if c in snapshots and all(p[0] == 0 for p in snapshots[c].prefix.values()):
                self.tracker.forget(c)  # nothing left in HBM to demote
        return [self.with_tokens(c) for c in cmds]

    async def run(self, interval_s: float = 2.0, stop: asyncio.Event | None = None) -> None:
        t = topics(self.settings)
        await kafka.ensure_topics(self.settings, t.all())
        store = RedisViewStore.from_settings(self.settings)
        reservations = RedisReservations(store.client, self.settings.view_namespace, self.settings.reservation_ttl_s,
                                         producer_id=self.producer_id)
        await reservations.start(int(time.time() * 1000))
        consumer = kafka.consumer(self.settings, t.requests.name, group_id=f"{self.settings.topic_prefix}balance")
        producer = kafka.producer(self.settings)
        await consumer.start()
        await producer.start()
        stop = stop or asyncio.Event()
        log.info("balance worker %s reading %s, writing %s", self.producer_id, t.requests.name, t.kv_commands.name)
        loop = asyncio.get_running_loop()
        next_round = loop.time() + interval_s
        try:
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=int(interval_s * 500), max_records=5000)
                for records in batches.values():
                    for r in records:
                        self.observe(r.value)
                if loop.time() < next_round:
                    continue
                next_round = loop.time() + interval_s
                for cmd in await self.plan_round(store, reservations):
                    env = envelope(cmd, producer_id=self.producer_id, producer_seq=self.seq,
                                   ts_ms=int(self.event_now_s * 1000))
                    self.seq += 1
                    await producer.send(t.kv_commands.name, encode(env), key=cmd.executor.encode(),
                                        headers=headers(env))
                    self._commands.add(1, {"action": cmd.action})
                    log.info("%s %s %d blocks %s/%s -> %s/%s: %s", cmd.command_id, cmd.action, len(cmd.block_keys),
                             cmd.from_node, cmd.from_tier, cmd.to_node or cmd.from_node, cmd.to_tier, cmd.reason)
                await producer.flush()
                if batches:
                    await consumer.commit()
        finally:
            await consumer.stop()
            await producer.stop()
            await reservations.close()
            await store.close()
