"""The ingest core without Kafka: decode → dead-letter / fold → write the view (effects and stream
state in one step), and metrics."""

from __future__ import annotations

import msgpack

from conductor.errors import ViewStoreError
from conductor.settings import load_settings
from conductor.telemetry import scrape, setup_metrics
from schemas import BlocksStored, Heartbeat, RoutingRequest, encode, envelope
from schemas.records import MAX_ORIGINAL_BYTES
from state.memory import InMemoryViewStore
from state.view import SourcePosition
from streams.agents import process_until_done
from streams.ingest import IngestMetrics, Ingestor, RawRecord
from streams.topics import topics

T = topics(load_settings(topic_prefix="u.", kafka_url=None, redis_url=None).topic_config())
KV, HB = T.kv_events.name, T.heartbeats.name


def rec(offset, value, topic=KV, partition=0):
    return RawRecord(topic, partition, offset, b"k", value if isinstance(value, (bytes, type(None))) else encode(value))


def stored(node, seq, keys, ts=1_000):
    return envelope(BlocksStored(block_keys=keys), producer_id=node, producer_seq=seq, ts_ms=ts)


def stream(store, node, part="kv"):
    """The node's stream part as the view holds it (None: the view has no stream for it)."""
    st = store.streams_sync([node]).get(node)
    return None if st is None else list(st.part(part))


async def test_bad_records_are_dead_lettered_and_the_batch_goes_on():
    setup_metrics("test-ingest")
    letters = []

    async def dl(d):
        letters.append(d)

    store = InMemoryViewStore()
    ing = Ingestor(T, store, dead_letter=dl, metrics=IngestMetrics(), clock_ms=lambda: 1_050)
    req = envelope(RoutingRequest(request_id="r", block_keys=[1], prompt_tokens=16), producer_id="x", producer_seq=0, ts_ms=1)
    batch = [
        rec(0, stored("a", 0, [1, 2])),
        rec(1, b"\xc1garbage"),
        rec(2, req),  # valid record, wrong topic
        rec(3, None),
        rec(4, stored("a", 1, [3])),
        rec(5, stored("a", 1, [3])),  # duplicate sequence
        RawRecord("elsewhere", 0, 9, None, b"x"),
    ]
    res = await ing.process(batch)
    assert res.applied == 2 and res.skipped == {"duplicate": 1} and res.block_events == 3
    assert res.dead == {"malformed": 2, "wrong_kind": 1, "unknown_topic": 1}
    assert res.staleness_ms == [50.0, 50.0]
    assert [(d.reason, d.offset) for d in letters] == [("malformed", 1), ("wrong_kind", 2), ("malformed", 3), ("unknown_topic", 9)]
    assert letters[0].original == b"\xc1garbage" and letters[0].source_topic == KV
    assert (await store.snapshot([1, 2, 3], now_ms=0)).prefix == {"a": (3, 3, 3)}
    assert stream(store, "a") == [0, 1, 0, 0]
    text = scrape()
    assert metric(text, "conductor_dead_letters_total", f'reason="wrong_kind",topic="{KV}"') >= 1
    assert metric(text, "conductor_dead_letters_total", f'reason="malformed",topic="{KV}"') >= 2
    assert metric(text, "conductor_events_applied_total", f'topic="{KV}"') >= 2
    assert "conductor_view_staleness_ms" in text


def metric(text, name, labels):
    """The value of the sample of ``name`` whose labels end with ``labels`` (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and line.split("}")[0].endswith(labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_fresh_ingestor_starts_from_the_views_stream_state():
    store = InMemoryViewStore()
    store.apply_sync(stored("a", 0, [1]), SourcePosition(KV, 0, 0))
    store.apply_sync(stored("a", 1, [2]), SourcePosition(KV, 0, 1))
    ing = Ingestor(T, store)  # a new worker: e.g. the partition just moved to it
    # the engine re-published seq 1 (new offset, so the offset fence does not catch it)
    res = await ing.process([rec(7, stored("a", 1, [9])), rec(8, stored("a", 2, [3]))])
    assert res.skipped == {"duplicate": 1} and res.applied == 1
    assert (await store.snapshot([9], now_ms=0)).prefix == {}
    assert stream(store, "a")[:2] == [0, 2]


async def test_heartbeats_move_only_their_stream_part():
    store = InMemoryViewStore()
    ing = Ingestor(T, store, clock_ms=lambda: 5_000)
    hb = envelope(Heartbeat(role="decode"), producer_id="d", producer_seq=3, ts_ms=4_000)
    await ing.process([rec(0, hb, topic=HB)])
    assert stream(store, "d", "hb") == [0, 3] and stream(store, "d") == [-1, -1, 0, 0]
    assert ing.live_nodes(2.0) == 1 and ing.live_nodes(0.5) == 0


class FlakyStore(InMemoryViewStore):
    """Fails the first ``n`` writes like an unreachable Redis (a fake for a unit test)."""

    def __init__(self, n):
        super().__init__()
        self.failures = n

    async def apply_groups(self, batch):
        if self.failures:
            self.failures -= 1
            raise ViewStoreError("connection refused")
        return await super().apply_groups(batch)


async def test_state_moves_only_after_the_view_write_and_writes_are_retried():
    store = FlakyStore(2)
    ing = Ingestor(T, store)
    try:
        await ing.process([rec(0, stored("a", 0, [1]))])
    except ViewStoreError:
        pass
    assert stream(store, "a") is None  # the view did not take it: the stream state did not move
    await process_until_done(ing, [rec(0, stored("a", 0, [1]))])  # one more failure, then success
    assert stream(store, "a")[:2] == [0, 0]
    assert (await store.snapshot([1], now_ms=0)).prefix == {"a": (1, 1, 1)}


async def test_redelivered_records_are_caught_by_the_offset_fence():
    """After a crash, records the view applied come again; the view's fence refuses them, and
    they are counted as fenced, not applied."""
    store = InMemoryViewStore()
    envs = [stored("a", i, [10 + i]) for i in range(3)]
    for i, e in enumerate(envs):
        store.apply_sync(e, SourcePosition(KV, 0, i))
    store.apply_sync(stored("a", 3, [99]), SourcePosition(KV, 0, 3))  # applied, then a crash
    ing = Ingestor(T, store)
    res = await ing.process([rec(3, stored("a", 3, [99])), rec(4, stored("a", 4, [5]))])
    assert res.skipped == {"fenced": 1} and res.applied == 1
    assert stream(store, "a")[:2] == [0, 4]
    assert (await store.snapshot([10, 11, 12], now_ms=0)).prefix == {"a": (3, 3, 3)}


async def test_resuming_past_applied_records_counts_no_phantom_gap():
    """A worker killed after its view write and offset commit comes back, and Kafka resumes
    past the records in between: they are in the view, so the next record is no gap."""
    store = InMemoryViewStore()
    for i in range(5):
        store.apply_sync(stored("a", i, [20 + i]), SourcePosition(KV, 0, i))
    ing = Ingestor(T, store)
    res = await ing.process([rec(5, stored("a", 5, [25]))])
    assert res.applied == 1 and res.gaps == 0
    assert stream(store, "a") == [0, 5, 0, 0]
    # a real gap is still a gap
    res = await ing.process([rec(6, stored("a", 8, [28]))])
    assert res.gaps == 1 and stream(store, "a") == [0, 8, 1, 2]


async def test_a_resent_record_is_not_taken_for_new():
    """An engine (or a retrying producer) re-sends seq 1 at a new offset after seq 2 removed
    its block; folded from the view's stream state it is a duplicate."""
    from schemas import BlocksRemoved

    store = InMemoryViewStore()
    store.apply_sync(stored("a", 0, [1]), SourcePosition(KV, 0, 0))
    store.apply_sync(stored("a", 1, [2]), SourcePosition(KV, 0, 1))
    removed = envelope(BlocksRemoved(block_keys=[2]), producer_id="a", producer_seq=2, ts_ms=1_000)
    store.apply_sync(removed, SourcePosition(KV, 0, 2))
    ing = Ingestor(T, store)
    res = await ing.process([rec(3, stored("a", 1, [2]))])
    assert res.skipped == {"duplicate": 1} and res.applied == 0
    assert store.holders(2) == {}


class RacedStore(InMemoryViewStore):
    """Lets another writer in once, between the ingestor's read and its write (a fake of a
    zombie consumer, or of a timed-out write that still ran)."""

    def __init__(self, other_batch):
        super().__init__()
        self.other = other_batch

    async def apply_groups(self, batch):
        if self.other:
            other, self.other = self.other, None
            await Ingestor(T, self).process(other)
        return await super().apply_groups(batch)


async def test_a_writer_that_got_in_between_read_and_write_leaves_no_phantom_gap():
    envs = [stored("a", i, [40 + i]) for i in range(4)]
    store = RacedStore([rec(1, envs[1])])  # the other writer applies seq 1 meanwhile
    store.apply_sync(envs[0], SourcePosition(KV, 0, 0))
    ing = Ingestor(T, store)
    res = await ing.process([rec(2, envs[2]), rec(3, envs[3])])  # read at seq 0, written after seq 1
    assert res.refolds == 1 and res.applied == 2 and res.gaps == 0
    ref = InMemoryViewStore()
    for i, e in enumerate(envs):
        ref.apply_sync(e, SourcePosition(KV, 0, i))
    assert store.dump_sync() == ref.dump_sync()
    assert stream(store, "a") == [0, 3, 0, 0]


async def test_a_dead_lettered_record_moves_its_partitions_fence():
    """Dealt with is dealt with: a consumer resuming from the fence must not bring it back."""
    store = InMemoryViewStore()
    ing = Ingestor(T, store)
    res = await ing.process([rec(0, stored("a", 0, [1])), rec(1, b"\xc1garbage"), rec(2, None)])
    assert res.applied == 1 and res.dead == {"malformed": 2}
    assert await store.watermark() == {f"{KV}:0": 2}


async def test_an_oversized_record_never_poisons_its_batch():
    """A record of more than 1 MB among good ones: the good ones apply, the big one is
    dead-lettered with a bounded slice of itself (position to fetch the rest); when even that
    cannot be sent, it is counted and logged and the batch still goes on."""
    sent, refuse = [], [False]

    async def dl(d):
        if refuse[0]:
            raise RuntimeError("MessageSizeTooLargeError")
        sent.append(d)

    store = InMemoryViewStore()
    ing = Ingestor(T, store, dead_letter=dl)
    big = b"\x92" + b"\xff" * (1_200_000)  # not a valid envelope, 1.2 MB
    res = await ing.process([rec(0, stored("a", 0, [1])), rec(1, big), rec(2, stored("a", 1, [2]))])
    assert res.applied == 2 and res.dead == {"malformed": 1}
    assert len(sent[0].original) == MAX_ORIGINAL_BYTES and sent[0].offset == 1
    refuse[0] = True
    res = await ing.process([rec(3, big), rec(4, stored("a", 2, [3]))])
    assert res.applied == 1 and res.dead == {"malformed": 1, "dead_letter_unsent": 1}
    assert (await store.snapshot([1, 2, 3], now_ms=0)).prefix == {"a": (3, 3, 3)}
    assert await store.watermark() == {f"{KV}:0": 4}


async def test_a_record_deriving_too_many_blocks_is_dead_lettered():
    """1M token ids at block size 1 would add 1M blocks from one record: refused at decode."""
    letters = []

    async def dl(d):
        letters.append(d)

    store = InMemoryViewStore()
    ing = Ingestor(T, store, dead_letter=dl)
    raw = encode(stored("a", 0, [1]))  # a valid record beside it
    # the bytes a hostile producer sends (our own encoder refuses to build them)
    wire = msgpack.unpackb(encode(envelope(BlocksStored(token_ids=[1], block_size=1), producer_id="b", producer_seq=0, ts_ms=1)))
    body = next(v for v in wire.values() if isinstance(v, dict) and "token_ids" in v)
    body["token_ids"] = list(range(20_000))
    bad = msgpack.packb(wire)
    res = await ing.process([rec(0, raw), rec(1, bad)])
    assert res.applied == 1 and sum(res.dead.values()) == 1
    assert "at most" in letters[0].error
    assert (await store.snapshot([1], now_ms=0)).prefix == {"a": (1, 1, 1)}


async def test_a_future_stamped_heartbeat_never_keeps_a_node_live():
    """Freshness by what the log observed: a heartbeat stamped ten years past its Kafka record is
    a fault (dead-lettered); one a little ahead counts from the record's timestamp; the skew is kept."""
    letters = []

    async def dl(d):
        letters.append(d)

    store = InMemoryViewStore()
    ing = Ingestor(T, store, dead_letter=dl)
    ten_years = 10 * 365 * 86_400_000
    hb = lambda seq, ts: encode(envelope(Heartbeat(role="prefill"), producer_id="p", producer_seq=seq, ts_ms=ts))
    res = await ing.process([RawRecord(HB, 0, 0, b"p", hb(0, 5_000 + ten_years), 5_000)])
    assert res.dead == {"future_timestamp": 1} and letters[0].offset == 0
    assert (await store.snapshot([], now_ms=5_000)).nodes == ()
    res = await ing.process([RawRecord(HB, 0, 1, b"p", hb(1, 9_000), 6_000)])  # 3 s ahead
    assert res.applied == 1 and ing.clock_skew_ms["p"] == 3_000
    snap = await store.snapshot([], now_ms=6_000)
    assert [n.last_heartbeat_ms for n in snap.nodes] == [6_000]


async def test_an_epoch_from_the_future_is_a_fault_not_a_muted_node():
    """Epochs are restart times: a record whose epoch is far past its Kafka timestamp is
    dead-lettered (``future_epoch``) instead of making every later record of the node stale."""
    letters = []

    async def dl(d):
        letters.append(d)

    store = InMemoryViewStore()
    ing = Ingestor(T, store, dead_letter=dl)
    now = 1_700_000_000_000

    def kv(seq, epoch, keys):
        return encode(envelope(BlocksStored(block_keys=keys), producer_id="a", producer_seq=seq, epoch=epoch, ts_ms=now))

    res = await ing.process([RawRecord(KV, 0, 0, b"a", kv(0, now - 5, [1]), now),
                             RawRecord(KV, 0, 1, b"a", kv(0, 2**63 - 1, [2]), now),
                             RawRecord(KV, 0, 2, b"a", kv(1, now - 5, [3]), now + 1)])
    assert res.applied == 2 and res.dead == {"future_epoch": 1} and letters[0].offset == 1
    assert "epoch" in letters[0].error
    assert (await store.snapshot([1, 3], now_ms=now)).prefix == {"a": (2, 2, 2)}
    # A restart's new epoch (its clock, a little ahead of the broker's) is still taken.
    res = await ing.process([RawRecord(KV, 0, 3, b"a", kv(0, now + 10_000, [7]), now + 2)])
    assert res.applied == 1 and (await store.snapshot([1], now_ms=now)).prefix == {}


async def test_an_implausible_sequence_jump_is_a_fault_not_a_muted_node():
    letters = []

    async def dl(d):
        letters.append(d)

    store = InMemoryViewStore()
    ing = Ingestor(T, store, dead_letter=dl)
    res = await ing.process([rec(0, stored("a", 0, [1])), rec(1, stored("a", 2**63, [2])), rec(2, stored("a", 1, [3]))])
    assert res.applied == 2 and res.dead == {"implausible_sequence": 1} and letters[0].offset == 1
    assert (await store.snapshot([1, 3], now_ms=0)).prefix == {"a": (2, 2, 2)}
    assert (await store.snapshot([2], now_ms=0)).prefix == {}
    assert stream(store, "a") == [0, 1, 0, 0]
