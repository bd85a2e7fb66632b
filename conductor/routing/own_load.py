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
``capacity_groups``) count their group-mates' work as the device shares it (:func:`shared`):
members run side by side, each at a share of the device, so a request on one is slowed by
another member's queue only while that queue lasts, at most by as much work as it waits for on
its own instance plus one of that member's requests. Decoding sequences count whole. (Measured
on two vLLM CPU engines pinned to one core: bursts of 4 prompts of ~2,000 tokens sent to one
engine got their first tokens at 0.28-0.35 s on average, spread over both at 0.20-0.23 s; a
group counted as one queue kept every request on the prefix holder.)

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


def shared(me: InstanceLoad, mates: Iterable[InstanceLoad]) -> InstanceLoad:
    """``me``'s load with its capacity group-mates' as the shared device makes it felt.

    A mate's prefill queue (q tokens over k requests) runs beside ``me``'s, each at a share of
    the device: a request placed on ``me`` waits for ``me``'s own queue (q_me) and is slowed by
    the mate's work only while both run, so it feels at most q_me plus one of the mate's
    requests (q / k) of it: ``min(q, q_me + q / k)`` tokens, and as many of its requests. Equal
    queues count twice (one queue of the group's work); an idle member feels one request of a
    busy mate's, not its backlog. Decoding sequences and their context count whole."""
    r, pr, pt, dr, dc = me.requests, me.prefill_requests, me.prefill_tokens, me.decode_requests, \
        me.decode_context_tokens
    for m in mates:
        r += m.requests
        dr += m.decode_requests
        dc += m.decode_context_tokens
        if m.prefill_tokens > 0:
            each = m.prefill_tokens / max(m.prefill_requests, 1)
            felt = min(m.prefill_tokens, me.prefill_tokens + each)
            pt += int(felt)
            pr += min(m.prefill_requests, max(1, round(felt / each)))
    return InstanceLoad(r, pr, pt, dr, dc)


class OwnLoads:
    """Reads a ledger for the picture: each instance's own load (its capacity group's, with
    ``group_of``), the extra it adds over a heartbeat, and which instances changed since the
    last look (what a :class:`~conductor.routing.index.ClusterIndex` redoes)."""

    def __init__(self, ledger: InflightLedger, group_of: GroupOf | None = None) -> None:
        self.ledger = ledger
        self.group_of = group_of
        self._seen: dict[str, InstanceLoad] = {}

    def load(self, node: str, now_ms: int) -> InstanceLoad:
        """Conductor's work on ``node`` at ``now_ms``, with its capacity group-mates' as the
        shared device makes it felt (:func:`shared`)."""
        group = self.group_of(node) if self.group_of is not None else (node,)
        if len(group) == 1:
            return self.ledger.load(node, now_ms)
        return shared(self.ledger.load(node, now_ms), (self.ledger.load(m, now_ms) for m in group if m != node))

    def extra(self, node: NodeState, now_ms: int) -> Load | None:
        """What the picture adds to ``node``'s heartbeat (:func:`own_extra` of :meth:`load`)."""
        return own_extra(node, self.load(node.node_id, now_ms))

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
