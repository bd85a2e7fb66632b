"""The discrete-event loop: arrivals → policy → prefill queues → KV transfer → decode batches."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from conductor.harness.sim.balance import BalanceLoop, CacheTiers, execute, replicate_arrival
from conductor.harness.sim.cache import LruBlockCache, TieredPool
from conductor.harness.sim.cluster import ClusterProfile
from conductor.harness.sim.decode import DecodeInstance, DecodeJob
from conductor.harness.sim.errors import SimulationError
from conductor.harness.sim.network import Network, PathStats
from conductor.harness.sim.trace import TraceRequest
from conductor.harness.sim.view import DelayedView
from conductor.routing.policies.cpp import STAGES
from conductor.routing.snapshot import ClusterSnapshot, InstanceMemo, PolicyRequest, build_cluster
from conductor.topology import Link, PathKey, Topology, flat_topology
from schemas.blocks import chain_from_precomputed


class CostModel(Protocol):
    """What the simulator needs of a model profile (``conductor.costmodel.profiles.ModelProfile``)."""

    kv_bytes_per_token: int

    def prefill_seconds(self, total_tokens: int, cached_tokens: int = 0) -> float: ...

    def decode_step_seconds(self, batch_size: int, context_tokens: int) -> float: ...

    def prefix_load_seconds(
        self, hbm_tokens: int, dram_tokens: int, ssd_tokens: int, remote: bool, same_rack: bool = True
    ) -> float: ...

    def transfer_seconds(self, tokens: int, tier: str, remote: bool, same_rack: bool = True) -> float: ...

    l: int
    dram_bandwidth: float
    ssd_bandwidth: float
    rack_bandwidth: float
    cross_rack_bandwidth: float
    transfer_latency_s: float


@dataclass(slots=True)
class Outcome:
    """What happened to one request."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    chain: list[int]
    path_s: float = 0.0
    """Its recorded time outside the engines (``TraceRequest.path_s``), counted toward the TTFT SLO."""
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
    prefix_path: str | None = None
    """Where the reused prefix was read from: ``local``, or the path class of a remote read
    (``same_rack``, ``cross_rack``, ``cross_zone``)."""
    prefix_read_s: float = 0.0
    handoff_s: float = 0.0
    """Prefill → decode KV transfer time (on a shared path)."""
    group: tuple[str, ...] = ()
    """CPP: the prefill instances in pipeline order (empty: one instance)."""
    chunk_ends: tuple[int, ...] = ()
    stages: dict[int, list[float]] = field(default_factory=dict)
    """CPP: each started chunk's stage end times (what the next member pipelines behind)."""

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
class Task:
    """One prefill job on one instance: a whole prompt (``chunk`` -1) or a CPP chunk."""

    o: Outcome
    chunk: int = -1
    tokens: int = 0
    """Tokens to compute as the placement predicted (queue accounting)."""


@dataclass(slots=True)
class PrefillInstance:
    node_id: str
    rack: str
    cache: LruBlockCache
    zone: str | None = None
    queue: deque[Task] = field(default_factory=deque)
    current: Task | None = None
    blocked: bool = False
    """The current task is a CPP chunk waiting for its predecessor chunk to start."""
    compute_s: float = 0.0
    """Compute time of the current task (set when it starts; its end waits for a fetch)."""
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
    paths: dict[PathKey, PathStats] = field(default_factory=dict)
    topology: str = "flat"
    balance: dict[str, Any] | None = None
    """The balance loop's counters (commands, done/failed/expired, blocks and bytes moved); None when off."""
    stopped_s: float | None = None
    """When the replay stopped because more requests had missed an SLO than ``miss_budget`` allows
    (simulated time); None: every request ran to its end. A stopped run's later outcomes are unset."""
    missed: int = 0
    """Requests known to have missed an SLO (rejected, TTFT or TBT over it) when the run ended."""


_ARRIVE, _PREFILL_DONE, _DECODE_READY, _DECODE_TICK, _NET, _FETCHED, _BALANCE, _REPLICA = range(8)
STORE_NODE = "store-0"
PATH_CLASS = {"pair": "same_rack", "racks": "cross_rack", "zones": "cross_zone"}


@dataclass(frozen=True, slots=True)
class _Node:
    """Where a simulated node is (what topology lookups need)."""

    node_id: str
    rack: str | None
    zone: str | None


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
        topology: Topology | None = None,
        balance: BalanceLoop | None = None,
        miss_budget: int | None = None,
    ) -> None:
        """``miss_budget``: stop the replay as soon as more requests than this have missed an SLO
        (a search that only asks whether a cluster meets a target needs no more); None: run it all."""
        self.cluster = cluster
        self.topology = topology if topology is not None else flat_topology(profile)
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
        # Nodes the topology file places stay there; the others go round-robin over its racks
        # (or the cluster profile's ``racks`` when the file names none).
        topo = self.topology
        racks = topo.rack_names() or [f"rack-{i}" for i in range(cluster.racks)]

        def where(node: str, i: int) -> _Node:
            fixed = topo.nodes.get(node)
            rack = fixed.rack if fixed is not None and fixed.rack else racks[i % len(racks)]
            return _Node(node, *topo.place(_Node(node, rack, fixed.zone if fixed is not None else None)))

        self.where: dict[str, _Node] = {}
        self.prefills = []
        for i in range(cluster.prefill_instances):
            w = where(cluster.prefill_name(i), i)
            self.where[w.node_id] = w
            self.prefills.append(PrefillInstance(w.node_id, w.rack or "", LruBlockCache(cluster.prefill_cache_blocks),
                                                 zone=w.zone))
        self.decodes = [
            DecodeInstance(cluster.decode_name(i), profile.decode_step_seconds, cluster.decode_kv_tokens, cluster.decode_max_batch)
            for i in range(cluster.decode_instances)
        ]
        for i, d in enumerate(self.decodes):
            self.where[d.node_id] = where(d.node_id, i)
        self.decode_rack = {d.node_id: self.where[d.node_id].rack or "" for d in self.decodes}
        fixed = topo.nodes.get(STORE_NODE)
        self.where[STORE_NODE] = _Node(STORE_NODE, *topo.place(_Node(STORE_NODE, fixed.rack if fixed else None,
                                                                      fixed.zone if fixed else None)))
        self.net = Network(lambda t, key, version: self._push(t, _NET, (key, version)))
        self.pool = TieredPool(cluster.store_dram_blocks, cluster.store_ssd_blocks) if cluster.has_store else None
        self._prefill_by_id = {p.node_id: p for p in self.prefills}
        self._decode_by_id = {d.node_id: d for d in self.decodes}
        self._memo: InstanceMemo = {}
        self._heap: list[tuple[float, int, int, Any]] = []
        self._n = 0
        self.now = 0.0
        self.miss_budget = miss_budget
        self._missed: set[int] = set()
        """Indexes of the requests known to miss an SLO (each is counted once, when it is first known)."""
        self._over = False

    # --- plumbing -------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, kind, payload))

    def run(self) -> SimResult:
        view = self.view
        for p in self.prefills:
            view.heartbeat(p.node_id, "prefill", 0.0, rack=p.rack, zone=p.zone, total_kv_blocks=p.cache.capacity)
        for d in self.decodes:
            w = self.where[d.node_id]
            view.heartbeat(d.node_id, "decode", 0.0, rack=w.rack, zone=w.zone, total_kv_blocks=d.kv_tokens // self.bs)
        if self.pool is not None:
            w = self.where[STORE_NODE]
            view.heartbeat(STORE_NODE, "store", 0.0, rack=w.rack, zone=w.zone, total_kv_blocks=self.pool.dram.capacity)
        outcomes = []
        for r in self.requests:
            chain = list(r.hash_ids) if r.keyed else chain_from_precomputed(r.hash_ids)
            o = Outcome(r.index, r.arrival_s, r.input_length, r.output_length, chain, r.path_s)
            outcomes.append(o)
            self._push(r.arrival_s, _ARRIVE, o)
        self._by_index = {o.index: o for o in outcomes}
        self._decoded: dict[str, int] = {d.node_id: 0 for d in self.decodes}
        self._arrivals_left = len(outcomes)
        if self.balance is not None and outcomes:
            self._push(min(o.arrival_s for o in outcomes) + self.balance.interval_s, _BALANCE, None)
        done = 0
        heap = self._heap
        while heap and not self._over:
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
                inst, o = payload
                o.handoff_s = t - o.first_token_s
                job = DecodeJob(o.index, o.input_length, o.output_length, t)
                inst.expect(job.prompt_tokens, self.expected_output_tokens, -1)
                self._finished(inst.submit(job, t))
                self._schedule_tick(inst)
            elif kind == _BALANCE:
                self._balance_round()
            elif kind == _REPLICA:
                self._replica_landed(*payload)
            elif kind == _DECODE_TICK:
                inst, version = payload
                if version == inst.version:
                    self._finished(inst.advance(t))
                    self._schedule_tick(inst)
            elif kind == _NET:
                for ready, what in self.net.wake(t, *payload):
                    if what is not None:
                        self._push(ready, what[0], what[1])
            else:
                self._fetched(payload)
        if self.progress is not None:
            self.progress(done)
        stopped = self.now if self._over else None
        for o in outcomes:
            if stopped is None and o.rejected is None and math.isnan(o.finish_s):
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
            paths=dict(self.net.stats),
            topology=self.topology.name,
            balance=self.balance.summary() if self.balance is not None else None,
            stopped_s=stopped,
            missed=len(self._missed),
        )

    def _miss(self, o: Outcome) -> None:
        """``o`` missed an SLO (as ``summary.meets_slo`` counts it); past the budget, the run stops."""
        self._missed.add(o.index)
        if self.miss_budget is not None and len(self._missed) > self.miss_budget:
            self._over = True

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
            view.heartbeat(p.node_id, "prefill", now, rack=p.rack, zone=p.zone, total_kv_blocks=p.cache.capacity,
                           free_kv_blocks=max(0, p.cache.capacity - len(p.cache)), queue_depth=n,
                           queued_prefill_tokens=p.queued_tokens + running, running_requests=n)
        bs = self.bs
        for d in self.decodes:
            batch, ctx, free = d.load()
            w = self.where[d.node_id]
            view.heartbeat(d.node_id, "decode", now, rack=w.rack, zone=w.zone, total_kv_blocks=d.kv_tokens // bs,
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
            self._miss(o)
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
        group = tuple(getattr(decision, "prefill_group", ()) or ())
        if group:
            found = [self._prefill_by_id.get(m) for m in group]
            members = [m for m in found if m is not None]
            if len(members) < len(found) or members[0] is not p:
                raise SimulationError(f"policy placed request {o.index} on the CPP group {group!r}, which is not "
                                      f"a group of prefill instances led by {p.node_id!r}")
            o.group = group
            o.chunk_ends = tuple(decision.chunk_boundaries)
            lo = min(decision.reused_blocks * self.bs, o.input_length)
            for j, (m, hi) in enumerate(zip(members, o.chunk_ends)):
                self._enqueue(m, Task(o, j, max(0, hi - lo)))
                lo = hi
            return
        self._enqueue(p, Task(o, -1, self._tokens_to_compute(o, decision.reused_blocks)))

    def _enqueue(self, p: PrefillInstance, task: Task) -> None:
        p.queue.append(task)
        p.queued_tokens += task.tokens
        if p.current is None:
            self._start_prefill(p)

    def _tokens_to_compute(self, o: Outcome, reused_blocks: int) -> int:
        return max(0, o.input_length - min(reused_blocks * self.bs, o.input_length))

    def _source_prefix(self, source: str, chain: list[int]) -> tuple[int, int]:
        """(blocks in DRAM-or-faster, blocks incl. SSD) the source really holds now."""
        if source == STORE_NODE and self.pool is not None:
            return self.pool.prefix(chain)
        holder = self._prefill_by_id.get(source)
        if holder is None:
            return 0, 0
        n = holder.cache.prefix_len(chain)
        return n, n

    def _path(self, a: str, b: str) -> tuple[PathKey, Link]:
        return self.topology.path(self.where[a], self.where[b])

    def _start_prefill(self, p: PrefillInstance) -> None:
        task = p.queue.popleft()
        p.queued_tokens -= task.tokens
        p.current = task
        p.blocked = False
        o = task.o
        if task.chunk > 0:
            self._start_chunk(p, task)
            return
        prof = self.profile
        bs = self.bs
        # The engine's own prefix cache is always used; a remote prefix only when the
        # policy asked for it, and only as much of it as the source still holds (the
        # view the policy saw may be stale). A remote read crosses a shared path.
        local = p.cache.prefix_len(o.chain)
        local_tier = self.cluster.prefill_cache_tier
        fetch_s = 0.0
        reused = local
        src = o.reuse_source
        remote_read: tuple[int, int] | None = None
        if src is not None and src != p.node_id and o.claimed_blocks > local:
            fast, total = self._source_prefix(src, o.chain)
            remote = min(o.claimed_blocks, total)
            if remote > local:
                remote_read = (min(fast, remote), remote)
                reused = remote
                o.remote_reuse = True
                if src == STORE_NODE and self.pool is not None:
                    self.pool.touch(o.chain[:remote])
                else:
                    self._prefill_by_id[src].cache.touch(o.chain[:remote])
        if remote_read is None and local > 0:
            hbm = local * bs if local_tier == "hbm" else 0
            fetch_s = prof.prefix_load_seconds(hbm, local * bs - hbm, 0, remote=False)
            o.prefix_path = "local"
        reused_tokens = min(reused * bs, o.input_length)
        end = o.input_length if task.chunk < 0 else o.chunk_ends[0]
        start_tok = min(reused_tokens, end - 1) if task.chunk == 0 else reused_tokens
        o.reused_tokens = reused_tokens
        p.compute_s = prof.prefill_seconds(end, start_tok)
        o.prefill_start_s = self.now
        p.current_tokens = end - start_tok
        p.current_start = self.now
        p.computed_tokens += p.current_tokens
        p.served += 1
        if remote_read is not None and src is not None:  # a remote read has a source
            fast_part, remote = remote_read
            kvb = prof.kv_bytes_per_token
            # As the policy costs it: the holder's fast part read from DRAM, the rest from SSD.
            read_s = fast_part * bs * kvb / prof.dram_bandwidth + (remote - fast_part) * bs * kvb / prof.ssd_bandwidth
            key, link = self._path(src, p.node_id)
            o.prefix_path = PATH_CLASS[key[0]]
            alone = link.seconds(remote * bs * kvb, read_s)
            p.current_end = self.now + alone + p.compute_s  # the estimate a heartbeat shows until it lands
            self.net.start(self.now, key, link, remote * bs * kvb, (_FETCHED, p), read_s=read_s)
            return
        o.prefix_read_s = fetch_s
        self._compute(p, fetch_s)

    def _fetched(self, p: PrefillInstance) -> None:
        assert p.current is not None
        self._compute(p, self.now - p.current_start)

    def _compute(self, p: PrefillInstance, fetch_s: float) -> None:
        """Start computing the current task ``fetch_s`` after it was taken up."""
        task = p.current
        assert task is not None
        o = task.o
        if o.prefix_path is not None and o.prefix_path != "local":
            o.prefix_read_s = fetch_s
        begin = p.current_start + fetch_s
        p.current_end = begin + p.compute_s
        p.busy_s += fetch_s + p.compute_s
        if task.chunk == 0:
            self._chunk_started(o, 0, begin, p.compute_s, [])
        self._push(p.current_end, _PREFILL_DONE, p)

    # --- chunked pipeline parallelism ------------------------------------------

    def _start_chunk(self, p: PrefillInstance, task: Task) -> None:
        """Member ``j`` of a CPP group took up its chunk: it runs once chunk ``j-1`` has started
        (its stage timeline is then known), trailing it stage by stage."""
        o, j = task.o, task.chunk
        lo, hi = o.chunk_ends[j - 1], o.chunk_ends[j]
        p.compute_s = self.profile.prefill_seconds(hi, lo)
        p.current_tokens = hi - lo
        p.current_start = self.now
        p.current_end = self.now + p.compute_s
        if j - 1 not in o.stages:
            p.blocked = True  # resumed by _chunk_started of its predecessor
            return
        self._run_chunk(p, task)

    def _run_chunk(self, p: PrefillInstance, task: Task) -> None:
        o, j = task.o, task.chunk
        lo = o.chunk_ends[j - 1]
        prev_node = o.group[j - 1]
        key, link = self._path(prev_node, p.node_id)
        kvb = self.profile.kv_bytes_per_token
        stages = max(1, min(STAGES, self.profile.l))
        # The hand-off shares its path: each stage's slice moves at the share it has now.
        share = link.bytes_per_s / (self.net.active(key) + 1)
        hand = link.latency_s + lo * kvb / stages / share
        self.net.start(self.now, key, link, lo * kvb, None)
        p.blocked = False
        p.computed_tokens += p.current_tokens
        p.served += 1
        self._chunk_started(o, j, self.now, p.compute_s, o.stages[j - 1], hand)
        p.busy_s += p.current_end - p.current_start
        self._push(p.current_end, _PREFILL_DONE, p)

    def _chunk_started(self, o: Outcome, j: int, begin: float, compute_s: float, prev: list[float],
                       hand: float = 0.0) -> None:
        """Record chunk ``j``'s stage timeline (and its end on its member), then let the next
        member go if it is waiting."""
        stages = max(1, min(STAGES, self.profile.l))
        tau = compute_s / stages
        t = begin
        cur = []
        for s in range(stages):
            if prev:
                t = max(t, prev[s] + hand)
            t += tau
            cur.append(t)
        o.stages[j] = cur
        member = self._prefill_by_id[o.group[j]]
        member.current_end = t
        if j + 1 < len(o.group):
            nxt = self._prefill_by_id[o.group[j + 1]]
            if nxt.blocked and nxt.current is not None and nxt.current.o is o and nxt.current.chunk == j + 1:
                self._run_chunk(nxt, nxt.current)

    # --- end of a prefill ------------------------------------------------------

    def _prefill_done(self, p: PrefillInstance) -> None:
        task = p.current
        assert task is not None
        o = task.o
        now = self.now
        tier = self.cluster.prefill_cache_tier
        last = task.chunk < 0 or task.chunk == len(o.group) - 1
        # A CPP member holds the KV of every token up to its chunk's end.
        held = o.chain if last else o.chain[: o.chunk_ends[task.chunk] // self.bs]
        stored, evicted = p.cache.insert(held)
        self.view.removed(p.node_id, tier, evicted, now)
        self.view.stored(p.node_id, tier, stored, now)
        if last:
            o.first_token_s = now
            if now - o.arrival_s + o.path_s > self.cluster.ttft_slo_s:
                self._miss(o)
            if self.pool is not None:
                for op, ptier, keys in self.pool.insert(o.chain):
                    (self.view.stored if op == "stored" else self.view.removed)(STORE_NODE, ptier, keys, now)
            assert o.decode is not None  # set when the request was placed
            d = self._decode_by_id[o.decode]
            key, link = self._path(p.node_id, d.node_id)
            self.net.start(now, key, link, o.input_length * self.profile.kv_bytes_per_token,
                           (_DECODE_READY, (d, o)))
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
            if o.tbt_ms > self.cluster.tbt_slo_ms:
                self._miss(o)
            assert o.decode is not None  # set when the request was placed
            self._decoded[o.decode] += 1
