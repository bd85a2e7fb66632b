"""Write ``bad_records.jsonl``: the checked-in corpus of hostile and broken records (deterministic).

Run from the repository root: ``python tests/faults/corpus/make_corpus.py``. Each line is
``{"topic": "kv" | "hb", "why": ..., "hex": ...}``. Every record must be refused (dead-lettered) or
change nothing; none may change the view. Oversized (> 1 MB) records are made by the fault run
itself (``conductor.harness.chaos``), not stored here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgpack

from schemas import BlocksStored, Heartbeat, RoutingRequest, encode, envelope

OUT = Path(__file__).with_name("bad_records.jsonl")
TEN_YEARS_MS = 10 * 365 * 86_400_000


def main() -> None:
    rng = random.Random(15)
    out: list[tuple[str, str, bytes]] = []
    for i in range(100):
        out.append(("kv" if i % 2 else "hb", "random bytes", rng.randbytes(rng.randint(0, 300))))
    good_kv = encode(envelope(BlocksStored(block_keys=[1, 2, 3]), producer_id="node-0", producer_seq=0, ts_ms=1))
    good_hb = encode(envelope(Heartbeat(role="prefill"), producer_id="node-0", producer_seq=0, ts_ms=1))
    for i in range(50):
        src = good_kv if i % 2 else good_hb
        out.append(("kv" if i % 2 else "hb", "truncated envelope", src[: rng.randint(1, len(src) - 1)]))
    shapes = [1, -1, 2**64 - 1, "x", [], [1, 2], {}, {"kind": "blocks_stored"}, None, True, 1.5, b"\x00" * 10]
    for i in range(48):
        out.append(("kv" if i % 2 else "hb", "msgpack of the wrong shape", msgpack.packb(shapes[i % len(shapes)])))
    wire = msgpack.unpackb(good_kv)
    body_key = next(k for k, v in wire.items() if isinstance(v, dict) and "block_keys" in v)
    mutations = [
        ("negative producer_seq", lambda w: w.update(producer_seq=-5)),
        ("negative block key", lambda w: w[body_key].update(block_keys=[-1])),
        ("too many block keys", lambda w: w[body_key].update(block_keys=[1] * 16_385)),
        ("token ids deriving too many blocks", lambda w: w[body_key].update(block_keys=None, token_ids=[1] * 20_000, block_size=1)),
        ("unknown tier", lambda w: w[body_key].update(tier="tape")),
        ("node id too long", lambda w: w.update(producer_id="n" * 5000)),
        ("empty node id", lambda w: w.update(producer_id="")),
        ("block_size 0", lambda w: w[body_key].update(block_keys=None, token_ids=[1, 2], block_size=0)),
        ("unknown kind", lambda w: w[body_key].update(kind="blocks_exploded")),
        ("body missing", lambda w: w.pop(body_key)),
    ]
    for i in range(50):
        why, mutate = mutations[i % len(mutations)]
        w = msgpack.unpackb(good_kv)
        w["producer_id"] = f"node-{i % 6}"
        mutate(w)
        out.append(("kv", why, msgpack.packb(w)))
    for i in range(20):  # would mute node-i for good if taken as a gap
        out.append(("kv", "implausible sequence jump", encode(envelope(
            BlocksStored(block_keys=[rng.getrandbits(63)]), producer_id=f"node-{i % 6}", producer_seq=2**63 - 1 - i, ts_ms=1))))
    for i in range(20):  # would keep a ghost node live for ten years
        out.append(("hb", "heartbeat stamped ten years ahead", encode(envelope(
            Heartbeat(role="prefill"), producer_id=f"ghost-{i}", producer_seq=0, ts_ms=TEN_YEARS_MS + 1_800_000_000_000))))
    for i in range(20):
        out.append(("kv", "a routing request on kv-events", encode(envelope(
            RoutingRequest(request_id=f"r{i}", block_keys=[1], prompt_tokens=16), producer_id=f"node-{i % 6}",
            producer_seq=0, ts_ms=1))))
    with OUT.open("w") as f:
        for topic, why, raw in out:
            f.write(json.dumps({"topic": topic, "why": why, "hex": raw.hex()}) + "\n")
    print(f"{len(out)} records → {OUT}")


if __name__ == "__main__":
    main()
