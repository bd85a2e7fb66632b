"""The view's Redis layout, written down once: key names, block-key bytes, node-hash fields,
the stream-state text, and the decoding of what a read returns. Pure: no driver, no I/O;
the store (:mod:`state.redis_view`), the fast reader (:mod:`state.reader`) and the tools
all build and parse keys here. (The Lua scripts of ``state.redis_view`` follow the same
layout on the server side.)

Keys (``ns`` = the view namespace; ``|``, ``{`` and ``}`` cannot occur in it). Every key of a
namespace starts with the hash tag ``{ns}|`` and the layout, ``2|`` (``{ns}|2|x`` is written
``ns|x`` below; layout 1, before issue 16, had block keys holding bitmaps and no ``2|``: a view
written in it is simply not found and is rebuilt from the log), so on a Redis Cluster
the whole view of one namespace lives in one slot: every script and MULTI/EXEC touches keys
of one slot, on one primary, and the routing read stays one round trip. The price: one
namespace is served by one primary (its memory and CPU); a view does not spread over
several primaries, several namespaces (models, clusters) do.

``ns|b<8-byte block key>``  string: the block's holders, one 2-byte little-endian entry per node,
    ``slot * 8 + tiers`` (bit ``t`` of ``tiers``: held in tier ``t``, :data:`state.view.TIER_INDEX`;
    never 0), in no particular order (:func:`holder_entries`). Its length follows the holders,
    not the cluster; a slot must be below :data:`MAX_SLOTS`.
``ns|nodes``  hash, one field per node attribute, ``<node>\\x1f<attr>``: ``slot``, ``hb``
    (heartbeat state, JSON), ``kv`` / ``hbs`` (stream state, :func:`stream_text`),
    ``b0`` ``b1`` ``b2`` (blocks indexed per tier).
``ns|slots``  slot → node id.  ``ns|meta``  next slot.  ``ns|retired`` / ``ns|free``  slots
    of cleared nodes, awaiting compaction / reusable.
``ns|wm``     ``topic:partition`` → highest applied offset (the fence).
``ns|ver``    moves on every write to the node hash (readers cache the hash by it).
``ns|gen``    the view's generation: a random token written when the view is created or
    cleared; every fenced write names the generation it was folded on and is refused
    under another (the view was lost or replaced). Absent: lost (or never written).
``ns|rebuild``  hash, ``topic:partition`` → offset the partition must reach: partitions
    still being read back from the log after a new generation (routers answer degraded
    while it is not empty).
``ns|chg``    sorted set, node → the ``ns|ver`` of the last write that touched it: a reader
    holding version v fetches only the nodes scored above v (:data:`NODE_ATTRS` of each).
``ns|base``   a random value set when the view is cleared: a reader whose base differs
    re-reads the whole node hash (versions of a cleared view mean nothing to it).
``ns|resv-log``  stream of the routers' in-flight reservations (:mod:`state.reservations`).
``ns|pend-log``  stream of the decisions' pending blocks (:mod:`state.pending`, shared by
    :mod:`state.shared_log`) and of where each decision placed its session.
``ns|infl-log``  stream of the in-flight ledger's charges and releases (:mod:`state.inflight`).
``ns|claim|<producer>``  string, with a short expiry: the token of the one live process writing
    decision-time records under that producer id (:mod:`state.claim`).
"""

from __future__ import annotations

import itertools
import json
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from schemas import TIERS

from .fold import NodeStream
from .view import NodeState, ViewSnapshot, canonical_dump

SEP = "\x1f"
"""Between a node id and its attribute in a ``ns|nodes`` field."""
BLOCK_KEY_BYTES = 8
LAYOUT = "2"
"""The key layout's version, in every key name (``{ns}|2|...``): 2 = holder entries."""
ENTRY_BYTES = 2
MAX_SLOTS = 1 << 13
"""Node slots a 2-byte holder entry can name (``slot * 8 + tiers`` < 65536). Slots of cleared
nodes are reused after compaction; the apply script refuses a node beyond this."""

SLOT_FIELD = "slot"
HEARTBEAT_FIELD = "hb"
STREAM_FIELD = {"kv": "kv", "hb": "hbs"}
"""Stream part (``NodeStream.part``) → its attribute in the node hash."""


def holder_entry(slot: int, tiers: int) -> bytes:
    """One holder entry as stored: ``slot * 8 + tiers``, 2 bytes little-endian."""
    if not 0 <= slot < MAX_SLOTS or not 0 < tiers < 8:
        raise ValueError(f"no holder entry for slot {slot}, tiers {tiers}")
    return (slot * 8 + tiers).to_bytes(ENTRY_BYTES, "little")


_SWAP = sys.byteorder != "little"


def holder_entries(value: bytes) -> dict[int, int]:
    """A block key's value → slot → tier bits (bit ``t``: held in tier ``t``)."""
    a = array("H")
    a.frombytes(value)
    if _SWAP:
        a.byteswap()
    return {e >> 3: e & 7 for e in a}


def entry_prefixes(values: Sequence[bytes | None], slot_nodes: dict[int, str]) -> dict[str, tuple[int, int, int]]:
    """Per node, the longest contiguous prefix of a chain it holds, counting HBM only / HBM+DRAM /
    any tier (what :func:`state.view.longest_prefixes` answers from masks), from the chain's
    stored values (holder entries; None: no holder). Only slots named in ``slot_nodes`` count.

    The work follows the holders, not the cluster: the first block's holders are the only
    candidates, each later block is looked at only for those still holding the whole prefix,
    and a block whose value equals the one before it (the same holders, written in the same
    order: a shared prefix stored by the same records) changes nothing and costs a compare.
    """
    if not values or not values[0] or not slot_nodes:
        return {}
    return _prefixes_of_runs(*_runs(values), slot_nodes)


def _runs(values: Sequence[bytes | None]) -> tuple[tuple[bytes, ...], tuple[int, ...], int]:
    """(the distinct values of a chain in order, the block each starts at, the block the
    walk stops at: the first without holders, or the chain's end); ``values[0]`` is set."""
    prev = values[0]
    if prev is None:  # (the callers check)
        return (), (), 0
    runs = [prev]
    starts = [0]
    i = 1
    n = len(values)
    while i < n:
        v = values[i]
        if v != prev:
            if not v:
                break
            runs.append(v)
            starts.append(i)
            prev = v
        i += 1
    return tuple(runs), tuple(starts), i


HolderSets = tuple[frozenset[int], frozenset[int], frozenset[int]]
"""A block value's holder slots: in any tier, in HBM or DRAM, in HBM."""


def holder_sets(value: bytes) -> HolderSets:
    """The slots a block's value names (:func:`holder_entries`), as the three sets the prefix
    walk intersects: holding it in any tier, in HBM or DRAM, in HBM."""
    d = holder_entries(value)
    return (frozenset(s for s, t in d.items() if t), frozenset(s for s, t in d.items() if t & 3),
            frozenset(s for s, t in d.items() if t & 1))


def _prefixes_of_runs(runs: Sequence[bytes], starts: Sequence[int], stop: int,
                      slot_nodes: dict[int, str],
                      sets: Callable[[bytes], HolderSets] = holder_sets) -> dict[str, tuple[int, int, int]]:
    """Per node, where its prefix ends in each tier count (HBM, +DRAM, any), from a chain's
    runs: the first run's holders are the candidates, and each later run ends, with set
    differences, the prefixes of those that do not hold it (in that tier count)."""
    any0, mid0, hbm0 = sets(runs[0])
    alive = any0 & slot_nodes.keys()  # slots holding the prefix in some tier
    a2 = mid0 & alive
    a1 = hbm0 & alive
    e0 = dict.fromkeys(alive - a1, 0)  # slot -> where its HBM prefix ends (absent: at ``stop``)
    e1 = dict.fromkeys(alive - a2, 0)
    e2: dict[int, int] = {}
    for v, i in zip(runs[1:], starts[1:]):
        if not alive:
            break
        any_, mid, hbm = sets(v)
        gone = alive - any_
        if gone:
            alive = alive - gone
            e2.update(dict.fromkeys(gone, i))
        if a2:
            gone = a2 - mid
            if gone:
                a2 = a2 - gone
                e1.update(dict.fromkeys(gone, i))
        if a1:
            gone = a1 - hbm
            if gone:
                a1 = a1 - gone
                e0.update(dict.fromkeys(gone, i))
    # Those still in HBM at the stop hold the whole chain in every tier count; every other
    # candidate's HBM prefix ended somewhere (e0).
    name = slot_nodes.__getitem__
    out = dict.fromkeys(map(name, a1), (stop, stop, stop))
    g1, g2 = e1.get, e2.get
    for s, x in e0.items():
        out[name(s)] = (x, g1(s, stop), g2(s, stop))
    return out


class PrefixWalk:
    """:func:`entry_prefixes` for one reader, remembering the answers for the ``size`` most
    recently read distinct holder patterns, and no more than ``max_holders`` holders in all
    (~120 bytes each: the bound on its memory).

    A hot prefix (a system prompt, a popular document) is read again and again with the same
    holders, so its blocks come back with the same values: a chain whose distinct values,
    their starting blocks and its stopping block equal an earlier one's (and whose slot names
    are the same mapping object: the node decoder hands out a new one when a slot moves) has
    the same answer, found for the cost of one pass of compares over the chain instead of one
    per holder. The answer is shared between reads: callers must not change it. A changed
    holder set changes the values, so nothing stale is ever answered."""

    def __init__(self, size: int = 1024, max_holders: int = 200_000, values: int = 8192) -> None:
        self.size = size
        self.max_holders = max_holders
        self.hits = 0
        self.misses = 0
        self._memo: dict[tuple[Any, ...], tuple[dict[int, str], dict[str, tuple[int, int, int]]]] = {}
        self._held = 0
        self._values = values
        self._sets: dict[bytes, HolderSets] = {}
        """Block value → its :func:`holder_sets`, for the ``values`` most recently decoded: the
        same holder set comes back in many chains (a tenant's system prompt under every
        document), so a chain read for the first time mostly decodes values seen before."""

    def holder_sets(self, value: bytes) -> HolderSets:
        """:func:`holder_sets`, remembered."""
        cache = self._sets
        got = cache.get(value)
        if got is None:
            if len(cache) >= self._values:
                for k in list(itertools.islice(cache, self._values // 2)):  # the older half
                    del cache[k]
            got = cache[value] = holder_sets(value)
        return got

    def __call__(self, values: Sequence[bytes | None], slot_nodes: dict[int, str]) -> dict[str, tuple[int, int, int]]:
        if not values or not values[0] or not slot_nodes:
            return {}
        key = _runs(values)
        memo = self._memo
        hit = memo.pop(key, None)
        if hit is not None and hit[0] is slot_nodes:
            memo[key] = hit  # most recently used last
            self.hits += 1
            return hit[1]
        self.misses += 1
        out = _prefixes_of_runs(*key, slot_nodes, self.holder_sets)
        if hit is not None:
            self._held -= len(hit[1])
        while memo and (len(memo) >= self.size or self._held + len(out) > self.max_holders):
            self._held -= len(memo.pop(next(iter(memo)))[1])  # the least recently used
        if len(out) <= self.max_holders:
            memo[key] = (slot_nodes, out)
            self._held += len(out)
        return out


def entry_holders(value: bytes, slot_nodes: dict[int, str]) -> dict[str, tuple[str, ...]]:
    """Which nodes a block's value names, in which tiers (names from ``schemas.TIERS``)."""
    out: dict[str, tuple[str, ...]] = {}
    for slot, tiers in holder_entries(value).items():
        node = slot_nodes.get(slot)
        if node is not None and tiers:
            out[node] = tuple(t for i, t in enumerate(TIERS) if tiers >> i & 1)
    return out


def blocks_field(tier: int) -> str:
    """The node attribute counting its blocks in ``tier`` (an index into ``schemas.TIERS``)."""
    return f"b{tier}"


BLOCKS_FIELDS = tuple(blocks_field(i) for i in range(len(TIERS)))
NODE_ATTRS = (SLOT_FIELD, HEARTBEAT_FIELD, STREAM_FIELD["kv"], STREAM_FIELD["hb"], *BLOCKS_FIELDS)
"""Every attribute a node may have in the node hash, in the order a delta read returns them."""


def node_field(node: str, attr: str) -> str:
    return f"{node}{SEP}{attr}"


def split_node_field(field: bytes) -> tuple[str, str]:
    """``<node>\\x1f<attr>`` → (node, attr)."""
    node, _, attr = field.decode().rpartition(SEP)
    return node, attr


def stream_text(stream: NodeStream, part: str) -> str:
    """One stream part as stored: ``"epoch,seq,gaps,missed"`` (kv) or ``"epoch,seq"`` (hb)."""
    return ",".join(map(str, stream.part(part)))


def parse_stream(kv: bytes | None, hbs: bytes | None) -> NodeStream:
    """The :class:`NodeStream` stored in a node's ``kv`` and ``hbs`` attributes."""
    e, q, g, m = map(int, kv.split(b",")) if kv else (-1, -1, 0, 0)
    he, hq = map(int, hbs.split(b",")) if hbs else (-1, -1)
    return NodeStream(epoch=e, seq=q, gaps=g, missed=m, hb_epoch=he, hb_seq=hq)


class ViewKeys:
    """The key names of one view namespace (computed once: the router builds keys per read)."""

    __slots__ = ("all_pattern", "base", "block_pattern", "block_prefix", "changes", "free", "generation",
                 "inflight", "meta", "nodes", "ns", "pending", "prefix", "rebuild", "reservations", "retired", "slots",
                 "version", "watermark")

    def __init__(self, ns: str) -> None:
        if any(c in ns for c in "|{}"):
            raise ValueError("a view namespace cannot contain '|', '{' or '}'")
        self.ns = ns
        p = self.prefix = f"{{{ns}}}|{LAYOUT}|"
        """What every key of the namespace starts with: the hash tag ``{ns}`` puts them all in one
        cluster slot; the layout version keeps a view written in another layout out of sight."""
        self.block_prefix = f"{p}b".encode()
        self.block_pattern = f"{p}b*"
        """SCAN pattern of the block keys (filter the matches with :meth:`block_of`)."""
        self.all_pattern = f"{p}*"
        self.nodes = f"{p}nodes"
        self.slots = f"{p}slots"
        self.meta = f"{p}meta"
        self.watermark = f"{p}wm"
        self.version = f"{p}ver"
        self.changes = f"{p}chg"
        self.base = f"{p}base"
        self.retired = f"{p}retired"
        self.free = f"{p}free"
        self.generation = f"{p}gen"
        self.rebuild = f"{p}rebuild"
        self.reservations = f"{p}resv-log"
        self.pending = f"{p}pend-log"
        self.inflight = f"{p}infl-log"

    def claim(self, producer: str) -> str:
        """The claim on ``producer``'s id (:class:`state.claim.ProducerClaim`)."""
        return f"{self.prefix}claim|{producer}"

    def block(self, key: int) -> bytes:
        return self.block_prefix + key.to_bytes(BLOCK_KEY_BYTES, "big")

    def blocks(self, chain: Sequence[int]) -> list[bytes]:
        pre = self.block_prefix
        return [pre + k.to_bytes(8, "big") for k in chain]  # 8 = BLOCK_KEY_BYTES (a literal: the hot loop)

    def blocks_resp(self, keys: Sequence[int]) -> bytes:
        """:meth:`blocks` of ``keys`` as RESP bulk strings back to back (``$<len>\\r\\n<key>\\r\\n``
        each): the bytes a command naming them carries for them, built in one numpy pass (a
        view write names every block key it touches: ~100k a second)."""
        head = b"$%d\r\n" % (len(self.block_prefix) + BLOCK_KEY_BYTES) + self.block_prefix
        row = np.frombuffer(head + bytes(BLOCK_KEY_BYTES) + b"\r\n", dtype=np.uint8)
        out = np.empty((len(keys), len(row)), dtype=np.uint8)
        out[:] = row
        numbers = np.array(keys, dtype=">u8").view(np.uint8).reshape(-1, BLOCK_KEY_BYTES)
        out[:, len(head):len(head) + BLOCK_KEY_BYTES] = numbers
        return out.tobytes()

    def block_of(self, key: bytes) -> int | None:
        """The block key a Redis key stores, or None for a key that is not a block key."""
        pre = self.block_prefix
        if len(key) != len(pre) + BLOCK_KEY_BYTES or not key.startswith(pre):
            return None
        return int.from_bytes(key[len(pre):], "big")


class NodeHashDecoder:
    """Decodes the ``ns|nodes`` hash into node states, whole (:meth:`decode`) or node by node
    (:meth:`update`, for a delta read), reusing the previous state of a node whose fields did
    not change."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple[Any, ...], NodeState]] = {}
        self._attrs: dict[str, dict[str, bytes]] = {}
        self._states: dict[str, NodeState] = {}
        self._order: list[str] = []
        self._slots: dict[int, str] = {}
        self._out: tuple[tuple[NodeState, ...], dict[int, str]] = ((), {})

    def clear(self) -> None:
        self._cache.clear()
        self._attrs.clear()
        self._states.clear()
        self._order = []
        self._slots = {}
        self._out = ((), {})

    def decode(self, raw: Mapping[bytes, bytes]) -> tuple[tuple[NodeState, ...], dict[int, str]]:
        """(node states sorted by id, slot → node for nodes holding a slot), from the whole hash."""
        per: dict[str, dict[str, bytes]] = {}
        for f, v in raw.items():
            node, attr = split_node_field(f)
            per.setdefault(node, {})[attr] = v
        self._attrs = per
        self._states = {node: self._state(node, a) for node, a in per.items()}
        self._order = sorted(per)
        self._slots = {int(a[SLOT_FIELD]): node for node, a in per.items() if SLOT_FIELD in a}
        self._out = (tuple(self._states[n] for n in self._order), dict(self._slots))
        return self._out

    def update(self, changed: Mapping[str, Mapping[str, bytes]]) -> tuple[tuple[NodeState, ...], dict[int, str]]:
        """The picture after ``changed`` (node → all its attributes now; empty: the node is
        gone) replaced those nodes' entries: work in proportion to the nodes that changed."""
        if not changed:
            return self._out
        names_moved = False
        slots_moved = False
        for node, a in changed.items():
            old = self._attrs.get(node)
            if old is not None and old.get(SLOT_FIELD) != a.get(SLOT_FIELD):
                slots_moved = True
            if a:
                if old is None:
                    names_moved = True
                    slots_moved = slots_moved or SLOT_FIELD in a
                self._attrs[node] = dict(a)
                self._states[node] = self._state(node, a)
            elif old is not None:
                names_moved = True
                del self._attrs[node]
                del self._states[node]
        if names_moved:
            self._order = sorted(self._attrs)
        if slots_moved:
            self._slots = {int(a[SLOT_FIELD]): n for n, a in self._attrs.items() if SLOT_FIELD in a}
        states = self._states
        self._out = (tuple(states[n] for n in self._order), dict(self._slots) if slots_moved else self._out[1])
        return self._out

    def _state(self, node: str, a: Mapping[str, bytes]) -> NodeState:
        kv, hbs = STREAM_FIELD["kv"], STREAM_FIELD["hb"]
        sig = (a.get(HEARTBEAT_FIELD), a.get(kv), *(a.get(f) for f in BLOCKS_FIELDS))
        hit = self._cache.get(node)
        if hit is not None and hit[0] == sig:
            return hit[1]
        st = parse_stream(a.get(kv), a.get(hbs))
        hb = json.loads(a[HEARTBEAT_FIELD]) if HEARTBEAT_FIELD in a else {}
        blocks = {}
        for t, f in zip(TIERS, BLOCKS_FIELDS):
            n = int(a.get(f, 0) or 0)
            if n > 0:
                blocks[t] = n
        state = NodeState(
            node_id=node,
            role=hb.pop("role", "prefill"),
            epoch=max(st.epoch, 0),
            last_seq=st.seq,
            seq_gaps=st.gaps,
            blocks=blocks,
            **hb,
        )
        self._cache[node] = (sig, state)
        return state


def node_streams(raw: Mapping[bytes, bytes]) -> dict[str, NodeStream]:
    """Every node's stored :class:`NodeStream`, from the whole ``ns|nodes`` hash."""
    parts: dict[str, list[bytes | None]] = {}
    kv, hbs = STREAM_FIELD["kv"], STREAM_FIELD["hb"]
    for f, v in raw.items():
        node, attr = split_node_field(f)
        row = parts.setdefault(node, [None, None])
        if attr == kv:
            row[0] = v
        elif attr == hbs:
            row[1] = v
    return {n: parse_stream(*row) for n, row in parts.items()}


def snapshot_from_replies(
    time_reply: Sequence[Any],
    values: Sequence[bytes | None],
    nodes: tuple[NodeState, ...],
    slot_nodes: dict[int, str],
    watermark: Iterable[tuple[bytes, bytes]],
    now_ms: int | None = None,
    walk: Any = entry_prefixes,
) -> ViewSnapshot:
    """A :class:`ViewSnapshot` from the replies of the one-round-trip read: ``TIME``, the
    ``MGET`` of the chain's block keys, the decoded node hash, the watermark's pairs
    (``walk``: :func:`entry_prefixes`, or a reader's :class:`PrefixWalk`)."""
    if now_ms is None:
        sec, usec = time_reply
        now_ms = int(sec) * 1000 + int(usec) // 1000
    prefix = walk(values, slot_nodes)
    return ViewSnapshot(now_ms=now_ms, nodes=nodes, prefix=prefix,
                        watermark={k.decode(): int(v) for k, v in watermark})


def dump_from_replies(
    keys: ViewKeys,
    raw_nodes: Mapping[bytes, bytes],
    blocks: Iterable[tuple[bytes, bytes | None]],
    watermark: Iterable[tuple[bytes, bytes]],
) -> dict[str, Any]:
    """``ViewReader.dump()`` from the node hash, ``(Redis key, value)`` of the block keys
    (others are ignored) and the watermark's pairs."""
    nodes, slot_nodes = NodeHashDecoder().decode(raw_nodes)
    held = []
    for k, v in blocks:
        block = keys.block_of(k)
        if block is not None and v:
            held.append((block, entry_holders(v, slot_nodes)))
    wm = {k.decode(): int(v) for k, v in watermark}
    return canonical_dump(nodes, node_streams(raw_nodes), held, wm)
