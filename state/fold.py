"""The pure fold: one KV event or heartbeat, plus the node's stream state, into view operations.

No I/O and no clock: ``fold(envelope, stream)`` looks only at its arguments, so the
stream worker, ``view rebuild``, the simulator and the tests all get the same view
from the same records.

What it decides, per producer (node):

* **KV events** (``kv-events``): ordered by ``(epoch, producer_seq)``. A record at or
  below the last one applied is a duplicate and changes nothing. A sequence jump is a
  *gap*: counted on the node (the record is still applied). A higher epoch means the
  engine restarted: the node's blocks leave the view (:class:`ClearNode`) before the
  record applies. A lower epoch is a straggler from before the restart and is skipped.
  Blocks go to the producer, except where the event names another node: ``blocks_migrated``
  adds to its ``to_node``, and ``blocks_removed`` with ``node`` removes that node's (a shared
  pool written by many engines, each on its own stream).
* **Heartbeats** (``heartbeats``): their own ``(epoch, producer_seq)`` order; an older
  heartbeat never overwrites a newer one. The heartbeat's ``ts_ms`` (the producer's
  clock) is the node's ``last_heartbeat_ms``, so a replay rebuilds the same view.

The result's ``ops`` are what a store applies, in order, atomically with the record's
source position; ``stream`` is the node's new stream state (the caller keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from schemas import AllBlocksCleared, BlocksMigrated, BlocksRemoved, BlocksStored, Envelope, Heartbeat, chain_keys

from .view import TIER_INDEX, Outcome


class UnfoldableRecord(ValueError):
    """The record is valid but is not something the view folds (e.g. a request on kv-events)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class NodeStream:
    """Per-node stream state: where each of the node's two streams stands."""

    epoch: int = -1
    """Epoch of the last KV event applied (-1: none yet)."""
    seq: int = -1
    """producer_seq of the last KV event applied in ``epoch``."""
    gaps: int = 0
    """Sequence gaps seen on the KV stream (each jump counts once)."""
    missed: int = 0
    """KV events missing across those gaps."""
    hb_epoch: int = -1
    hb_seq: int = -1

    def part(self, name: str) -> tuple[int, ...]:
        """One stream's half: ``"kv"`` → (epoch, seq, gaps, missed), ``"hb"`` → (epoch, seq)."""
        if name == "hb":
            return (self.hb_epoch, self.hb_seq)
        return (self.epoch, self.seq, self.gaps, self.missed)


# --- view operations --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddBlocks:
    node: str
    tier: int
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RemoveBlocks:
    node: str
    tier: int
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ClearNode:
    """Every block of ``node`` leaves the view (restart or all-blocks-cleared)."""

    node: str


@dataclass(frozen=True, slots=True)
class SetHeartbeat:
    node: str
    state: dict[str, Any]
    """NodeState fields from the heartbeat, including ``last_heartbeat_ms``."""


@dataclass(frozen=True, slots=True)
class SetStream:
    """The node's new stream state; only the ``part`` a record moves ("kv" or "hb") is written,
    so the KV-event and heartbeat streams (separate topics, maybe separate workers) never
    overwrite each other's half."""

    node: str
    stream: NodeStream
    part: str = "kv"
    prev: NodeStream | None = None
    """The state the fold started from. When set, a store applies the record only if its own
    copy of that ``part`` still equals it (compare-and-set); otherwise another writer moved
    the stream after this fold read it, and the record must be folded again (see
    :attr:`state.view.Outcome.CONFLICT`). ``None``: no precondition (bulk loads)."""


Op = AddBlocks | RemoveBlocks | ClearNode | SetHeartbeat | SetStream


@dataclass(frozen=True, slots=True)
class Folded:
    outcome: Outcome
    """``APPLIED``, ``DUPLICATE`` or ``OLD_EPOCH``."""
    stream: NodeStream
    ops: tuple[Op, ...] = ()
    gap: int = 0
    """Events missed just before this one (0 when in order)."""
    node: str = ""


NO_STREAM = NodeStream()


def heartbeat_state(env: Envelope, hb: Heartbeat) -> dict[str, Any]:
    """The NodeState fields a heartbeat sets."""
    state = {
        "role": hb.role,
        "model": hb.model,
        "last_heartbeat_ms": env.ts_ms,
        "heartbeat_interval_s": hb.interval_s,
        "queue_depth": hb.queue_depth,
        "queued_prefill_tokens": hb.queued_prefill_tokens,
        "running_requests": hb.running_requests,
        "batch_size": hb.batch_size,
        "decode_context_tokens": hb.decode_context_tokens,
        "free_kv_blocks": hb.free_kv_blocks,
        "total_kv_blocks": hb.total_kv_blocks,
        "tier_capacity": dict(hb.tier_capacity),
        "rack": hb.rack,
        "zone": hb.zone,
        "endpoint": hb.endpoint,
        "dp_rank": hb.dp_rank,
        "bootstrap_port": hb.bootstrap_port,
        "kv_transfer": hb.kv_transfer,
    }
    if hb.kv_events is not None:
        # Only when said (heartbeat v4): a node that says nothing is stored as before, so a view
        # reader of an older release still reads every node that publishes its events.
        state["kv_events"] = hb.kv_events
    return state


def stored_keys(ev: BlocksStored) -> tuple[int, ...]:
    """Block keys of a stored event: as given, or derived from its tokens."""
    if ev.block_keys is not None:
        return tuple(ev.block_keys)
    return tuple(
        chain_keys(
            ev.token_ids or (),
            ev.block_size,
            parent=ev.parent_key,
            lora_name=ev.lora_name,
            extra_keys=ev.extra_keys,
        )
    )


MAX_SEQ_JUMP = 1_000_000
"""A producer sequence more than this far past its node's last one (in the same epoch) is a
fault, not a gap: the record is refused (``implausible_sequence``, dead-lettered) and the
node's stream stays where it was, so one forged ``producer_seq`` of 2^63 cannot mute it."""


def fold(env: Envelope, stream: NodeStream | None = None) -> Folded:
    """Fold one record into view operations given its producer's stream state.

    Raises :class:`UnfoldableRecord` for bodies that are neither KV events nor heartbeats.
    """
    node = env.producer_id
    st = stream or NO_STREAM
    body = env.body
    if isinstance(body, Heartbeat):
        if (env.epoch, env.producer_seq) <= (st.hb_epoch, st.hb_seq):
            return Folded(Outcome.DUPLICATE, st, node=node)
        last_hb = st.hb_seq if env.epoch == st.hb_epoch else -1
        if env.producer_seq - last_hb - 1 > MAX_SEQ_JUMP:
            raise UnfoldableRecord("implausible_sequence", f"heartbeat seq {env.producer_seq} jumps more than "
                                   f"{MAX_SEQ_JUMP} past {last_hb} (epoch {env.epoch})")
        new = replace(st, hb_epoch=env.epoch, hb_seq=env.producer_seq)
        return Folded(Outcome.APPLIED, new, (SetHeartbeat(node, heartbeat_state(env, body)), SetStream(node, new, "hb", prev=st)), node=node)

    if not isinstance(body, (BlocksStored, BlocksRemoved, AllBlocksCleared, BlocksMigrated)):
        raise UnfoldableRecord("wrong_kind", f"{body.kind} is not a KV event or heartbeat")

    ops: list[Op] = []
    epoch, seq = env.epoch, env.producer_seq
    if epoch < st.epoch:
        return Folded(Outcome.OLD_EPOCH, st, node=node)
    if epoch > st.epoch:
        if st.epoch >= 0:
            ops.append(ClearNode(node))  # the engine restarted: its old blocks are gone
        last = -1
    else:
        if seq <= st.seq:
            return Folded(Outcome.DUPLICATE, st, node=node)
        last = st.seq
    # Sequences start at 0 in every epoch, so a first record above 0 is a gap too.
    gap = seq - last - 1
    if gap > MAX_SEQ_JUMP:
        raise UnfoldableRecord("implausible_sequence", f"seq {seq} jumps more than {MAX_SEQ_JUMP} past {last} (epoch {epoch})")
    new = NodeStream(
        epoch=epoch,
        seq=seq,
        gaps=st.gaps + (1 if gap > 0 else 0),
        missed=st.missed + max(gap, 0),
        hb_epoch=st.hb_epoch,
        hb_seq=st.hb_seq,
    )

    if isinstance(body, BlocksStored):
        keys = stored_keys(body)
        if keys:
            ops.append(AddBlocks(node, TIER_INDEX[body.tier], keys))
    elif isinstance(body, BlocksRemoved):
        if body.block_keys:
            ops.append(RemoveBlocks(body.node or node, TIER_INDEX[body.tier], tuple(body.block_keys)))
    elif isinstance(body, AllBlocksCleared):
        ops.append(ClearNode(node))
    else:  # BlocksMigrated
        keys = tuple(body.block_keys)
        if keys:
            same = body.from_node == body.to_node and body.from_tier == body.to_tier
            if body.mode == "migrate" and not same:
                ops.append(RemoveBlocks(body.from_node, TIER_INDEX[body.from_tier], keys))
            ops.append(AddBlocks(body.to_node, TIER_INDEX[body.to_tier], keys))
    ops.append(SetStream(node, new, prev=st))
    return Folded(Outcome.APPLIED, new, tuple(ops), gap=max(gap, 0), node=node)
