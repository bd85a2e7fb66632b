"""Conductor's own in-flight work as the cluster picture counts it.

With an in-flight ledger (:mod:`state.inflight`: charged at each decision, the prefill part
released at the first token, the rest at the end), an instance's load in the picture is, per
quantity, the larger of what its heartbeat says and what Conductor itself sent there and is not
done yet: queued prefill tokens and requests, decoding sequences and their context. So the
picture is right the moment a decision is made (no waiting for ``/metrics``), and a heartbeat
only adds the traffic Conductor did not send. This replaces "heartbeat + reservations cleared by
the next heartbeat" (:mod:`state.reservations`), whose decode part a heartbeat stamped before
the decode call could clear.

Instances that share capacity (one device, one set of cores: the topology's
``capacity_groups``) count their group-mates' work whole (:func:`shared`): the device runs the
group's queue, whichever member holds it, so a request on any member waits for all of it, and
members differ only in what they hold. Spreading inside a group buys no capacity; it splits the
device between engines that each batch apart. (Measured on two tiny vLLM CPU engines pinned to
one core, 2026-11-29, the live A/B's 40-request replay at 10x, 3 alternating rounds: all on one
engine TTFT p50 0.048 s and p90 0.114 s against 0.084 and 0.147 s spread over both; heavy at 3x,
0.117 / 0.245 s against 0.182 / 0.449 s.)

The picture takes the extra over the heartbeat as a reservation-like :class:`Load`
(:func:`own_extra`), so :func:`~conductor.routing.snapshot.build_cluster` and the
:class:`~conductor.routing.index.ClusterIndex` add it as they add reservations. Pure: times are
passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from state.inflight import InflightLedger, InstanceLoad
from state.reservations import Load
from state.view import NodeState

GroupOf = Callable[[str], tuple[str, ...]]
"""node -> the nodes sharing its capacity, itself among them (``Topology.capacity_group``)."""

_NONE = InstanceLoad()


def own_extra(node: NodeState, own: InstanceLoad) -> Load | None:
    """What ``own`` adds to ``node``'s heartbeat so that each quantity is the larger of the two
    (None: the heartbeat already shows at least as much of everything)."""
    extra = Load(
        prefill_tokens=max(own.prefill_tokens - node.queued_prefill_tokens, 0),
        prefill_requests=max(own.prefill_requests - node.queue_depth, 0),
        decode_requests=max(own.decode_requests - node.batch_size, 0),
        decode_context_tokens=max(own.decode_context_tokens - node.decode_context_tokens, 0),
    )
    return extra if extra else None


def _heartbeat(n: NodeState) -> InstanceLoad:
    return InstanceLoad(n.queue_depth + n.batch_size, n.queue_depth, n.queued_prefill_tokens, n.batch_size,
                        n.decode_context_tokens)


def _plus(a: InstanceLoad, b: InstanceLoad) -> InstanceLoad:
    return InstanceLoad(a.requests + b.requests, a.prefill_requests + b.prefill_requests,
                        a.prefill_tokens + b.prefill_tokens, a.decode_requests + b.decode_requests,
                        a.decode_context_tokens + b.decode_context_tokens)


def _larger(a: InstanceLoad, b: InstanceLoad) -> InstanceLoad:
    return InstanceLoad(max(a.requests, b.requests), max(a.prefill_requests, b.prefill_requests),
                        max(a.prefill_tokens, b.prefill_tokens), max(a.decode_requests, b.decode_requests),
                        max(a.decode_context_tokens, b.decode_context_tokens))


def shared(me: InstanceLoad, mates: Iterable[InstanceLoad]) -> InstanceLoad:
    """``me``'s load with its capacity group-mates' added whole: the shared device runs the
    group's prefill queue and decoding sequences, whichever member holds them, so every member
    sees the group's work (and a request stays where its prefix is; see
    :func:`~conductor.routing.policies.prefill_plan.pick_prefill` for ties inside a group)."""
    for m in mates:
        me = _plus(me, m)
    return me


class OwnLoads:
    """Reads a ledger for the picture: each instance's own load (its capacity group's, with
    ``group_of``), the extra it adds over a heartbeat, and which instances changed since the
    last look (what a :class:`~conductor.routing.index.ClusterIndex` redoes)."""

    def __init__(self, ledger: InflightLedger, group_of: GroupOf | None = None) -> None:
        self.ledger = ledger
        self.group_of = group_of
        self._seen: dict[str, InstanceLoad] = {}
        self._heard: dict[tuple[str, ...], InstanceLoad] = {}
        """Per capacity group, its members' heartbeats added up (:meth:`hear`)."""
        self._heard_from: object = None

    def load(self, node: str, now_ms: int) -> InstanceLoad:
        """Conductor's work on ``node`` at ``now_ms``, with its capacity group-mates' as the
        shared device makes it felt (:func:`shared`)."""
        group = self.group_of(node) if self.group_of is not None else (node,)
        if len(group) == 1:
            return self.ledger.load(node, now_ms)
        return shared(self.ledger.load(node, now_ms), (self.ledger.load(m, now_ms) for m in group if m != node))

    def extra(self, node: NodeState, now_ms: int) -> Load | None:
        """What the picture adds to ``node``'s heartbeat (:func:`own_extra` of :meth:`load`); in
        a capacity group, up to the larger of the group's own work and its members' heartbeats
        added up (:meth:`hear`), so every member shows the device's whole load, whichever member
        a heartbeat or a charge came from."""
        own = self.load(node.node_id, now_ms)
        if self._heard:
            heard = self._heard.get(self.group_of(node.node_id)) if self.group_of is not None else None
            if heard is not None:
                own = _larger(own, heard)
        return own_extra(node, own)

    def hear(self, nodes: Iterable[NodeState]) -> set[str]:
        """Take the heartbeats of the capacity groups' members from a snapshot's ``nodes``; the
        members of every group whose sum changed since the last call (what an index redoes).
        Nothing without groups."""
        if self.group_of is None or nodes is self._heard_from:
            return set()
        self._heard_from = nodes
        heard: dict[tuple[str, ...], InstanceLoad] = {}
        for n in nodes:
            g = self.group_of(n.node_id)
            if len(g) > 1:
                heard[g] = _plus(heard.get(g, _NONE), _heartbeat(n))
        old = self._heard
        changed = {m for g, x in heard.items() if old.get(g) != x for m in g}
        changed.update(m for g in old if g not in heard for m in g)
        self._heard = heard
        return changed

    def extras(self, nodes: Iterable[NodeState], now_ms: int) -> dict[str, Load]:
        """:meth:`extra` of every node that has one (what ``build_cluster`` takes as ``pending``)."""
        out = {}
        for n in nodes:
            e = self.extra(n, now_ms)
            if e is not None:
                out[n.node_id] = e
        return out

    def take_touched(self, now_ms: int) -> set[str]:
        """The instances whose own load changed since the last call (charges, releases, leases
        ended; with their capacity groups): O(instances with work in flight)."""
        now = self.ledger.loads(now_ms)
        seen = self._seen
        changed = {n for n, x in now.items() if seen.get(n, _NONE) != x}
        changed.update(n for n in seen if n not in now)
        self._seen = now
        if self.group_of is not None and changed:
            changed = {m for n in changed for m in self.group_of(n)}
        return changed


__all__ = ["GroupOf", "OwnLoads", "own_extra", "shared"]
