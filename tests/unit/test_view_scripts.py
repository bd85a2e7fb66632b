"""The view's write script is given every key it touches: the namespace's fixed keys, then each
block key its operations name, all under the namespace's hash tag (one Redis Cluster slot)."""

from __future__ import annotations

import re

from hiredis import pack_command

from state.fold import AddBlocks, ClearNode, RemoveBlocks, SetHeartbeat
from state.keys import ViewKeys
from state.redis_view import _APPLY_LUA, _COMPACT_LUA, _FREE_LUA, _GENERATION_LUA, _REBUILD_LUA, encode_ops, script_call


def test_block_operations_point_at_their_declared_keys():
    keys = ViewKeys("cv")
    ops = encode_ops([AddBlocks("a", 0, (1, 2, 3)), SetHeartbeat("a", {"role": "prefill"}), ClearNode("b"),
                      RemoveBlocks("c", 2, (2**64 - 1,))])
    call, groups = script_call(keys, [["kv:0", 5, ops, [], 4], ["", 0, encode_ops([AddBlocks("d", 1, (7,))]), [], -2]])
    declared = call.names()
    assert len(call) == len(declared) == 9 + 5
    # What the store sends for the block keys is what packing their names one by one would send.
    assert pack_command(("EVALSHA", *declared)).endswith(call.resp().resp)
    fixed = [keys.generation, keys.nodes, keys.watermark, keys.slots, keys.meta, keys.free, keys.retired,
             keys.version, keys.changes]
    assert declared[:9] == fixed
    for _, _, enc, _, _ in groups:
        for op in enc:
            if op[0] in (1, 2):
                first, n = op[3], op[4]
                named = declared[first - 1:first - 1 + n]  # Lua's KEYS are 1-based
                assert all(isinstance(k, bytes) and keys.block_of(k) is not None for k in named)
    add, _, _, rem = groups[0][2]
    assert [keys.block_of(k) for k in declared[add[3] - 1:add[3] + 2]] == [1, 2, 3]
    assert keys.block_of(declared[rem[3] - 1]) == 2**64 - 1
    assert keys.block_of(declared[groups[1][2][0][3] - 1]) == 7
    assert all((k if isinstance(k, str) else k.decode("latin-1")).startswith("{cv}|") for k in declared)


def test_no_script_builds_a_key_name():
    """Keys come from KEYS only: no script concatenates a namespace into a key name."""
    for script in (_APPLY_LUA, _COMPACT_LUA, _FREE_LUA, _GENERATION_LUA, _REBUILD_LUA):
        assert "ns .." not in script and "|" not in re.sub(r"--[^\n]*", "", script)
        for call in re.findall(r"redis\.call\('(\w+)', ([^,)]+)", script):
            cmd, first = call
            if cmd in ("TIME",):
                continue
            assert first.startswith("KEYS[") or first in (
                "nodes", "wmkey", "slotkey", "metakey", "freekey", "retiredkey", "k", "unpack(KEYS", "unpack(sets", "unpack(dels"), (cmd, first)
    # The apply script's batched writes name only keys it read from KEYS (``k``, kept as they came).
    code = re.sub(r"--[^\n]*", "", _APPLY_LUA)
    assert re.findall(r"sets\[n \+ 1\] = (\w+)", code) == ["k"]
    assert re.findall(r"dels\[#dels \+ 1\] = ([^\n]+)", code) == ["sets[j]"]
    assert re.findall(r"local k = ([^\n]+)", code) == ["KEYS[i]"]
