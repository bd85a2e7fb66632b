"""The executor core: each action's steps and proof events, idempotence, expiry, failures."""

from __future__ import annotations

import pytest

from conductor.balance.executor import CommandMemory, execute
from schemas import BlocksMigrated, BlocksRemoved, BlocksStored, KvCommand, decode, encode, envelope
from schemas.codec import pack_foreign


class Cache:
    """A node's tiers as plain sets (what the emulated engine and the simulator adapt to)."""

    def __init__(self, **tiers: set[int]) -> None:
        self.blocks = tiers
        self.caps = {t: 100 for t in tiers}

    def tiers(self):
        return tuple(self.blocks)

    def holds(self, key, tier):
        return key in self.blocks[tier]

    def capacity(self, tier):
        return self.caps[tier]

    def apply(self, steps):
        for s in steps:
            if s.op == "remove":
                self.blocks[s.tier] -= set(s.keys)
            else:
                self.blocks[s.tier] |= set(s.keys)


def cmd(action, keys=(1, 2, 3), **kw):
    base = {"command_id": f"c-{action}", "action": action, "block_keys": list(keys), "from_node": "a",
            "deadline_ms": 10_000}
    if action == "replicate":
        base.update(to_node="b", to_tier="hbm")
    elif action in ("migrate", "demote"):
        base.update(to_tier="dram")
    base.update(kw)
    return KvCommand(**base)


def test_replicate_pulls_missing_blocks_and_proves_it_with_a_migrated_event():
    cache = Cache(hbm={1})
    ex = execute(cmd("replicate"), node="b", cache=cache, now_ms=0, memory=CommandMemory(), bytes_per_block=10)
    assert ex.result.status == "done" and (ex.result.blocks, ex.result.bytes_moved) == (2, 20)
    assert [(s.op, s.keys, s.from_node) for s in ex.steps] == [("pull", (2, 3), "a")]
    assert ex.events == (BlocksMigrated(mode="replicate", block_keys=[2, 3], from_node="a", from_tier="hbm",
                                        to_node="b", to_tier="hbm"),)


def test_replicate_moves_only_what_the_source_still_holds_as_a_prefix():
    ex = execute(cmd("replicate"), node="b", cache=Cache(hbm=set()), now_ms=0, memory=CommandMemory(), source_prefix=2)
    assert ex.steps[0].keys == (1, 2)
    gone = execute(cmd("replicate"), node="b", cache=Cache(hbm=set()), now_ms=0, memory=CommandMemory(),
                   source_prefix=0)
    assert (gone.result.status, gone.result.error, gone.steps) == ("failed", "not_held", ())


def test_a_repeated_command_id_changes_nothing():
    cache, mem = Cache(hbm={1, 2, 3}), CommandMemory()
    c = cmd("evict")
    first = execute(c, node="a", cache=cache, now_ms=0, memory=mem)
    cache.apply(first.steps)
    again = execute(c, node="a", cache=cache, now_ms=0, memory=mem)
    assert again.repeat and again.steps == () and again.events == () and again.result == first.result
    assert cache.blocks["hbm"] == set()


def test_commands_are_idempotent_on_state_even_without_memory():
    cache = Cache(hbm={1, 2, 3}, dram=set())
    first = execute(cmd("demote"), node="a", cache=cache, now_ms=0, memory=CommandMemory())
    cache.apply(first.steps)
    second = execute(cmd("demote"), node="a", cache=cache, now_ms=0, memory=CommandMemory())
    assert (second.result.status, second.result.blocks, second.steps) == ("done", 0, ())
    rep = Cache(hbm={1, 2, 3})
    assert execute(cmd("replicate"), node="b", cache=rep, now_ms=0, memory=CommandMemory()).steps == ()


def test_expired_commands_are_not_carried_out():
    ex = execute(cmd("evict"), node="a", cache=Cache(hbm={1, 2, 3}), now_ms=10_001, memory=CommandMemory())
    assert (ex.result.status, ex.steps, ex.events) == ("expired", (), ())
    no_deadline = cmd("evict", deadline_ms=None)
    assert execute(no_deadline, node="a", cache=Cache(hbm={1}), now_ms=10**12, memory=CommandMemory()).result.status == "done"


@pytest.mark.parametrize(
    "c, cache, error",
    [
        (cmd("replicate", to_tier="ssd"), Cache(hbm=set()), "unsupported"),
        (cmd("demote"), Cache(hbm=set(), dram=set()), "not_held"),
        (cmd("replicate", keys=range(200)), Cache(hbm=set()), "no_room"),
    ],
)
def test_failures_name_their_reason_and_change_nothing(c, cache, error):
    ex = execute(c, node=c.executor, cache=cache, now_ms=0, memory=CommandMemory())
    assert (ex.result.status, ex.result.error, ex.steps, ex.events) == ("failed", error, (), ())
    assert ex.result.reason


def test_demote_is_proven_as_an_offload_and_migrate_as_a_migration():
    ex = execute(cmd("demote"), node="a", cache=Cache(hbm={1, 2}, dram={2}), now_ms=0, memory=CommandMemory())
    assert ex.events == (BlocksStored(block_keys=[1], tier="dram"), BlocksRemoved(block_keys=[1, 2], tier="hbm"))
    mig = execute(cmd("migrate"), node="a", cache=Cache(hbm={1, 2}, dram=set()), now_ms=0, memory=CommandMemory())
    assert mig.events == (BlocksMigrated(mode="migrate", block_keys=[1, 2], from_node="a", from_tier="hbm",
                                         to_node="a", to_tier="dram"),)
    assert [s.op for s in mig.steps] == ["store", "remove"]


def test_commands_for_another_node_are_ignored():
    assert execute(cmd("replicate"), node="a", cache=Cache(hbm=set()), now_ms=0, memory=CommandMemory()) is None
    assert cmd("replicate").executor == "b" and cmd("evict").executor == "a"


def test_inconsistent_commands_do_not_validate():
    with pytest.raises(ValueError):
        cmd("replicate", to_node="a")
    with pytest.raises(ValueError):
        cmd("demote", to_tier="hbm")
    with pytest.raises(ValueError):
        cmd("migrate", to_node="elsewhere")


def test_v1_commands_decode_with_a_stable_id():
    body = {"kind": "kv_command", "action": "replicate", "block_keys": [1, 2], "from_node": "a", "from_tier": "hbm",
            "to_node": "b", "to_tier": "hbm", "reason": "old"}
    raw = pack_foreign({"s": "kv_command", "v": 1, "id": "e1", "p": "bal", "q": 0, "t": 5, "b": body})
    a, b = decode(raw).body, decode(raw).body
    assert a.command_id == b.command_id and a.command_id.startswith("v1-") and a.deadline_ms is None
    assert decode(encode(envelope(a, producer_id="x", producer_seq=0, ts_ms=1))).body == a


# --- commands that act on a shared pool (a store node with no process of its own) ------------


class Pool:
    """A shared pool as a set of keys (what a joined engine reads of the store)."""

    node = "kv-pool"
    tier = "dram"

    def __init__(self, keys=(), room=100):
        self.keys = set(keys)
        self.room = room

    def holds(self, key):
        return key in self.keys

    def capacity(self):
        return self.room

    def apply(self, steps):
        for s in steps:
            (self.keys.difference_update if s.op == "remove" else self.keys.update)(s.keys)


def to_pool(**kw):
    return cmd("replicate", to_node="kv-pool", to_tier="dram", by_node="a", command_id="c-pool", **kw)


def test_a_replicate_into_the_pool_is_pushed_by_the_holder_and_proven_on_the_pool_node():
    c = to_pool()
    assert c.executor == "a"
    pool = Pool({1})
    ex = execute(c, node="a", cache=Cache(hbm={1, 2, 3}), now_ms=0, memory=CommandMemory(), pool=pool,
                 bytes_per_block=10)
    assert (ex.result.status, ex.result.blocks, ex.result.bytes_moved) == ("done", 2, 20)
    assert [(s.op, s.keys, s.from_tier, s.to_node) for s in ex.steps] == [("push", (2, 3), "hbm", "kv-pool")]
    assert ex.events == (BlocksMigrated(mode="replicate", block_keys=[2, 3], from_node="a", from_tier="hbm",
                                        to_node="kv-pool", to_tier="dram"),)


def test_pushing_into_the_pool_twice_puts_once():
    pool, memory, c = Pool(), CommandMemory(), to_pool()
    first = execute(c, node="a", cache=Cache(hbm={1, 2, 3}), now_ms=0, memory=memory, pool=pool)
    pool.apply(first.steps)
    again = execute(c, node="a", cache=Cache(hbm={1, 2, 3}), now_ms=0, memory=memory, pool=pool)
    assert again.repeat and again.steps == () and again.result == first.result
    # A new id (or an executor that forgot its ids) finds the blocks there: nothing is put.
    fresh = execute(c.model_copy(update={"command_id": "c-pool-2"}), node="a", cache=Cache(hbm={1, 2, 3}),
                    now_ms=0, memory=CommandMemory(), pool=pool)
    assert (fresh.result.status, fresh.result.blocks, fresh.steps) == ("done", 0, ())


@pytest.mark.parametrize(("cache", "pool", "status", "error", "pushed"), [
    (Cache(hbm={1, 3}), Pool(), "done", None, (1,)),           # only the leading run held here
    (Cache(hbm={2, 3}), Pool(), "failed", "not_held", None),   # not the first block
    (Cache(hbm={1, 2, 3}), Pool(room=2), "failed", "no_room", None),
    (Cache(hbm={1, 2, 3}), None, "failed", "unsupported", None),  # not joined to a pool
])
def test_pushing_into_the_pool_takes_a_held_leading_run_and_fails_with_a_code(cache, pool, status, error, pushed):
    ex = execute(to_pool(), node="a", cache=cache, now_ms=0, memory=CommandMemory(), pool=pool)
    assert (ex.result.status, ex.result.error) == (status, error), ex.result.reason
    assert [s.keys for s in ex.steps] == ([pushed] if pushed else [])


def test_a_pool_command_past_its_deadline_expires():
    ex = execute(to_pool(), node="a", cache=Cache(hbm={1, 2, 3}), now_ms=20_000, memory=CommandMemory(), pool=Pool())
    assert (ex.result.status, ex.steps) == ("expired", ())


def test_an_evict_from_the_pool_is_a_remove_there_by_a_joined_engine():
    c = cmd("evict", from_node="kv-pool", from_tier="dram", by_node="e1", command_id="c-ev")
    assert c.executor == "e1"
    pool = Pool({1, 3, 9})
    ex = execute(c, node="e1", cache=Cache(hbm=set()), now_ms=0, memory=CommandMemory(), pool=pool)
    assert (ex.result.status, ex.result.blocks) == ("done", 2)
    assert [(s.op, s.tier, s.keys, s.to_node) for s in ex.steps] == [("remove", "dram", (1, 3), "kv-pool")]
    assert ex.events == (BlocksRemoved(block_keys=[1, 3], tier="dram", node="kv-pool"),)
    pool.apply(ex.steps)
    assert pool.keys == {9}
    gone = execute(c.model_copy(update={"command_id": "c-ev2"}), node="e1", cache=Cache(hbm=set()), now_ms=0,
                   memory=CommandMemory(), pool=pool)
    assert (gone.result.status, gone.result.blocks, gone.steps) == ("done", 0, ())
    demote = cmd("demote", from_node="kv-pool", from_tier="dram", to_tier="ssd", by_node="e1")
    ex = execute(demote, node="e1", cache=Cache(hbm=set()), now_ms=0, memory=CommandMemory(), pool=pool)
    assert (ex.result.status, ex.result.error) == ("failed", "unsupported")  # the pool's tier is its last


def test_a_replicate_is_carried_out_by_its_source_or_its_target_only():
    with pytest.raises(ValueError):
        cmd("replicate", by_node="third")


def test_v2_commands_decode_with_the_default_executor():
    body = {"kind": "kv_command", "command_id": "x", "action": "replicate", "block_keys": [1], "from_node": "a",
            "to_node": "b", "to_tier": "hbm"}
    c = decode(pack_foreign({"s": "kv_command", "v": 2, "id": "e1", "p": "bal", "q": 0, "t": 5, "b": body})).body
    assert c.by_node is None and c.executor == "b"
