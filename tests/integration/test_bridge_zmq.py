"""The bridge against a real vLLM-compatible ZMQ publisher: late join, gap → replay, restart → new epoch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from conductor.bridge.publisher import EventPublisher
from conductor.bridge.runner import Bridge, BridgeConfig
from conductor.bridge.wire import EngineBlockRemoved, EngineBlockStored
from schemas import AllBlocksCleared, BlocksRemoved, BlocksStored, Envelope, chain_keys

TOKENS = list(range(5000, 5000 + 16 * 8))


def stored(i: int) -> EngineBlockStored:
    """Block i of one chain (engine hash 100+i, parent 100+i-1)."""
    return EngineBlockStored(
        block_hashes=(100 + i,),
        parent_block_hash=None if i == 0 else 99 + i,
        token_ids=tuple(TOKENS[16 * i : 16 * (i + 1)]),
        block_size=16,
        tier="hbm",
    )


KEYS = chain_keys(TOKENS, 16)


class Collected:
    def __init__(self) -> None:
        self.envs: list[Envelope] = []
        self.heartbeats: list[Envelope] = []

    async def sink(self, envs: list[Envelope]) -> None:
        self.envs.extend(envs)

    async def hb_sink(self, envs: list[Envelope]) -> None:
        self.heartbeats.extend(envs)

    def stored_keys(self, epoch: int | None = None) -> list[int]:
        return [
            k
            for e in self.envs
            if isinstance(e.body, BlocksStored) and (epoch is None or e.epoch == epoch)
            for k in e.body.block_keys or ()
        ]


async def until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def start(pub: EventPublisher, out: Collected, **kw: object) -> tuple[Bridge, asyncio.Event, asyncio.Task[None]]:
    cfg = BridgeConfig(node_id="p0", role="prefill", zmq_endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                       replay_timeout_s=1.0, **kw)  # type: ignore[arg-type]
    bridge = Bridge(cfg, out.sink, out.hb_sink)
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    await asyncio.wait_for(bridge.ready.wait(), 10)
    return bridge, stop, task


async def run_then_restart(pub: EventPublisher, out: Collected) -> tuple[Bridge, asyncio.Event, asyncio.Task[None], int, EventPublisher]:
    """A bridge follows three stored blocks; then the engine restarts on the same ports
    (sequence from 0 again). Returns the bridge, its first epoch and the new publisher."""
    bridge, stop, task = await start(pub, out, heartbeat_s=None)
    for i in range(3):
        await pub.publish(0.0, [stored(i)])
    await until(lambda: len(out.stored_keys()) == 3)
    first_epoch = out.envs[-1].epoch
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    await pub.close()
    await asyncio.sleep(0.2)
    again = EventPublisher(endpoint, replay)
    again.start()
    return bridge, stop, task, first_epoch, again


async def stop_all(stop: asyncio.Event, task: asyncio.Task[None], *pubs: EventPublisher) -> None:
    stop.set()
    await asyncio.wait_for(task, 5)
    for p in pubs:
        await p.close()


@pytest.fixture
async def pub() -> EventPublisher:
    p = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    p.start()
    return p


async def test_late_join_replays_what_the_engine_stored_before(pub: EventPublisher) -> None:
    for i in range(3):
        await pub.publish(0.0, [stored(i)])
    out = Collected()
    _bridge, stop, task = await start(pub, out, heartbeat_s=None)
    assert out.stored_keys() == KEYS[:3]
    await pub.publish(0.0, [stored(3), EngineBlockRemoved((100,), "hbm")])
    await until(lambda: any(isinstance(e.body, BlocksRemoved) for e in out.envs))
    await stop_all(stop, task, pub)
    assert out.stored_keys() == KEYS[:4]
    assert isinstance(out.envs[0].body, AllBlocksCleared)  # every epoch opens with a clear
    assert [e.producer_seq for e in out.envs] == list(range(len(out.envs)))  # no holes
    assert {e.producer_id for e in out.envs} == {"p0"} and len({e.epoch for e in out.envs}) == 1
    assert out.envs[-1].body == BlocksRemoved(block_keys=[KEYS[0]], tier="hbm")


async def test_a_lost_message_is_fetched_from_the_replay_socket(pub: EventPublisher) -> None:
    out = Collected()
    bridge, stop, task = await start(pub, out, heartbeat_s=None)
    await pub.publish(0.0, [stored(0)])
    await until(lambda: len(out.stored_keys()) == 1)
    await pub.publish(0.0, [stored(1)], send=False)  # the subscriber never sees it
    await pub.publish(0.0, [stored(2)])
    await until(lambda: len(out.stored_keys()) == 3)
    await stop_all(stop, task, pub)
    assert out.stored_keys() == KEYS[:3]
    assert bridge.counts["gaps"] == 1 and bridge.counts["gaps_unfilled"] == 0
    assert len({e.epoch for e in out.envs}) == 1


async def test_a_gap_replay_cannot_fill_marks_the_node_stale() -> None:
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=1)
    pub.start()
    out = Collected()
    bridge, stop, task = await start(pub, out, heartbeat_s=None)
    await pub.publish(0.0, [stored(0)])
    await until(lambda: len(out.stored_keys()) == 1)
    first_epoch = out.envs[-1].epoch
    await pub.publish(0.0, [EngineBlockRemoved((100,), "hbm")], send=False)  # lost, and gone from the buffer
    await pub.publish(0.0, [stored(1)], send=False)
    await pub.publish(0.0, [stored(0)])
    await until(lambda: bridge.counts["gaps_unfilled"] == 1 and len(out.stored_keys()) == 2)
    await stop_all(stop, task, pub)
    later = [e for e in out.envs if e.epoch > first_epoch]
    # The node is cleared (the lost removal can no longer be wrong), then rebuilt from what follows.
    assert isinstance(later[0].body, AllBlocksCleared) and later[0].producer_seq == 0
    assert out.stored_keys(later[0].epoch) == [KEYS[0]]


async def test_an_engine_restart_opens_a_new_epoch(pub: EventPublisher) -> None:
    out = Collected()
    bridge, stop, task, first_epoch, again = await run_then_restart(pub, out)
    await asyncio.sleep(0.3)  # let the subscriber reconnect
    await again.publish(0.0, [stored(0)])
    await until(lambda: bridge.epoch > first_epoch and len(out.stored_keys(bridge.epoch)) == 1)
    await stop_all(stop, task, again)
    later = [e for e in out.envs if e.epoch == bridge.epoch]
    assert isinstance(later[0].body, AllBlocksCleared)
    assert out.stored_keys(bridge.epoch) == [KEYS[0]]
    assert bridge.counts["epoch_restart"] == 1


async def test_heartbeats_only_while_the_engine_answers(pub: EventPublisher) -> None:
    out = Collected()
    _bridge, stop, task = await start(pub, out, heartbeat_s=0.1)
    await until(lambda: len(out.heartbeats) >= 2)
    assert out.heartbeats[0].body.role == "prefill"  # type: ignore[union-attr]
    await pub.close()  # the engine dies
    await asyncio.sleep(0.5)
    n = len(out.heartbeats)
    await asyncio.sleep(0.5)
    assert len(out.heartbeats) == n
    await stop_all(stop, task)


async def test_a_restarted_engine_already_past_the_old_sequence_is_not_mixed_with_the_old_run(pub: EventPublisher) -> None:
    out = Collected()
    bridge, stop, task, first_epoch, again = await run_then_restart(pub, out)
    # The new run stores other blocks (a chain of its own) and gets past seq 3 unseen.
    other = [EngineBlockStored((900 + i,), None if i == 0 else 899 + i, tuple(range(16 * i, 16 * i + 16)), 16, "hbm")
             for i in range(5)]
    for ev in other[:4]:
        await again.publish(0.0, [ev], send=False)
    await asyncio.sleep(0.5)  # the subscriber reconnects
    await again.publish(0.0, [other[4]])  # seq 4: "after" the old run's 0..2
    await until(lambda: bridge.epoch > first_epoch and len(out.stored_keys(bridge.epoch)) == 5)
    await stop_all(stop, task, again)
    assert out.stored_keys(bridge.epoch) == chain_keys(list(range(80)), 16)
    assert bridge.counts["reconnects"] >= 1 and bridge.counts["epoch_restart"] == 1


async def test_a_batch_seen_twice_replay_and_live_is_applied_once(pub: EventPublisher) -> None:
    from conductor.bridge.wire import seq_frame

    out = Collected()
    bridge, stop, task = await start(pub, out, heartbeat_s=None)
    for i in range(3):
        await pub.publish(0.0, [stored(i)])
    await until(lambda: len(out.stored_keys()) == 3)
    seq, payload = pub.buffer[1]
    await pub.pub.send_multipart([pub.topic, seq_frame(seq), payload])  # the same batch again
    await pub.publish(0.0, [stored(3)])
    await until(lambda: len(out.stored_keys()) == 4)
    await stop_all(stop, task, pub)
    assert out.stored_keys() == KEYS[:4]
    assert bridge.counts["duplicates"] == 1 and bridge.counts["epoch_restart"] == 0
    assert len({e.epoch for e in out.envs}) == 1
