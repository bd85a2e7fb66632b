"""An emulated prefill or decode instance, for demos and tests.

It does what a vLLM instance does as far as Conductor can see: it reads its
decisions (the dispatcher client), "executes" them with the model profile's
timing model (optionally ``time_scale`` times faster than real), keeps a bounded
prefix cache with LRU eviction, publishes real vLLM-format KV events (map form)
on a ZMQ PUB socket with a replay ROUTER socket, and heartbeats its load.

Its own block hashes are salted per instance (like vLLM's random hash seed), so
only the bridge's token-derived keys make its blocks comparable across nodes.

Two ways in: decisions read from ``dispatch`` (the closed-world demo path: a
decode instance admits a request when the router predicted its prefill would
end), or HTTP requests (``conductor.harness.engine.http``, the gateway path: a decode
instance waits for its prefill peer's KV transfer). Both share one prefill queue
and one continuous-batching decode loop. Decisions of requests a gateway sent
(``reply_to`` set, or decided in the gateway's process: ``decided_by``) arrive by HTTP, so the
dispatch path skips them.

Emulation shortcuts, on purpose: a prefill instance runs one request at a time;
decode instances publish no KV events (their KV is per request).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from aiokafka.errors import KafkaError

from conductor.bridge.publisher import EventPublisher
from conductor.bridge.wire import EngineBlockRemoved, EngineBlockStored
from conductor.costmodel.profiles import ModelProfile
from conductor.harness.dispatch import Assignment
from conductor.harness.engine.pool import PoolLink
from schemas import Heartbeat, Role, RoutingDecision, RoutingRequest, Tier, chain_keys, envelope

log = logging.getLogger(__name__)

MIN_SLEEP_S = 0.005
"""Shortest wall-clock sleep of the decode loop."""


# --- the prefix cache (pure) ---------------------------------------------------


class PrefixCache:
    """A bounded LRU set of block hashes: an instance's prefix cache."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def cached_prefix(self, chain: Sequence[int]) -> int:
        """Blocks of ``chain`` cached as a contiguous prefix; touches them (most recent)."""
        n = 0
        for h in chain:
            if h not in self._blocks:
                break
            n += 1
        for h in chain[:n]:
            self._blocks.move_to_end(h)
        return n

    def insert(self, hashes: Sequence[int]) -> list[int]:
        """Insert blocks (most recent last); return the hashes evicted to make room.

        The blocks being inserted are never evicted by their own insertion: at most the
        last ``capacity`` of them are kept.
        """
        keep = list(hashes)[-self.capacity :]
        for h in keep:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        evicted = []
        while len(self._blocks) > self.capacity:
            h, _ = self._blocks.popitem(last=False)
            evicted.append(h)
        return evicted

    def discard(self, hashes: Sequence[int]) -> list[int]:
        """Drop blocks (a KV command's evict/demote); return those that were held."""
        gone = [h for h in hashes if h in self._blocks]
        for h in gone:
            del self._blocks[h]
        return gone


def engine_hashes(token_ids: Sequence[int], block_size: int, salt: bytes) -> list[int]:
    """This instance's own chained block hashes (uint64), salted like vLLM's random seed."""
    out, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=8, key=salt[:64])
        h.update(parent.to_bytes(8, "big"))
        h.update(struct.pack(f"<{block_size}I", *token_ids[start : start + block_size]))
        parent = int.from_bytes(h.digest(), "big")
        out.append(parent)
    return out


# --- the engine ------------------------------------------------------------------


@dataclass
class EngineConfig:
    node_id: str
    role: Role
    block_size: int
    kv_blocks: int = 16_384
    dram_blocks: int = 0
    """Host-memory tier (0 = none): blocks evicted from HBM move here, as with vLLM's CPU offload."""
    time_scale: float = 1.0
    """Run this many times faster than the profile's real time (1 = real time)."""
    heartbeat_s: float = 0.5
    max_output_tokens: int | None = None
    """Cap on tokens decoded per request (keeps demos short); None = as the request asks."""
    seed: int = 0
    model: str = "default"
    """The served model name (heartbeats, ``/v1/models``)."""


@dataclass
class _Seq:
    request_id: str
    context: int
    remaining: int
    steps: int = 0
    step_time_s: float = 0.0
    on_tokens: Callable[[int], None] | None = None
    """Called with the number of tokens each decode step batch produced (HTTP requests)."""


@dataclass
class EngineState:
    queue: deque[tuple[Assignment, int, asyncio.Future[int] | None]] = field(default_factory=deque)
    """Prefill assignments waiting, with the wall-clock ms each was received at and, for an
    HTTP request, the future that receives its cached-token count."""
    current_prefill_tokens: int = 0
    decoding: list[_Seq] = field(default_factory=list)
    waiting_decode: int = 0
    done: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    """Counters for the engine's /metrics (conductor.harness.engine.metrics)."""


class EmulatedEngine:
    """One emulated instance: executes assignments, publishes KV events, reports completions."""

    def __init__(
        self,
        config: EngineConfig,
        profile: ModelProfile,
        publisher: EventPublisher,
        *,
        heartbeat_sink: Callable[[list[Any]], Any] | None = None,
        report: TextIO | None = None,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        pool: PoolLink | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        """The shared KV pool (Mooncake Store): blocks leaving the last local tier are written there,
        and a prefix the router reads from the pool is read back from it."""
        self._keys: dict[int, int] = {}
        """Engine hash → Conductor block key of every block held (kept only with a pool: its objects
        are named by Conductor keys, which every engine derives alike)."""
        self.profile = profile
        self.publisher = publisher
        self.heartbeat_sink = heartbeat_sink
        self.report = report
        self.clock_ms = clock_ms
        rng = random.Random(f"{config.seed}/{config.node_id}")
        self.salt = rng.randbytes(16)
        self.cache = PrefixCache(config.kv_blocks)
        self.dram = PrefixCache(config.dram_blocks) if config.dram_blocks > 0 else None
        self._blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        """Parent and tokens of every block held in some tier (what an offload event reports)."""
        self.state = EngineState()
        self._prefill_work = asyncio.Event()
        self._decode_work = asyncio.Event()
        self._epoch = clock_ms()
        self.started_s = time.time()
        """When this engine (process) started: its /metrics process_start_time_seconds."""
        self._hb_seq = 0
        self._received: dict[str, int] = {}
        """Request id → leading tokens whose KV a CPP predecessor handed over (see prefill_now)."""

    # --- intake ---------------------------------------------------------------

    def submit(self, a: Assignment) -> None:
        """Queue an assignment (prefill part, decode part, or both)."""
        if a.request is not None and (a.request.reply_to or a.request.decided_by):
            return  # a gateway's (or picker's) request: it comes here by HTTP
        if a.prefill:
            self.state.queue.append((a, self.clock_ms(), None))
            self._prefill_work.set()
        if a.decode:
            asyncio.get_running_loop().create_task(self._admit_decode(a))

    # --- prefill ----------------------------------------------------------------

    async def run_prefill(self) -> None:
        while True:
            while not self.state.queue:
                self._prefill_work.clear()
                await self._prefill_work.wait()
            a, received_ms, fut = self.state.queue.popleft()
            try:
                cached = await self._prefill(a, received_ms)
            except Exception as e:  # one bad assignment must not stop the instance
                log.exception("prefill of %s failed", a.decision.request_id)
                if fut is not None and not fut.done():
                    fut.set_exception(e)
            else:
                if fut is not None and not fut.done():
                    fut.set_result(cached)

    async def prefill_now(self, request_id: str, token_ids: list[int], expected_output_tokens: int = 1,
                          received_tokens: int = 0) -> int:
        """Run one HTTP request's prefill through the prefill queue; return its cached prompt tokens.
        ``received_tokens``: the KV of that many leading tokens came from a peer (a CPP member's
        predecessor), so they are not computed."""
        now = self.clock_ms()
        if received_tokens:
            self._received[request_id[:256] or "http"] = received_tokens
        req = RoutingRequest(request_id=request_id[:256] or "http", token_ids=token_ids, prompt_tokens=len(token_ids),
                             expected_output_tokens=expected_output_tokens, model=self.config.model)
        d = RoutingDecision(request_id=req.request_id, prefill_instance=self.config.node_id,
                            decode_instance=self.config.node_id, reused_tokens=0, predicted_ttft_s=0.0,
                            predicted_tbt_ms=0.0, policy="http")
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        a = Assignment(decision=d, request=req, request_ts_ms=now, decision_ts_ms=now, prefill=True, decode=False)
        self.state.queue.append((a, now, fut))
        self._prefill_work.set()
        return await fut

    def decode_now(self, request_id: str, context_tokens: int, max_tokens: int,
                   on_tokens: Callable[[int], None]) -> None:
        """Add one HTTP request to the continuous decode batch; ``on_tokens(n)`` after each step
        batch, the last call bringing the total to the (capped) ``max_tokens``."""
        out = max_tokens if self.config.max_output_tokens is None else min(max_tokens, self.config.max_output_tokens)
        self.state.decoding.append(_Seq(request_id, context=context_tokens, remaining=max(out, 1), on_tokens=on_tokens))
        self._decode_work.set()

    def decode_output_tokens(self, max_tokens: int) -> int:
        """How many tokens :meth:`decode_now` will produce for ``max_tokens``."""
        out = max_tokens if self.config.max_output_tokens is None else min(max_tokens, self.config.max_output_tokens)
        return max(out, 1)

    async def _prefill(self, a: Assignment, received_ms: int) -> int:
        req, d = a.request, a.decision
        prompt = req.prompt_tokens if req else 0
        self.state.current_prefill_tokens = prompt
        tokens = list(req.token_ids) if req and req.token_ids is not None else None
        chain = engine_hashes(tokens, self.config.block_size, self.salt) if tokens is not None else []
        local = self.cache.cached_prefix(chain)
        in_dram = 0
        if self.dram is not None:
            # The prefix may go on in host memory: loading it beats recomputing it.
            for h in chain[local:]:
                if h not in self.dram:
                    break
                in_dram += 1
            self.dram.cached_prefix(chain[local : local + in_dram])
        cached_tokens = (local + in_dram) * self.config.block_size
        received = self._received.pop(d.request_id, 0)
        transfer_s = self.profile.transfer_seconds(in_dram * self.config.block_size, "dram", remote=False)
        pool_blocks = 0
        if self.pool is not None and d.reuse_source == self.pool.node and tokens is not None:
            # The router chose the shared pool: read the blocks back for real; what is missing is recomputed.
            bs = self.config.block_size
            want = min(d.reused_tokens, prompt) // bs
            start = local + in_dram
            if want > start:
                pool_blocks = await self.pool.read(chain_keys(tokens[: want * bs], bs)[start:])
                transfer_s += self.profile.transfer_seconds(pool_blocks * bs, "dram", remote=True)
                cached_tokens += pool_blocks * bs
        elif d.reused_tokens > cached_tokens and d.reuse_source and d.reuse_source != self.config.node_id:
            # The router chose to read the rest of the prefix from another node.
            extra = min(d.reused_tokens, prompt) - cached_tokens
            transfer_s = self.profile.transfer_seconds(extra, d.reuse_tier or "hbm", remote=True)
            cached_tokens += extra
        cached_tokens = max(cached_tokens, min(received, prompt))  # already here: its transfer was the pull
        compute_s = self.profile.prefill_seconds(prompt, cached_tokens)
        model_s = transfer_s + compute_s
        await asyncio.sleep(model_s / self.config.time_scale)
        if tokens is not None:
            await self._store(chain, local, tokens)
        self.state.current_prefill_tokens = 0
        self.state.done += 1
        self.state.prompt_tokens_total += prompt
        now_ms = self.clock_ms()
        # TTFT = the real time the request took to reach this instance (routing, Kafka)
        # + queueing and prefill here, in model time (scaled back from the emulation's).
        routing_s = max(0.0, (received_ms - a.request_ts_ms) / 1000) if a.request_ts_ms else None
        engine_s = (now_ms - received_ms) / 1000 * self.config.time_scale
        self._report(
            {
                "event": "prefill_done",
                "request_id": d.request_id,
                "node": self.config.node_id,
                "prompt_tokens": prompt,
                "cached_tokens": min(cached_tokens, prompt),
                "local_cached_tokens": (local + in_dram) * self.config.block_size,
                "dram_cached_tokens": in_dram * self.config.block_size,
                "pool_cached_tokens": pool_blocks * self.config.block_size,
                "routed_reuse_tokens": d.reused_tokens,
                "prefill_model_s": round(model_s, 6),
                "routing_s": round(routing_s, 6) if routing_s is not None else None,
                "engine_s": round(engine_s, 6),
                "ttft_s": round(routing_s + engine_s, 6) if routing_s is not None else None,
                "predicted_ttft_s": d.predicted_ttft_s,
            }
        )
        return min(cached_tokens, prompt)

    async def _store(self, chain: list[int], local: int, tokens: list[int]) -> None:
        new = chain[local:]
        if not new:
            return
        bs = self.config.block_size
        evicted = self.cache.insert(new)
        kept = new[-self.cache.capacity :]
        first = len(chain) - len(kept)
        # Stored before removed: the event names its parent while the parent is still known,
        # exactly as an engine that evicts the parent right after would report it.
        events: list[EngineBlockStored | EngineBlockRemoved] = [
            EngineBlockStored(
                block_hashes=tuple(kept),
                parent_block_hash=chain[first - 1] if first > 0 else None,
                token_ids=tuple(tokens[first * bs : (first + len(kept)) * bs]),
                block_size=bs,
                tier="hbm",
            )
        ]
        for i in range(first, len(chain)):
            self._blocks[chain[i]] = (chain[i - 1] if i > 0 else None, tuple(tokens[i * bs : (i + 1) * bs]))
        if self.pool is not None:
            self._keys.update(zip(chain[first:], chain_keys(tokens[: len(chain) * bs], bs)[first:]))
        dropped: list[int] = []
        if evicted and self.dram is not None:
            # Offload: evicted blocks are stored in host memory before they leave HBM, so their
            # keys stay known; one event per run of blocks that chain one to the next.
            moved = [h for h in evicted if h not in self.dram]
            run: list[int] = []
            for h in moved:
                if run and self._blocks[h][0] != run[-1]:
                    events.append(self._offload_event(run))
                    run = []
                run.append(h)
            if run:
                events.append(self._offload_event(run))
            dropped = self.dram.insert(moved)
        if evicted:
            events.append(EngineBlockRemoved(tuple(evicted), "hbm"))
        if dropped:
            events.append(EngineBlockRemoved(tuple(dropped), "dram"))
        # Blocks leaving the last local tier go to the shared pool (when there is one).
        leaving = dropped if self.dram is not None else evicted
        to_pool = [self._keys[h] for h in leaving if h in self._keys] if self.pool is not None else []
        for h in (*evicted, *dropped):
            if h not in self.cache and (self.dram is None or h not in self.dram):
                self._blocks.pop(h, None)
                self._keys.pop(h, None)
        await self.publisher.publish(time.time(), events)
        if to_pool and self.pool is not None:
            await self.pool.offload(to_pool, "dram" if self.dram is not None else "hbm")

    # --- hook for the KV command executor (conductor.harness.engine.executor) ----------------
    # The executor decides (conductor.balance.executor); these carry its steps out on this
    # instance's caches and publish them as the engine's own KV events.

    def tier_cache(self, tier: Tier) -> PrefixCache | None:
        return self.cache if tier == "hbm" else self.dram if tier == "dram" else None

    def hashes_by_key(self) -> dict[int, int]:
        """Conductor block key → this engine's hash, of every block held (known only with a
        pool: a command acting on the pool names blocks by key and may carry no tokens)."""
        return {k: h for h, k in self._keys.items()}

    async def write_prefix(self, chain: list[int], tokens: list[int]) -> None:
        """Hold ``chain`` (this instance's hashes of ``tokens``) in HBM, as if it had computed it."""
        local = 0
        for h in chain:
            if h not in self.cache:
                break
            local += 1
        await self._store(chain, local, tokens)

    async def move_blocks(self, hashes: list[int], from_tier: Tier, to_tier: Tier) -> None:
        """Move held blocks between two tiers; published as stored on ``to_tier``, then removed."""
        src, dst = self.tier_cache(from_tier), self.tier_cache(to_tier)
        if src is not None and dst is None and self.pool is not None and to_tier == "dram":
            await self._demote_to_pool(hashes, from_tier)
            return
        if src is None or dst is None:
            return
        moved = [h for h in hashes if h in src and h in self._blocks]
        if not moved:
            return
        new = [h for h in moved if h not in dst]
        events: list[EngineBlockStored | EngineBlockRemoved] = []
        run: list[int] = []
        for h in new:
            if run and self._blocks[h][0] != run[-1]:
                events.append(self._offload_event(run, to_tier))
                run = []
            run.append(h)
        if run:
            events.append(self._offload_event(run, to_tier))
        dropped = dst.insert(new)
        src.discard(moved)
        events.append(EngineBlockRemoved(tuple(moved), from_tier))
        if dropped:
            events.append(EngineBlockRemoved(tuple(dropped), to_tier))
        await self.publisher.publish(time.time(), events)

    async def _demote_to_pool(self, hashes: list[int], from_tier: Tier) -> None:
        """An engine without host memory of its own demotes into the shared pool: real puts, then
        the blocks leave ``from_tier`` (published as the pool's and this engine's events)."""
        assert self.pool is not None
        held = [h for h in hashes if h in self._keys and (c := self.tier_cache(from_tier)) is not None and h in c]
        done = set(await self.pool.offload([self._keys[h] for h in held], from_tier, move=True))
        moved = [h for h in held if self._keys[h] in done]
        if moved:
            await self.drop_blocks(moved, from_tier)

    async def drop_blocks(self, hashes: list[int], tier: Tier) -> None:
        cache = self.tier_cache(tier)
        gone = cache.discard(hashes) if cache is not None else []
        for h in gone:
            if h not in self.cache and (self.dram is None or h not in self.dram):
                self._blocks.pop(h, None)
                self._keys.pop(h, None)
        if gone:
            await self.publisher.publish(time.time(), [EngineBlockRemoved(tuple(gone), tier)])

    def _offload_event(self, run: list[int], tier: Tier = "dram") -> EngineBlockStored:
        if tier != "hbm":
            # As vLLM's offloading connector announces a copy to CPU (or disk): the same hashes
            # the GPU tier reported, no tokens, block size 0, no parent. The bridge resolves
            # them through its engine-hash → key map (conductor/bridge/translate.py).
            return EngineBlockStored(tuple(run), None, (), 0, tier)
        parent = self._blocks[run[0]][0]
        toks = tuple(t for h in run for t in self._blocks[h][1])
        return EngineBlockStored(tuple(run), parent, toks, self.config.block_size, tier)

    # --- decode -----------------------------------------------------------------

    async def _admit_decode(self, a: Assignment) -> None:
        d, req = a.decision, a.request
        self.state.waiting_decode += 1
        try:
            if a.request_ts_ms:
                # No KV transfer to wait for: start when the router predicted prefill would end.
                due_ms = a.request_ts_ms + d.predicted_ttft_s * 1000 / self.config.time_scale
                await asyncio.sleep(max(0.0, (due_ms - self.clock_ms()) / 1000))
        finally:
            self.state.waiting_decode -= 1
        out = req.expected_output_tokens if req else 256
        if self.config.max_output_tokens is not None:
            out = min(out, self.config.max_output_tokens)
        self.state.decoding.append(
            _Seq(d.request_id, context=req.prompt_tokens if req else 0, remaining=max(out, 1))
        )
        self._decode_work.set()

    async def run_decode(self) -> None:
        while True:
            if not self.state.decoding:
                self._decode_work.clear()
                await self._decode_work.wait()
                continue
            batch = self.state.decoding
            step = self.profile.decode_step_seconds(len(batch), sum(s.context for s in batch))
            # At high time scales one step is shorter than the event loop can honour: run
            # several identical steps per sleep (never past the next sequence to finish).
            n = max(1, min(int(MIN_SLEEP_S * self.config.time_scale / max(step, 1e-9)), min(s.remaining for s in batch)))
            await asyncio.sleep(n * step / self.config.time_scale)
            finished = []
            self.state.generation_tokens_total += n * len(batch)
            for s in batch:
                made = min(n, s.remaining)
                s.context += made
                s.remaining -= made
                s.steps += made
                s.step_time_s += made * step
                if s.on_tokens is not None:
                    try:
                        s.on_tokens(made)
                    except Exception:  # a client gone away must not stop the batch
                        log.exception("token callback of %s failed", s.request_id)
                if s.remaining <= 0:
                    finished.append(s)
            for s in finished:
                batch.remove(s)
                self.state.done += 1
                self._report(
                    {
                        "event": "decode_done",
                        "request_id": s.request_id,
                        "node": self.config.node_id,
                        "output_tokens": s.steps,
                        "tbt_ms": round(1000 * s.step_time_s / s.steps, 4),
                    }
                )

    # --- heartbeats and reports ---------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        st = self.state
        queued = sum(a.request.prompt_tokens for a, _, _ in st.queue if a.request) + st.current_prefill_tokens
        return Heartbeat(
            role=self.config.role,
            model=self.config.model,
            queue_depth=len(st.queue) + (1 if st.current_prefill_tokens else 0) + st.waiting_decode,
            queued_prefill_tokens=queued,
            running_requests=len(st.decoding) + (1 if st.current_prefill_tokens else 0),
            batch_size=len(st.decoding),
            decode_context_tokens=sum(s.context for s in st.decoding),
            free_kv_blocks=self.cache.capacity - len(self.cache),
            total_kv_blocks=self.cache.capacity,
            tier_capacity={"hbm": self.cache.capacity, **({"dram": self.dram.capacity} if self.dram else {})},
            interval_s=self.config.heartbeat_s,
        )

    async def run_heartbeats(self) -> None:
        while True:
            if self.heartbeat_sink is not None:
                self._hb_seq += 1
                env = envelope(self.heartbeat(), producer_id=self.config.node_id, producer_seq=self._hb_seq,
                               epoch=self._epoch, ts_ms=self.clock_ms())
                try:
                    await self.heartbeat_sink([env])
                except (KafkaError, OSError) as e:  # a broker hiccup must not stop the instance
                    log.warning("heartbeat not published: %s", e)
            await asyncio.sleep(self.config.heartbeat_s)

    def report_row(self, row: dict[str, Any]) -> None:
        """One JSON line on the report stream (when ``--report``): what the HTTP path did."""
        self._report(row)

    def _report(self, row: dict[str, Any]) -> None:
        if self.report is not None:
            self.report.write(json.dumps(row) + "\n")
            self.report.flush()

    async def run(self, assignments: Any) -> None:
        """Execute ``assignments`` (an async iterator of :class:`Assignment`) until cancelled."""
        self.publisher.start()
        # Both loops on every role: over HTTP a prefill instance also makes its one token, and a
        # request sent to a decode instance without a KV hand-off is prefilled there.
        tasks = [asyncio.create_task(self.run_heartbeats()), asyncio.create_task(self.run_prefill()),
                 asyncio.create_task(self.run_decode())]
        if self.pool is not None:
            tasks.append(asyncio.create_task(self.pool.run_heartbeats()))
        try:
            async for a in assignments:
                self.submit(a)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            aclose = getattr(assignments, "aclose", None)
            if aclose is not None:
                await aclose()  # stops the dispatch consumer now, not at garbage collection

