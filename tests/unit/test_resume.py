"""The resume guard: each partition continues from the view's fence, in order, without a hole."""

from __future__ import annotations

from streams.ingest import RawRecord
from streams.resume import ResumeGuard

T = "kv"


def r(offset, partition=0):
    return RawRecord(T, partition, offset, b"k", b"v%d" % offset)


class FakeLog:
    """What the log holds per partition (a fake for a unit test of pure logic)."""

    def __init__(self, held):
        self.held = held
        self.calls = []

    async def fetch_range(self, topic, partition, start, end):
        self.calls.append((topic, partition, start, end))
        return [r(o, partition) for o in self.held.get(partition, ()) if start <= o < end]


def guard(wm, log=None):
    async def watermark():
        return dict(wm)

    log = log or FakeLog({})
    return ResumeGuard(watermark, log.fetch_range), log


async def admitted(g, batch):
    return [x async for part in g.admit(batch) for x in part]


def offsets(recs):
    return [(x.partition, x.offset) for x in recs]


async def test_records_that_continue_the_fence_pass_unchanged():
    g, log = guard({f"{T}:0": 9})
    batch = [r(10), r(11), r(12)]
    assert await admitted(g, batch) == batch
    assert log.calls == [] and g.refetched == g.lost == g.already_applied == 0


async def test_redelivered_and_out_of_order_records_come_out_once_in_order():
    g, _ = guard({f"{T}:0": 49})
    batch = [r(55), r(56), r(45), r(50), r(51), r(52), r(53), r(54), r(55), r(56), r(57)]
    assert offsets(await admitted(g, batch)) == [(0, o) for o in range(50, 58)]
    assert g.already_applied == 3  # 45 (applied) and the second 55 and 56


async def test_a_hole_after_the_fence_is_read_back_from_the_log():
    g, log = guard({f"{T}:0": 9}, FakeLog({0: range(30)}))
    assert offsets(await admitted(g, [r(15), r(16)])) == [(0, o) for o in range(10, 17)]
    assert log.calls == [(T, 0, 10, 15)]
    assert g.refetched == 5 and g.lost == 0


async def test_a_partition_never_applied_starts_at_offset_zero():
    g, log = guard({}, FakeLog({0: range(10)}))
    assert offsets(await admitted(g, [r(4)])) == [(0, o) for o in range(5)]
    assert log.calls == [(T, 0, 0, 4)]


async def test_offsets_the_log_no_longer_holds_are_let_through_and_counted():
    g, _ = guard({f"{T}:0": 9}, FakeLog({0: range(12, 30)}))  # retention removed 0..11
    assert offsets(await admitted(g, [r(15)])) == [(0, o) for o in range(12, 16)]
    assert g.lost == 2 and g.refetched == 3


async def test_partitions_are_independent():
    g, log = guard({f"{T}:0": 4, f"{T}:1": 2}, FakeLog({1: range(10)}))
    got = await admitted(g, [r(5, 0), r(6, 1), r(6, 0)])
    assert sorted(offsets(got)) == [(0, 5), (0, 6), (1, 3), (1, 4), (1, 5), (1, 6)]
    assert log.calls == [(T, 1, 3, 6)]


async def test_a_large_hole_comes_back_in_parts_in_order():
    async def watermark():
        return {}

    log = FakeLog({0: range(100)})
    g = ResumeGuard(watermark, log.fetch_range, fill_max=30)
    parts = [[x.offset for x in p] async for p in g.admit([r(95), r(96)])]
    assert parts == [list(range(30)), list(range(30, 60)), list(range(60, 90)), list(range(90, 95)), [95, 96]]


async def test_each_record_names_the_offset_it_continues_from_across_holes_the_log_cannot_fill():
    # the view stops at 4; the log lost 7 (retention or a transaction marker): 8 continues from 6
    g, _ = guard({f"{T}:0": 4}, FakeLog({0: [5, 6, 8]}))
    got = await admitted(g, [r(9), r(10)])
    assert [(x.offset, x.after) for x in got] == [(5, 4), (6, 5), (8, 6), (9, 8), (10, 9)]


async def test_a_partition_without_a_fence_is_read_from_the_log_start():
    g, _ = guard({}, FakeLog({0: range(3, 6)}))  # the log starts at 3 (retention)
    got = await admitted(g, [r(6)])
    assert [(x.offset, x.after) for x in got] == [(3, -1), (4, 3), (5, 4), (6, 5)]


class FakeView:
    """A view with a generation (the part of RedisViewStore the guard uses)."""

    def __init__(self):
        self.gen, self.wm, self.generation, self.marked = "g1", {f"{T}:0": 9}, None, []

    async def fences(self):
        return self.gen, dict(self.wm)

    async def adopt_generation(self, partitions=()):
        created = self.gen is None
        if created:
            self.gen = "g2"
            self.marked = list(partitions)
        self.generation = self.gen
        return self.gen, created


async def test_a_lost_view_is_noticed_adopted_and_read_back_from_the_start():
    view = FakeView()
    log = FakeLog({0: range(12)})
    g = ResumeGuard(None, log.fetch_range, view=view)
    g.all_partitions = [f"{T}:0", f"{T}:1"]
    assert offsets(await admitted(g, [r(10)])) == [(0, 10)]
    assert view.generation == "g1" and g.generations == 0
    view.gen, view.wm = None, {}  # FLUSHALL
    got = await admitted(g, [r(11)])
    assert [(x.offset, x.after) for x in got] == [(o, o - 1) for o in range(12)]
    assert view.generation == "g2" and g.generations == 1 and view.marked == [f"{T}:0", f"{T}:1"]


async def test_catch_up_reads_a_partition_without_new_records_to_its_end():
    g, _ = guard({f"{T}:0": 2}, FakeLog({0: range(6), 1: range(3)}))
    parts = [p async for p in g.catch_up([(T, 0), (T, 1)], {(T, 0): 6, (T, 1): 3})]
    assert [offsets(p) for p in parts] == [[(0, 3), (0, 4), (0, 5)], [(1, 0), (1, 1), (1, 2)]]
