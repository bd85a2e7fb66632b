"""The emulated engine's KV command executor: ``kv-commands`` for this node → its caches.

:class:`EngineCommandExecutor` turns a :class:`~schemas.KvCommand` into the engine's
blocks: the decision is :func:`conductor.balance.executor.execute` (idempotence by command
id, deadlines, failures), and the steps run on the engine through its executor hook
(``write_prefix`` / ``move_blocks`` / ``drop_blocks``), which publish the engine's own
vLLM-format KV events; the bridge turns those into the proofs on ``kv-events``. A
``replicate`` pays the profile's remote transfer time of the prefix (scaled like every
other engine time). Each command gets one ``kv_command_result`` through ``results``.

The engine names blocks by its own salted hashes, so a command must carry the prefix's
``token_ids`` (the balance worker adds them when the requests carry tokens); one without
them is answered ``failed``/``unsupported``.

An engine joined to the shared pool (``--mooncake-master``) also carries out the commands
that act on the pool, which has no process of its own: a ``replicate`` into it that names
this engine as the pushing holder (real ``put``s of the blocks it holds, proven by the pool
node's ``blocks_migrated``) and an ``evict`` from it (a forced ``remove``, proven by
``blocks_removed`` with ``node`` = the pool). What the pool holds is asked of the store
itself, so a block another engine put is not put twice. These need no ``token_ids``: the
pool names objects by Conductor block key.

:func:`conductor.bridge.serve.commands_for` reads the node's commands from Kafka (its own
consumer group, offsets committed after the results are handed over: at-least-once, made safe
by the ids).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from conductor.balance.executor import CommandMemory, execute
from conductor.harness.engine.emulated import EmulatedEngine, engine_hashes
from conductor.harness.engine.pool import POOL_TIER, PoolLink
from schemas import Envelope, KvCommand, KvCommandResult, KvFailure, Tier, chain_keys, envelope

log = logging.getLogger(__name__)


class _EngineTiers:
    """The engine's caches seen by Conductor block key (for one command's chain)."""

    def __init__(self, engine: EmulatedEngine, by_key: dict[int, int]) -> None:
        self.engine = engine
        self.by_key = by_key

    def _pool_as_dram(self, tier: Tier) -> PoolLink | None:
        # An engine without host memory of its own, given the shared pool, demotes into it.
        return self.engine.pool if tier == "dram" and self.engine.dram is None else None

    def tiers(self) -> Sequence[Tier]:
        has_dram = self.engine.dram is not None or self.engine.pool is not None
        return ("hbm", "dram") if has_dram else ("hbm",)

    def holds(self, key: int, tier: Tier) -> bool:
        pool = self._pool_as_dram(tier)
        if pool is not None:
            return key in pool.held
        cache = self.engine.tier_cache(tier)
        h = self.by_key.get(key)
        return cache is not None and h is not None and h in cache

    def capacity(self, tier: Tier) -> int:
        pool = self._pool_as_dram(tier)
        if pool is not None:
            return pool.client.capacity_blocks
        cache = self.engine.tier_cache(tier)
        return cache.capacity if cache is not None else 0


@dataclass(frozen=True)
class _PoolNow:
    """The shared pool as the store answered for one command's keys."""

    node: str
    tier: Tier
    present: frozenset[int]
    room: int

    def holds(self, key: int) -> bool:
        return key in self.present

    def capacity(self) -> int:
        return self.room


def _acts_on_pool(cmd: KvCommand, node: str) -> bool:
    return (cmd.to_node != node) if cmd.action == "replicate" else (cmd.from_node != node)


class EngineCommandExecutor:
    def __init__(
        self,
        engine: EmulatedEngine,
        results: Callable[[list[Envelope]], Awaitable[Any]] | None = None,
        *,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.engine = engine
        self.results = results
        self.clock_ms = clock_ms
        self.memory = CommandMemory()
        self.seq = 0

    @property
    def node_id(self) -> str:
        return self.engine.config.node_id

    async def handle(self, cmd: KvCommand) -> KvCommandResult | None:
        """Carry ``cmd`` out if it is this node's; publish and return its result."""
        if cmd.executor != self.node_id:
            return None
        started = time.perf_counter()
        eng = self.engine
        bs = eng.config.block_size
        if _acts_on_pool(cmd, self.node_id):
            result = await self._on_pool(cmd)
        elif cmd.token_ids is None or cmd.block_size != bs:
            result = self._failed(cmd, "unsupported", "the command carries no token ids of this engine's block size")
        else:
            tokens = list(cmd.token_ids)
            keys = chain_keys(tokens, bs)
            if keys[: len(cmd.block_keys)] != list(cmd.block_keys):
                result = self._failed(cmd, "unsupported", "token_ids do not hash to block_keys")
            else:
                chain = engine_hashes(tokens, bs, eng.salt)[: len(cmd.block_keys)]
                by_key = dict(zip(cmd.block_keys, chain))
                ex = execute(cmd, node=self.node_id, cache=_EngineTiers(eng, by_key), now_ms=self.clock_ms(),
                             memory=self.memory, bytes_per_block=bs * eng.profile.kv_bytes_per_token)
                assert ex is not None
                if ex.repeat:
                    log.info("command %s already answered: %s", cmd.command_id, ex.result.status)
                    result = ex.result
                else:
                    model_s = 0.0
                    for step in ex.steps:
                        hashes = [by_key[k] for k in step.keys]
                        if step.op == "pull":
                            model_s += eng.profile.transfer_seconds(len(step.keys) * bs, step.from_tier or "hbm",
                                                                    remote=True)
                            await asyncio.sleep(model_s / eng.config.time_scale)
                            upto = max(chain.index(h) for h in hashes) + 1
                            await eng.write_prefix(chain[:upto], tokens[: upto * bs])
                        elif step.op == "store":
                            await eng.move_blocks(hashes, step.from_tier or cmd.from_tier, step.tier)
                        # a "remove" after a "store" is the second half of move_blocks
                        elif not any(s.op == "store" for s in ex.steps):
                            await eng.drop_blocks(hashes, step.tier)
                    result = ex.result.model_copy(update={"duration_ms": round(1000 * model_s, 3)})
                    self.memory.remember(result)
        log.info("command %s %s: %s %s (%d blocks) %s", cmd.command_id, cmd.action, result.status,
                 result.error or "", result.blocks, result.reason)
        if self.results is not None and result is not None:
            env = envelope(result, producer_id=self.node_id, producer_seq=self.seq, ts_ms=self.clock_ms())
            self.seq += 1
            await self.results([env])
        log.debug("command %s took %.3f s", cmd.command_id, time.perf_counter() - started)
        return result

    async def _on_pool(self, cmd: KvCommand) -> KvCommandResult:
        """A command acting on the shared pool: puts of held blocks, or a forced remove."""
        old = self.memory.get(cmd.command_id)
        if old is not None:
            log.info("command %s already answered: %s", cmd.command_id, old.status)
            return old
        eng, link = self.engine, self.engine.pool
        pool = None
        if link is not None and link.node in (cmd.to_node, cmd.from_node):
            present = await link.present(list(dict.fromkeys(cmd.block_keys)))
            pool = _PoolNow(link.node, POOL_TIER, frozenset(present), link.client.capacity_blocks)
        by_key = eng.hashes_by_key()
        block = link.client.block_size_bytes if link is not None else 0
        ex = execute(cmd, node=self.node_id, cache=_EngineTiers(eng, by_key), now_ms=self.clock_ms(),
                     memory=self.memory, bytes_per_block=block, pool=pool)
        assert ex is not None
        if not ex.steps or link is None:
            return ex.result
        t0 = time.perf_counter()
        result = ex.result
        for step in ex.steps:
            if step.op == "push":
                done = await link.offload(list(step.keys), step.from_tier or cmd.from_tier)
                if not done:
                    result = KvCommandResult(command_id=cmd.command_id, action=cmd.action, node=self.node_id,
                                             status="failed", error="no_room", reason=f"the pool {link.node} is full")
                elif len(done) < len(step.keys):
                    result = result.model_copy(update={
                        "blocks": len(done), "bytes_moved": len(done) * block,
                        "reason": f"the pool {link.node} took {len(done)} of {len(step.keys)} blocks (full)"})
            elif step.op == "remove":
                gone = await link.remove(list(step.keys))
                result = result.model_copy(update={"blocks": len(gone)})
        result = result.model_copy(update={"duration_ms": round(1000 * (time.perf_counter() - t0), 3)})
        self.memory.remember(result)
        return result

    def _failed(self, cmd: KvCommand, error: KvFailure, reason: str) -> KvCommandResult:
        old = self.memory.get(cmd.command_id)
        if old is not None:
            return old
        r = KvCommandResult(command_id=cmd.command_id, action=cmd.action, node=self.node_id, status="failed",
                            error=error, reason=reason)
        self.memory.remember(r)
        return r

    async def run(self, commands: AsyncIterator[KvCommand]) -> None:
        """Execute ``commands`` one after another until the iterator ends or the task is cancelled."""
        async for cmd in commands:
            try:
                await self.handle(cmd)
            except Exception:  # one bad command must not stop the instance
                log.exception("command %s failed", cmd.command_id)
