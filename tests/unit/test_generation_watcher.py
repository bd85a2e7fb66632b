"""The view-generation watcher, driven tick by tick with no broker: a lost, rolled-back or
rebuilding view has its assigned partitions read back from the log; a steady one is left alone."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from schemas.errors import ViewRefused, ViewStoreError
from state.view import RebuildingView
from streams.generation import GenerationWatcher
from streams.ingest import RawRecord
from streams.resume import ResumeGuard, TopicLane

KV, HB = "kv", "hb"


class FakeView:
    """The generation, fences and rebuild marks of a view (the part of RedisViewStore the
    watcher and the guard use), in memory: a fake for a unit test of the watcher's logic."""

    def __init__(self) -> None:
        self.gen: str | None = "g1"
        self.generation: str | None = "g1"
        self.wm: dict[str, int] = {}
        self.rebuild: dict[str, int] = {}
        self.marked: list[dict[str, int]] = []
        self.down = False
        self.gens = 1

    async def fences(self) -> tuple[str | None, dict[str, int]]:
        if self.down:
            raise ViewStoreError("view read failed: connection refused")
        return self.gen, dict(self.wm)

    async def watermark(self) -> dict[str, int]:
        return dict(self.wm)

    async def adopt_generation(self, partitions: Sequence[str] = ()) -> tuple[str, bool]:
        created = self.gen is None
        if created:
            self.gens += 1
            self.gen = f"g{self.gens}"
            self.rebuild = {p: -1 for p in partitions}
        assert self.gen is not None
        self.generation = self.gen
        return self.gen, created

    async def rebuild_pending(self) -> dict[str, int]:
        return dict(self.rebuild)

    async def mark_rebuilding(self, targets: dict[str, int], generation: str) -> None:
        if generation != self.gen:
            return
        self.marked.append(dict(targets))
        for tp, end in targets.items():
            if self.wm.get(tp, -1) >= end - 1:
                self.rebuild.pop(tp, None)
            else:
                self.rebuild[tp] = end

    def apply(self, records: list[RawRecord]) -> None:
        for rec in records:
            key = f"{rec.topic}:{rec.partition}"
            assert rec.after == self.wm.get(key, -1), "each record continues from the fence"
            self.wm[key] = rec.offset


class FakeLog:
    """What the log holds: ``(topic, partition)`` → its offsets."""

    def __init__(self, held: dict[tuple[str, int], range]) -> None:
        self.held = held
        self.fetched: list[tuple[str, int, int, int]] = []

    async def end_offsets(self, tps: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
        return {tp: self.held[tp].stop if tp in self.held else 0 for tp in tps}

    async def fetch_range(self, topic: str, partition: int, start: int, end: int) -> list[RawRecord]:
        self.fetched.append((topic, partition, start, end))
        return [RawRecord(topic, partition, o, b"k", b"v") for o in self.held.get((topic, partition), ()) if start <= o < end]

    async def close(self) -> None:
        pass


ALL = [f"{t}:{p}" for t in (KV, HB) for p in (0, 1)]


def watcher(view: FakeView, log: FakeLog, assigned: list[tuple[str, int]],
            process_error: Exception | None = None) -> tuple[GenerationWatcher, list[RawRecord]]:
    applied: list[RawRecord] = []
    lanes: dict[str, TopicLane] = {}

    def lane(topic: str) -> TopicLane:
        if topic not in lanes:
            guard = ResumeGuard(view.watermark, log.fetch_range, view=view)
            guard.all_partitions = ALL
            lanes[topic] = TopicLane(guard, log)
        return lanes[topic]

    async def process(records: list[RawRecord]) -> None:
        if process_error is not None:
            raise process_error
        view.apply(records)
        applied.extend(records)

    return GenerationWatcher(view, (KV, HB), assigned=lambda: assigned, lane=lane, process=process), applied


def test_the_fake_is_a_rebuilding_view() -> None:
    assert isinstance(FakeView(), RebuildingView)


async def test_a_steady_view_is_left_alone() -> None:
    view, log = FakeView(), FakeLog({(KV, 0): range(5)})
    view.wm = {f"{KV}:0": 4}
    w, applied = watcher(view, log, [(KV, 0)])
    for _ in range(3):
        await w.tick()
    assert applied == [] and log.fetched == [] and view.marked == []


async def test_a_lost_view_is_adopted_and_every_assigned_partition_read_back() -> None:
    view = FakeView()
    log = FakeLog({(KV, 0): range(4), (KV, 1): range(2), (HB, 0): range(3)})
    view.wm = {f"{KV}:0": 3, f"{KV}:1": 1, f"{HB}:0": 2}
    w, applied = watcher(view, log, [(KV, 0), (KV, 1), (HB, 0)])
    await w.tick()
    view.gen, view.wm = None, {}  # FLUSHALL
    await w.tick()
    assert view.generation == "g2"
    assert sorted((r.topic, r.partition, r.offset) for r in applied) == sorted(
        [(KV, 0, o) for o in range(4)] + [(KV, 1, o) for o in range(2)] + [(HB, 0, o) for o in range(3)]
    )
    # marked before the read (ends known) and after it (done): nothing assigned is left rebuilding
    assert view.marked[0] == {f"{KV}:0": 4, f"{KV}:1": 2} and view.marked[1] == view.marked[0]
    assert set(view.rebuild) == {f"{HB}:1"}  # not this worker's: another worker reads it back
    applied.clear()
    await w.tick()
    assert applied == []


async def test_fences_that_move_back_under_one_generation_are_read_back() -> None:
    view, log = FakeView(), FakeLog({(KV, 0): range(10)})
    view.wm = {f"{KV}:0": 9}
    w, applied = watcher(view, log, [(KV, 0)])
    await w.tick()
    view.wm = {f"{KV}:0": 6}  # a replica promoted while it lagged: the last three writes lost
    await w.tick()
    assert [r.offset for r in applied] == [7, 8, 9] and view.generation == "g1"
    assert log.fetched == [(KV, 0, 7, 10)]


async def test_a_partition_still_marked_rebuilding_is_read_back() -> None:
    view, log = FakeView(), FakeLog({(HB, 1): range(3)})
    view.rebuild = {f"{HB}:1": -1}
    w, applied = watcher(view, log, [(HB, 1)])
    await w.tick()
    assert [(r.topic, r.offset) for r in applied] == [(HB, 0), (HB, 1), (HB, 2)] and view.rebuild == {}


async def test_an_unreachable_view_skips_the_tick() -> None:
    view, log = FakeView(), FakeLog({})
    view.down = True
    w, applied = watcher(view, log, [(KV, 0)])
    await w.tick()  # does not raise
    assert applied == [] and log.fetched == []


@pytest.mark.parametrize("error", [ViewRefused("lost", "the view lost writes"), RuntimeError("boom")])
async def test_a_failed_read_back_is_logged_and_tried_again_next_tick(error: Exception) -> None:
    view, log = FakeView(), FakeLog({(KV, 0): range(3)})
    view.rebuild = {f"{KV}:0": -1}
    w, _ = watcher(view, log, [(KV, 0)], process_error=error)
    await w.tick()  # does not raise
    assert f"{KV}:0" in view.rebuild  # still to do


@pytest.mark.parametrize(
    ("seen", "now", "moved"),
    [
        ({"a:0": 5}, {"a:0": 5}, {}),
        ({"a:0": 5}, {"a:0": 7}, {}),
        ({"a:0": 5, "a:1": 2}, {"a:0": 3, "a:1": 2}, {"a:0": (5, 3)}),
        ({"a:0": 5}, {}, {"a:0": (5, -1)}),
        ({}, {"a:0": 1}, {}),
    ],
)
def test_fences_moved_back(seen: dict[str, int], now: dict[str, int], moved: dict[str, tuple[int, int]]) -> None:
    w, _ = watcher(FakeView(), FakeLog({}), [])
    assert w.fences_moved_back("g1", seen) == {}
    assert w.fences_moved_back("g1", now) == moved


def test_a_new_generation_forgets_the_fences_seen() -> None:
    w, _ = watcher(FakeView(), FakeLog({}), [])
    w.fences_moved_back("g1", {"a:0": 5})
    assert w.fences_moved_back("g2", {"a:0": 1}) == {}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def paced(view: FakeView, log: FakeLog, assigned: list[tuple[str, int]]) -> tuple[GenerationWatcher, Clock]:
    w, _ = watcher(view, log, assigned)
    clock = Clock()
    w.check_every_s, w._clock = 2.0, clock
    return w, clock


async def test_a_steady_view_is_read_only_every_check_interval() -> None:
    view, log = FakeView(), FakeLog({(KV, 0): range(5)})
    view.wm = {f"{KV}:0": 4}
    w, clock = paced(view, log, [(KV, 0)])
    for _ in range(4):  # 0.5 s ticks: the first reads, the next three do not
        await w.tick()
        clock.t += 0.5
    assert w.checks == 1
    await w.tick()  # 2 s after the first
    assert w.checks == 2


async def test_a_generation_an_agent_adopted_is_checked_at_the_next_tick() -> None:
    view, log = FakeView(), FakeLog({(KV, 0): range(3), (HB, 0): range(2)})
    view.wm = {f"{KV}:0": 2, f"{HB}:0": 1}
    w, clock = paced(view, log, [(KV, 0), (HB, 0)])
    await w.tick()
    view.gen, view.wm = None, {}  # Redis lost; the heartbeats' guard finds out first and adopts
    await view.adopt_generation(ALL)
    clock.t += 0.5
    await w.tick()  # not 2 s yet, but the adopted generation changed: read back at once
    assert w.checks == 2 and view.wm == {f"{KV}:0": 2, f"{HB}:0": 1}
    assert f"{KV}:0" not in view.rebuild and f"{HB}:0" not in view.rebuild  # (the others: not assigned here)


async def test_a_view_lost_with_no_traffic_is_read_back_within_the_check_interval() -> None:
    view, log = FakeView(), FakeLog({(KV, 0): range(3)})
    view.wm = {f"{KV}:0": 2}
    w, clock = paced(view, log, [(KV, 0)])
    await w.tick()
    view.gen, view.wm = None, {}
    clock.t += 0.5
    await w.tick()
    assert view.wm == {}  # nothing told this process yet
    clock.t += 1.5
    await w.tick()
    assert view.wm == {f"{KV}:0": 2}


async def test_a_view_that_cannot_be_read_is_tried_again_at_the_next_tick() -> None:
    view, log = FakeView(), FakeLog({})
    w, clock = paced(view, log, [(KV, 0)])
    view.down = True
    await w.tick()
    clock.t += 0.5
    await w.tick()
    assert w.checks == 2
