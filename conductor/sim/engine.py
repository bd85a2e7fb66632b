"""The discrete-event loop: arrivals → policy → prefill queues → KV transfer → decode batches."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from conductor.routing.snapshot import ClusterSnapshot, InstanceMemo, PolicyRequest, build_cluster
from conductor.sim.balance import BalanceLoop, CacheTiers, execute, replicate_arrival
from conductor.sim.cache import LruBlockCache, TieredPool
from conductor.sim.cluster import ClusterProfile
from conductor.sim.decode import DecodeInstance, DecodeJob
from conductor.sim.errors import SimulationError
from conductor.sim.trace import TraceRequest
from conductor.sim.view import DelayedView
from schemas.blocks import chain_from_precomputed


class CostModel(Protocol):
    """What the simulator needs of a model profile (``conductor.profiles.ModelProfile``)."""

    kv_bytes_per_token: int

    def prefill_seconds(self, total_tokens: int, cached_tokens: int = 0) -> float: ...

    def decode_step_seconds(self, batch_size: int, context_tokens: int) -> float: ...

    def prefix_load_seconds(
        self, hbm_tokens: int, dram_tokens: int, ssd_tokens: int, remote: bool, same_rack: bool = True
    ) -> float: ...

    def transfer_seconds(self, tokens: int, tier: str, remote: bool, same_rack: bool = True) -> float: ...


@dataclass(slots=True)
class Outcome:
    """What happened to one request."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    chain: list[int]
    rejected: str | None = None
    prefill: str | None = None
    decode: str | None = None
    reuse_source: str | None = None
    claimed_blocks: int = 0
    reused_tokens: int = 0
    remote_reuse: bool = False
    predicted_ttft_s: float = math.nan
    prefill_start_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tbt_ms(self) -> float:
        """Mean time between tokens after the first (KV transfer and decode admission included)."""
        if self.output_length <= 1:
            return 0.0
        return 1000.0 * (self.finish_s - self.first_token_s) / (self.output_length - 1)


@dataclass(slots=True)
class PrefillInstance:
    node_id: str
    rack: str
    cache: LruBlockCache
    queue: deque[Outcome] = field(default_factory=deque)
    current: Outcome | None = None
    current_tokens: int = 0
    """Tokens the running prefill computes."""
    current_start: float = 0.0
    current_end: float = 0.0
    queued_tokens: int = 0
    """Tokens to compute of the queued (not running) requests, as their placements predicted."""
    busy_s: float = 0.0
    computed_tokens: int = 0
    served: int = 0


@dataclass
class SimResult:
    """Every request's outcome plus per-instance counters."""

    outcomes: list[Outcome]
    prefill_load: dict[str, dict[str, float]]
    decode_load: dict[str, dict[str, float]]
    makespan_s: float
    events_published: int
    cluster: ClusterProfile
    balance: dict[str, Any] | None = None
    """The balance loop's counters (commands, done/failed/expired, blocks and bytes moved); None when off."""


_ARRIVE, _PREFILL_DONE, _DECODE_READY, _DECODE_TICK, _BALANCE, _REPLICA = 0, 1, 2, 3, 4, 5
STORE_NODE = "store-0"


class Simulation:
    """One policy on one cluster over one (scheduled) trace. Deterministic for a given seed."""

    def __init__(
        self,
        cluster: ClusterProfile,
        profile: CostModel,
        policy: Any,
        requests: Sequence[TraceRequest],
        *,
        seed: int = 0,
        expected_output_tokens: int = 256,
        progress: Callable[[int], None] | None = None,
        balance: BalanceLoop | None = None,
    ) -> None:
        self.cluster = cluster
        self.balance = balance
        self.profile = profile
        self.policy = policy
        self.requests = requests
        self.rng = random.Random(seed)
        self.expected_output_tokens = expected_output_tokens
        self.progress = progress
        bs = cluster.block_size
        self.bs = bs
        self.view = DelayedView(cluster.view_delay_ms, bs)
        racks = cluster.racks
        self.prefills = [
            PrefillInstance(f"prefill-{i}", f"rack-{i % racks}", LruBlockCache(cluster.prefill_cache_blocks))
            for i in range(cluster.prefill_instances)
        ]
        self.decodes = [
            DecodeInstance(f"decode-{i}", profile.decode_step_seconds, cluster.decode_kv_tokens, cluster.decode_max_batch)
            for i in range(cluster.decode_instances)
        ]
        self.decode_rack = {d.node_id: f"rack-{i % racks}" for i, d in enumerate(self.decodes)}
        self.pool = TieredPool(cluster.store_dram_blocks, cluster.store_ssd_blocks) if cluster.has_store else None
        self._prefill_by_id = {p.node_id: p for p in self.prefills}
        self._decode_by_id = {d.node_id: d for d in self.decodes}
        self._memo: InstanceMemo = {}
        self._heap: list[tuple[float, int, int, Any]] = []
        self._n = 0
        self.now = 0.0

    # --- plumbing -------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, kind, payload))

    def run(self) -> SimResult:
        view = self.view
        for p in self.prefills:
            view.heartbeat(p.node_id, "prefill", 0.0, rack=p.rack, total_kv_blocks=p.cache.capacity)
        for d in self.decodes:
            view.heartbeat(d.node_id, "decode", 0.0, rack=self.decode_rack[d.node_id], total_kv_blocks=d.kv_tokens // self.bs)
        if self.pool is not None:
            view.heartbeat(STORE_NODE, "store", 0.0, rack=None, total_kv_blocks=self.pool.dram.capacity)
        outcomes = []
        for r in self.requests:
            o = Outcome(r.index, r.arrival_s, r.input_length, r.output_length, chain_from_precomputed(r.hash_ids))
            outcomes.append(o)
            self._push(r.arrival_s, _ARRIVE, o)
        self._by_index = {o.index: o for o in outcomes}
        self._decoded: dict[str, int] = {d.node_id: 0 for d in self.decodes}
        self._arrivals_left = len(outcomes)
        if self.balance is not None and outcomes:
            self._push(min(o.arrival_s for o in outcomes) + self.balance.interval_s, _BALANCE, None)
        done = 0
        heap = self._heap
        while heap:
            t, _, kind, payload = heapq.heappop(heap)
            self.now = t
            if kind == _ARRIVE:
                self._arrivals_left -= 1
                if self.balance is not None:
                    self.balance.observe(payload.chain, t)
                self._arrive(payload)
                done += 1
                if self.progress is not None and done % 256 == 0:
                    self.progress(done)
            elif kind == _PREFILL_DONE:
                self._prefill_done(payload)
            elif kind == _DECODE_READY:
                inst, job = payload
                inst.expect(job.prompt_tokens, self.expected_output_tokens, -1)
                self._finished(inst.submit(job, t))
                self._schedule_tick(inst)
            elif kind == _BALANCE:
                self._balance_round()
            elif kind == _REPLICA:
                self._replica_landed(*payload)
            else:
                inst, version = payload
                if version == inst.version:
                    self._finished(inst.advance(t))
                    self._schedule_tick(inst)
        if self.progress is not None:
            self.progress(done)
        for o in outcomes:
            if o.rejected is None and math.isnan(o.finish_s):
                raise SimulationError(f"request {o.index} never finished (a simulator bug)")
        return SimResult(
            outcomes=outcomes,
            prefill_load={
                p.node_id: {"busy_s": p.busy_s, "computed_tokens": p.computed_tokens, "requests": p.served}
                for p in self.prefills
            },
            decode_load={
                d.node_id: {"busy_s": d.busy_s, "tokens": d.tokens, "requests": self._decoded[d.node_id]} for d in self.decodes
            },
            makespan_s=self.now,
            events_published=self.view.published,
            cluster=self.cluster,
            balance=self.balance.summary() if self.balance is not None else None,
        )

    # --- the policy's picture -------------------------------------------------

    def _snapshot(self, o: Outcome) -> ClusterSnapshot:
        """What the router would build: every node's load reported as a heartbeat (when it
        changed), the view read for the chain, and the one conversion to the policy's snapshot."""
        self._report_load()
        # The simulated nodes never fail, and their heartbeats already show every placement:
        # no liveness cut-off, no reservations.
        return build_cluster(self.view.snapshot(o.chain, self.now), {}, block_size=self.bs, ttl_s=math.inf,
                             age_ms=self.cluster.view_delay_ms, memo=self._memo)

    def _report_load(self) -> None:
        """Every node's load now, as the heartbeats it would send (only when it changed)."""
        now = self.now
        view = self.view
        for p in self.prefills:
            # What a heartbeat would say: tokens still to compute, the running prefill pro rata.
            running = 0
            if p.current is not None and p.current_end > p.current_start:
                running = int(p.current_tokens * max(0.0, p.current_end - now) / (p.current_end - p.current_start))
            n = len(p.queue) + (p.current is not None)
            view.heartbeat(p.node_id, "prefill", now, rack=p.rack, total_kv_blocks=p.cache.capacity,
                           free_kv_blocks=max(0, p.cache.capacity - len(p.cache)), queue_depth=n,
                           queued_prefill_tokens=p.queued_tokens + running, running_requests=n)
        bs = self.bs
        for d in self.decodes:
            batch, ctx, free = d.load()
            view.heartbeat(d.node_id, "decode", now, rack=self.decode_rack[d.node_id], total_kv_blocks=d.kv_tokens // bs,
                           free_kv_blocks=free // bs, running_requests=batch, batch_size=batch,
                           decode_context_tokens=ctx)

    # --- the balance loop (conductor balance + the executors) ---------------------

    def _balance_round(self) -> None:
        bal = self.balance
        assert bal is not None
        now = self.now
        self._report_load()
        tier = self.cluster.prefill_cache_tier
        bytes_per_block = self.bs * self.profile.kv_bytes_per_token
        for cmd in bal.plan(lambda chain: self.view.snapshot(list(chain), now), now):
            p = self._prefill_by_id.get(cmd.executor)
            if p is None:
                bal.counts["unroutable"] += 1
                continue
            holder = self._prefill_by_id.get(cmd.from_node)
            src = holder.cache.prefix_len(cmd.block_keys) if holder is not None and cmd.action == "replicate" else None
            memory = bal.memory_of(p.node_id)
            ex = execute(cmd, node=p.node_id, cache=CacheTiers(p.cache, tier), now_ms=int(now * 1000),
                         memory=memory, source_prefix=src, bytes_per_block=bytes_per_block)
            if ex is None or ex.repeat:
                continue
            bal.counts[ex.result.status] += 1
            for step in ex.steps:
                if step.op != "pull" or holder is None:
                    continue
                holder.cache.touch(list(step.keys))
                same_rack = holder.rack == p.rack
                dt = self.profile.transfer_seconds(len(step.keys) * self.bs, step.from_tier or tier, remote=True,
                                                   same_rack=same_rack)
                bal.blocks_moved += len(step.keys)
                bal.bytes_moved += len(step.keys) * bytes_per_block
                self._push(now + dt, _REPLICA, (p, step))
        if self._arrivals_left > 0:
            self._push(now + bal.interval_s, _BALANCE, None)

    def _replica_landed(self, p: PrefillInstance, step: Any) -> None:
        tier = self.cluster.prefill_cache_tier
        ev, evicted = replicate_arrival(step, p.cache, p.node_id, tier)
        self.view.removed(p.node_id, tier, evicted, self.now)
        if ev is not None:
            self.view.migrated(p.node_id, ev, self.now)

    # --- arrivals and prefill ---------------------------------------------------

    def _arrive(self, o: Outcome) -> None:
        c = self.cluster
        req = PolicyRequest(
            request_id=str(o.index),
            prompt_tokens=o.input_length,
            chain_len=len(o.chain),
            expected_output_tokens=self.expected_output_tokens,
            ttft_slo_s=c.ttft_slo_s,
            tbt_slo_ms=c.tbt_slo_ms,
            ordinal=o.index,
        )
        decision = self.policy.decide(req, self._snapshot(o), self.rng)
        if not hasattr(decision, "prefill"):
            o.rejected = decision.reason
            return
        p = self._prefill_by_id.get(decision.prefill)
        if p is None or decision.decode not in self._decode_by_id:
            raise SimulationError(
                f"policy {getattr(self.policy, 'name', self.policy)!r} placed request {o.index} on "
                f"{decision.prefill!r}/{decision.decode!r}, which are not prefill/decode instances"
            )
        o.prefill = p.node_id
        o.decode = decision.decode
        o.reuse_source = decision.reuse_source
        o.claimed_blocks = decision.reused_blocks
        o.predicted_ttft_s = decision.predicted_ttft_s
        self._decode_by_id[decision.decode].expect(o.input_length, self.expected_output_tokens)
        p.queue.append(o)
        p.queued_tokens += self._tokens_to_compute(o, decision.reused_blocks)
        if p.current is None:
            self._start_prefill(p)

    def _tokens_to_compute(self, o: Outcome, reused_blocks: int) -> int:
        return max(0, o.input_length - min(reused_blocks * self.bs, o.input_length))

    def _source_prefix(self, source: str, chain: list[int]) -> tuple[int, int, str]:
        """(blocks in DRAM-or-faster, blocks incl. SSD, rack) the source really holds now."""
        if source == STORE_NODE and self.pool is not None:
            d, n = self.pool.prefix(chain)
            return d, n, ""
        holder = self._prefill_by_id.get(source)
        if holder is None:
            return 0, 0, ""
        n = holder.cache.prefix_len(chain)
        return n, n, holder.rack

    def _start_prefill(self, p: PrefillInstance) -> None:
        o = p.queue.popleft()
        p.queued_tokens -= self._tokens_to_compute(o, o.claimed_blocks)
        prof = self.profile
        bs = self.bs
        # The engine's own prefix cache is always used; a remote prefix only when the
        # policy asked for it, and only as much of it as the source still holds (the
        # view the policy saw may be stale).
        local = p.cache.prefix_len(o.chain)
        local_tier = self.cluster.prefill_cache_tier
        fetch_s = 0.0
        reused = local
        src = o.reuse_source
        if src is not None and src != p.node_id and o.claimed_blocks > local:
            fast, total, rack = self._source_prefix(src, o.chain)
            remote = min(o.claimed_blocks, total)
            if remote > local:
                fast_part = min(fast, remote)
                same_rack = rack == "" or rack == p.rack
                fetch_s = prof.prefix_load_seconds(
                    0, fast_part * bs, (remote - fast_part) * bs, remote=True, same_rack=same_rack
                )
                reused = remote
                o.remote_reuse = True
                if src == STORE_NODE and self.pool is not None:
                    self.pool.touch(o.chain[:remote])
                else:
                    self._prefill_by_id[src].cache.touch(o.chain[:remote])
        if not o.remote_reuse and local > 0:
            hbm = local * bs if local_tier == "hbm" else 0
            fetch_s = prof.prefix_load_seconds(hbm, local * bs - hbm, 0, remote=False)
        reused_tokens = min(reused * bs, o.input_length)
        o.reused_tokens = reused_tokens
        compute = prof.prefill_seconds(o.input_length, reused_tokens)
        o.prefill_start_s = self.now
        p.current = o
        p.current_tokens = o.input_length - reused_tokens
        p.current_start = self.now
        p.current_end = self.now + fetch_s + compute
        p.busy_s += fetch_s + compute
        p.computed_tokens += p.current_tokens
        p.served += 1
        self._push(p.current_end, _PREFILL_DONE, p)

    def _prefill_done(self, p: PrefillInstance) -> None:
        o = p.current
        assert o is not None
        now = self.now
        o.first_token_s = now
        tier = self.cluster.prefill_cache_tier
        stored, evicted = p.cache.insert(o.chain)
        self.view.removed(p.node_id, tier, evicted, now)
        self.view.stored(p.node_id, tier, stored, now)
        if self.pool is not None:
            for op, ptier, keys in self.pool.insert(o.chain):
                (self.view.stored if op == "stored" else self.view.removed)(STORE_NODE, ptier, keys, now)
        d = self._decode_by_id[o.decode]  # type: ignore[index]
        same_rack = self.decode_rack[d.node_id] == p.rack
        ready = now + self.profile.transfer_seconds(o.input_length, "hbm", remote=True, same_rack=same_rack)
        self._push(ready, _DECODE_READY, (d, DecodeJob(o.index, o.input_length, o.output_length, ready)))
        p.current = None
        if p.queue:
            self._start_prefill(p)

    # --- decode -------------------------------------------------------------

    def _schedule_tick(self, d: DecodeInstance) -> None:
        d.version += 1
        t = d.next_finish_time()
        if t is not None:
            self._push(t, _DECODE_TICK, (d, d.version))

    def _finished(self, jobs: list[DecodeJob]) -> None:
        for j in jobs:
            o = self._by_index[j.rid]
            o.finish_s = j.finish_s
            self._decoded[o.decode] += 1  # type: ignore[index]
