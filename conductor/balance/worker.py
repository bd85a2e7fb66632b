"""``conductor balance``: the KVCache balance worker, a Faust app.

An agent reads ``requests`` (the app's own consumer group) and counts each block's
accesses in tumbling windows of ``heat_window_s`` (event time: the requests' envelope
timestamps), in Faust tables with changelogs, so a restarted worker resumes with the heat
it had. Every ``interval_s`` a planning round reads the heat back out of the tables, the
view for the prefixes that matter and the routers' reservations, and publishes what the
pure :func:`conductor.balance.planner.plan` returns on ``kv-commands`` (keyed by the node
that must act). The tables:

- ``block-heat`` (windowed): block key → accesses in each window; old windows expire.
- ``hot-blocks``: block key → [parent key, last time hot] for blocks that reached
  ``hot_threshold`` (the only blocks a round looks at, and the prefixes' chain links).
- ``prefix-tokens``: hot prefix tip → [block size, token ids], so a replicate can name
  the tokens after a restart too (engines key blocks by their own hashes).
- ``stream-time``: partition of ``requests`` → the latest request time read from it.

Every table uses the key's partitioner, so a key always lives in one changelog partition
and recovery restores its last value. Run one balance worker per cluster: each worker
counts only the ``requests`` partitions it was given.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
import uuid
from collections import OrderedDict
from typing import Any

from opentelemetry import metrics

from conductor.balance.planner import BalanceParams, Cooldown, hot_and_cold, plan, sliding_heat
from conductor.costmodel.profiles import load_profile
from conductor.settings import Settings
from schemas import DecodeError, KvCommand, RoutingRequest, decode, encode, envelope, headers, request_chain_keys
from state.redis_view import RedisViewStore
from state.reservations import RedisReservations
from streams import kafka
from streams.app import make_app
from streams.batches import take_batches
from streams.topics import topics

log = logging.getLogger("conductor.balance")

BATCH_MAX = 1000
BATCH_WITHIN_S = 0.05


def request_chain(req: RoutingRequest, block_size: int) -> list[int]:
    if req.block_keys is not None:
        return list(req.block_keys)
    return request_chain_keys(req, req.block_size or block_size)


class Balancer:
    """The Faust app around the pure planner; one per cluster."""

    def __init__(self, settings: Settings, params: BalanceParams, producer_id: str | None = None, *,
                 interval_s: float = 2.0, **app_overrides: Any) -> None:
        self.settings = settings
        self.params = params
        self.interval_s = interval_s
        self.cooldown = Cooldown()
        # Replicas are copied over the cheapest path when the cluster's topology is known.
        self.topology = settings.cluster_topology()
        self.kv_bytes_per_block = load_profile(settings.model_profile).kv_bytes_per_token * settings.block_size
        self.producer_id = producer_id or f"balancer-{uuid.uuid4().hex[:8]}"
        self.seq = 0
        self.tokens: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()
        """Block → (block size, tokens) of the last request through it that carried tokens (in
        memory; ``prefix-tokens`` keeps the hot tips' across restarts)."""
        self._at_s = 0.0  # the time the windowed table reads and writes are relative to
        self.store: RedisViewStore | None = None
        self.reservations: RedisReservations | None = None
        m = metrics.get_meter(__name__)
        self._commands = m.create_counter("conductor_kv_commands", description="KV commands published, by action")
        self._bad = m.create_counter("conductor_balance_skipped_records", description="request records not understood")

        s, t = settings, topics(settings.topic_config())
        # Tables keys and values are JSON (a windowed key is a tuple); the topics stay raw.
        app = self.app = make_app(s.worker(), app_id=f"{s.topic_prefix}balance", web_enabled=False, key_serializer="json",
                                  value_serializer="json", **app_overrides)
        parts = t.requests.partitions
        table: dict[str, Any] = {"partitions": parts, "use_partitioner": True}
        window = params.heat_window_s
        # faust's WindowWrapperT leaves out relative_to, which its one implementation has.
        self.heat = app.Table("block-heat", default=int, **table).tumbling(
            window, expires=3 * window).relative_to(lambda event=None: self._at_s)  # type: ignore[attr-defined]
        self.hot_blocks = app.Table("hot-blocks", **table)
        self.prefix_tokens = app.Table("prefix-tokens", **table)
        self.stream_time = app.Table("stream-time", **table)
        requests = app.topic(t.requests.name, partitions=parts, value_serializer="raw", key_serializer="raw")
        self.commands_topic = app.topic(t.kv_commands.name, partitions=t.kv_commands.partitions,
                                        value_serializer="raw", key_serializer="raw")
        app.agent(requests, name="requests-heat")(self._count)
        app.task(self._rounds)

    # --- heat -------------------------------------------------------------------------

    async def _count(self, stream: Any) -> None:
        async for events in take_batches(stream, BATCH_MAX, BATCH_WITHIN_S):
            self.observe_batch([(e.message.partition, e.message.value) for e in events])

    def observe_batch(self, records: list[tuple[int, bytes]]) -> None:
        """Count a batch of ``requests`` records: one table write per block and window."""
        window = self.params.heat_window_s
        counts: dict[tuple[float, int], int] = {}
        parents: dict[int, int | None] = {}
        newest: dict[int, float] = {}
        with_tokens: list[tuple[float, list[int], RoutingRequest]] = []
        for partition, raw in records:
            try:
                env = decode(raw)
            except DecodeError as e:
                self._bad.add(1, {"reason": e.reason})
                continue  # the router dead-letters bad requests; here they only carry no heat
            if not isinstance(env.body, RoutingRequest):
                self._bad.add(1, {"reason": "wrong_kind"})
                continue
            ts_s = env.ts_ms / 1000
            newest[partition] = max(newest.get(partition, 0.0), ts_s)
            chain = request_chain(env.body, self.settings.block_size)[: self.params.max_prefix_blocks]
            start = ts_s - ts_s % window
            parent: int | None = None
            for key in chain:
                counts[(start, key)] = counts.get((start, key), 0) + 1
                parents[key] = parent
                parent = key
            with_tokens.append((ts_s, chain, env.body))
        for (start, key), n in counts.items():
            self._at_s = start
            self.heat[key].apply(operator.add, n)
        for partition, ts_s in newest.items():
            if ts_s > self.stream_time.get(str(partition), 0.0):
                self.stream_time[str(partition)] = ts_s
        now_s = self.now_s()
        became_hot: set[int] = set()
        for key, parent in parents.items():
            known = self.hot_blocks.get(str(key))
            if known is not None and now_s - known[1] < window / 2:
                continue  # refreshed recently enough for the pruning (fewer changelog writes)
            if self.block_heat(key, now_s) >= self.params.hot_threshold:
                self.hot_blocks[str(key)] = [parent, now_s]
                if known is None:
                    became_hot.add(key)
        for _, chain, req in with_tokens:
            self._remember_tokens(chain, req, became_hot)

    def _remember_tokens(self, chain: list[int], req: RoutingRequest, became_hot: set[int]) -> None:
        if not chain or req.token_ids is None:
            return
        bs = req.block_size or self.settings.block_size
        toks = list(req.token_ids[: len(chain) * bs])
        for key in reversed(chain):
            self.tokens[key] = (bs, toks)  # one list shared by the chain's blocks
            self.tokens.move_to_end(key)
        while len(self.tokens) > self.params.max_tracked:
            self.tokens.popitem(last=False)
        deepest = max((i for i, k in enumerate(chain) if k in became_hot), default=None)
        if deepest is not None and len(toks) >= (deepest + 1) * bs:
            self.prefix_tokens[str(chain[deepest])] = [bs, toks[: (deepest + 1) * bs]]

    def now_s(self) -> float:
        """Event time: the latest request time read (restored with the tables)."""
        return max(self.stream_time.values(), default=0.0)

    def block_heat(self, key: int, now_s: float) -> float:
        """Accesses of ``key`` in the last ``heat_window_s`` (see :func:`sliding_heat`)."""
        window = self.params.heat_window_s
        self._at_s = now_s
        current = self.heat[key].value()
        self._at_s = now_s - window
        previous = self.heat[key].value()
        return sliding_heat(current, previous, (now_s % window) / window)

    def heat_snapshot(self, now_s: float | None = None) -> dict[int, float]:
        """Heat now of every block that was hot once (what a planning round sees)."""
        now_s = self.now_s() if now_s is None else now_s
        return {int(k): self.block_heat(int(k), now_s) for k in self.hot_blocks}

    def with_tokens(self, cmd: KvCommand) -> KvCommand:
        """``cmd`` with its prefix's tokens when a request under its head carried them."""
        if cmd.token_ids is not None:
            return cmd
        known = self.tokens.get(cmd.block_keys[-1])
        if known is None:
            stored = self.prefix_tokens.get(str(cmd.block_keys[-1]))
            known = (stored[0], stored[1]) if stored is not None else None
        if known is None:
            return cmd
        bs, toks = known
        need = len(cmd.block_keys) * bs
        if len(toks) < need:
            return cmd
        return cmd.model_copy(update={"token_ids": toks[:need], "block_size": bs})

    # --- planning ---------------------------------------------------------------------

    def recovered(self) -> bool:
        """The tables hold what their changelogs held (a round before that would see no heat
        and call every hot block cold)."""
        # faust's TableManagerT leaves out recovery, which its one implementation has.
        recovery = self.app.tables.recovery  # type: ignore[attr-defined]
        return recovery.completed.is_set() and not self.app.rebalancing

    async def plan_round(self) -> list[KvCommand]:
        store, reservations = await self._view()
        now_s = self.now_s()
        heat = self.heat_snapshot(now_s)
        parents = {int(k): v[0] for k, v in self.hot_blocks.items()}
        hot, cold = hot_and_cold(heat, parents, self.params)
        hot, cold = hot[: self.params.max_commands * 2], cold[: self.params.max_commands * 2]
        chains = [c for c, _ in hot] + list(cold)
        snapshots = {c: await store.snapshot(c) for c in chains}
        reserved: dict[str, int] = {}
        if snapshots:
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
                self.forget(c, heat)  # nothing left in HBM to demote
        self.prune(now_s)
        log.debug("round at %.1f: %d hot, %d cold prefixes, %d commands", now_s, len(hot), len(cold), len(cmds))
        return [self.with_tokens(c) for c in cmds]

    def forget(self, chain: tuple[int, ...], heat: dict[int, float]) -> None:
        """Stop looking at the cooled blocks of ``chain`` (a shared, still warm root stays)."""
        for key in chain:
            if heat.get(key, 0.0) < self.params.cold_threshold:
                self.hot_blocks.pop(str(key), None)
                self.prefix_tokens.pop(str(key), None)

    def prune(self, now_s: float) -> None:
        """Keep at most ``max_tracked`` hot blocks: the least recently hot go."""
        over = len(self.hot_blocks) - self.params.max_tracked
        if over > 0:
            oldest = sorted(self.hot_blocks.items(), key=lambda kv: kv[1][1])[:over]
            for k, _ in oldest:
                self.hot_blocks.pop(k, None)
                self.prefix_tokens.pop(k, None)

    async def publish(self, cmds: list[KvCommand]) -> None:
        for cmd in cmds:
            env = envelope(cmd, producer_id=self.producer_id, producer_seq=self.seq,
                           ts_ms=int(self.now_s() * 1000))
            self.seq += 1
            await self.commands_topic.send(key=cmd.executor.encode(), value=encode(env), headers=headers(env))
            self._commands.add(1, {"action": cmd.action})
            log.info("%s %s %d blocks %s/%s -> %s/%s: %s", cmd.command_id, cmd.action, len(cmd.block_keys),
                     cmd.from_node, cmd.from_tier, cmd.to_node or cmd.from_node, cmd.to_tier, cmd.reason)

    async def _rounds(self) -> None:
        log.info("balance worker %s: heat of %s in windows of %gs, a round every %gs", self.producer_id,
                 topics(self.settings.topic_config()).requests.name, self.params.heat_window_s, self.interval_s)
        logged_recovery = False
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.recovered():
                continue
            if not logged_recovery:
                logged_recovery = True
                log.info("heat tables recovered: %d hot blocks, %d prefix token lists, stream time %.3f",
                         len(self.hot_blocks), len(self.prefix_tokens), self.now_s())
            try:
                await self.publish(await self.plan_round())
            except Exception:  # the view or the broker unreachable: the next round tries again
                log.exception("planning round failed")

    async def _view(self) -> tuple[RedisViewStore, RedisReservations]:
        if self.store is None or self.reservations is None:
            self.store = RedisViewStore.connect(self.settings.redis(), self.settings.view_namespace)
            self.reservations = RedisReservations(self.store.client, self.settings.view_namespace,
                                                  self.settings.reservation_ttl_s, producer_id=self.producer_id)
            await self.reservations.start(int(time.time() * 1000))
        return self.store, self.reservations

    async def close(self) -> None:
        if self.reservations is not None:
            await self.reservations.close()
        if self.store is not None:
            await self.store.close()
        self.store = self.reservations = None

    async def run(self, interval_s: float | None = None, stop: asyncio.Event | None = None) -> None:
        """Run the app in this event loop until ``stop`` is set (the CLI runs it in a
        ``faust.Worker`` instead)."""
        if interval_s is not None:
            self.interval_s = interval_s
        await kafka.ensure_topics(self.settings.kafka(), topics(self.settings.topic_config()).all())
        stop = stop or asyncio.Event()
        await self.app.start()
        try:
            await stop.wait()
        finally:
            await self.app.stop()
            await self.close()
