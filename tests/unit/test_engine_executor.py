"""The emulated engine's KV command executor: steps on its caches, its own KV events, one result per id."""

from __future__ import annotations

from conductor.bridge.wire import EngineBlockRemoved, EngineBlockStored
from conductor.costmodel.profiles import load_profile
from conductor.harness.engine.emulated import EmulatedEngine, EngineConfig, engine_hashes
from conductor.harness.engine.executor import EngineCommandExecutor
from schemas import KvCommand, chain_keys

BS = 4
TOKENS = list(range(100, 116))  # 4 blocks
KEYS = chain_keys(TOKENS, BS)


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[object]] = []

    def start(self) -> None: ...

    async def publish(self, ts: float, events: list[object]) -> None:
        self.batches.append(list(events))


def engine(node: str, dram: int = 0) -> tuple[EmulatedEngine, Recorder]:
    pub = Recorder()
    cfg = EngineConfig(node_id=node, role="prefill", block_size=BS, kv_blocks=64, dram_blocks=dram, time_scale=1e6)
    return EmulatedEngine(cfg, load_profile("llama3-8b-a100x1"), pub, clock_ms=lambda: 1_000), pub  # type: ignore[arg-type]


def command(action: str, **kw: object) -> KvCommand:
    base: dict[str, object] = {"command_id": f"c-{action}", "action": action, "block_keys": KEYS, "from_node": "holder",
                                   "token_ids": TOKENS, "block_size": BS, "deadline_ms": 5_000}
    if action == "replicate":
        base.update(to_node="target", to_tier="hbm")
    elif action == "demote":
        base.update(from_node="target", to_tier="dram")
    else:
        base.update(from_node="target")
    base.update(kw)
    return KvCommand(**base)  # type: ignore[arg-type]


async def test_replicate_writes_the_prefix_and_publishes_it_once():
    eng, pub = engine("target")
    results = []

    async def sink(envs):
        results.extend(e.body for e in envs)

    ex = EngineCommandExecutor(eng, sink, clock_ms=lambda: 1_000)
    r = await ex.handle(command("replicate"))
    assert (r.status, r.blocks) == ("done", 4) and r.bytes_moved == 4 * BS * eng.profile.kv_bytes_per_token
    [stored] = [e for b in pub.batches for e in b if isinstance(e, EngineBlockStored)]
    assert list(stored.token_ids) == TOKENS and stored.tier == "hbm"  # the bridge derives KEYS from these
    assert all(h in eng.cache for h in engine_hashes(TOKENS, BS, eng.salt))
    again = await ex.handle(command("replicate"))
    assert again == r and len(pub.batches) == 1 and [x.status for x in results] == ["done", "done"]


async def test_demote_and_evict_publish_their_proofs():
    eng, pub = engine("target", dram=16)
    await eng.write_prefix(engine_hashes(TOKENS, BS, eng.salt), TOKENS)
    pub.batches.clear()
    ex = EngineCommandExecutor(eng, clock_ms=lambda: 1_000)
    assert (await ex.handle(command("demote"))).status == "done"
    [batch] = pub.batches
    assert [type(e).__name__ for e in batch] == ["EngineBlockStored", "EngineBlockRemoved"]
    assert batch[0].tier == "dram" and batch[1].tier == "hbm" and len(eng.cache) == 0 and len(eng.dram) == 4
    r = await ex.handle(command("evict", from_tier="dram", command_id="e1"))
    assert (r.status, r.blocks) == ("done", 4) and pub.batches[-1] == [EngineBlockRemoved(tuple(batch[1].block_hashes), "dram")]


async def test_expired_foreign_and_tokenless_commands_change_nothing():
    eng, pub = engine("target")
    ex = EngineCommandExecutor(eng, clock_ms=lambda: 9_000)
    assert (await ex.handle(command("replicate"))).status == "expired"
    assert await ex.handle(command("replicate", to_node="other")) is None
    r = await ex.handle(command("evict", token_ids=None, block_size=None, command_id="t"))
    assert (r.status, r.error) == ("failed", "unsupported")
    assert pub.batches == [] and len(eng.cache) == 0
