"""The one place that knows msgpack.

``encode(envelope) -> bytes`` and ``decode(bytes) -> Envelope``. Older schema
versions are upcast to the current one on decode; anything that is not a valid
record of a known schema raises :class:`DecodeError` (and nothing else).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from .errors import ConductorError
from .records import BODY_TYPES, MAX_BLOCKS, MAX_NAME, SCHEMA_VERSIONS, TIERS, BlocksRemoved, BlocksStored, Envelope

CONTENT_TYPE = "application/x-conductor+msgpack"
MAX_RECORD_BYTES = 16 * 1024 * 1024

# Short envelope field names on the wire; bodies keep their field names.
_WIRE = {
    "schema_name": "s",
    "schema_version": "v",
    "event_id": "id",
    "producer_id": "p",
    "producer_seq": "q",
    "epoch": "e",
    "ts_ms": "t",
    "body": "b",
}


class DecodeError(ConductorError, ValueError):
    """Bytes that are not a valid Conductor record. ``reason`` is a short code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
_UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(kind: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register a function that turns a ``kind`` body of ``from_version`` into ``from_version + 1``."""

    def register(fn: Upcaster) -> Upcaster:
        _UPCASTERS[(kind, from_version)] = fn
        return fn

    return register


@upcaster("routing_decision", 1)
@upcaster("routing_rejection", 1)
def _decision_v1_to_v2(body: dict[str, Any]) -> dict[str, Any]:
    # v2 added the re-derivation fields (control offset, block size, profile: unknown, so explain
    # falls back to settings) and, on decisions, the optional CPP group: absent = one instance.
    return dict(body)


@upcaster("heartbeat", 1)
def _heartbeat_v1_to_v2(body: dict[str, Any]) -> dict[str, Any]:
    # v1 named the prefill backlog ``queued_tokens`` and had no decode context or zone.
    body = dict(body)
    if "queued_tokens" in body:
        body["queued_prefill_tokens"] = body.pop("queued_tokens")
    body.setdefault("decode_context_tokens", 0)
    return body


@upcaster("heartbeat", 2)
@upcaster("routing_request", 2)
@upcaster("routing_decision", 2)
def _discovery_v3(body: dict[str, Any]) -> dict[str, Any]:
    # v3 added optional fields with defaults (heartbeat: endpoint, dp_rank, bootstrap_port,
    # kv_transfer; request: reachable; decision: mode (disaggregated, as every v2 decision
    # was), options, endpoints): nothing to fill in.
    return body


@upcaster("routing_request", 3)
@upcaster("routing_decision", 3)
def _colocated_v4(body: dict[str, Any]) -> dict[str, Any]:
    # v4 added ``decided_by`` (request and decision) and the decision's ``ordinal``, both optional:
    # absent = decided by a router of ``requests`` at the request's offset, as every v3 record was.
    return body


@upcaster("routing_decision", 4)
@upcaster("request_outcome", 2)
def _decision_time_v5(body: dict[str, Any]) -> dict[str, Any]:
    # Decision v5 (pending_ttl_ms, inflight_lease_ms, queued_tokens_ahead, left_holder) and outcome
    # v3 (first_token_view_ms, finished_view_ms) added optional fields: absent = a decision made on
    # heartbeats and reservations alone, an outcome whose releases are not on the view's clock.
    return body


@upcaster("routing_request", 4)
@upcaster("routing_decision", 5)
def _sessions(body: dict[str, Any]) -> dict[str, Any]:
    # Request v5 (session) and decision v6 (session_instance, written by some v5 producers too;
    # event, event_producer, seen_pending, seen_inflight, seen_reservations, reservation_event,
    # reservation_producer) added optional fields: absent = a request of no session, decided
    # without one, by a router whose cut of the shared streams is unknown.
    return body


@upcaster("request_outcome", 3)
def _outcome_v4(body: dict[str, Any]) -> dict[str, Any]:
    # v4 added release_producer, first_token_event, finished_event: absent = releases ``explain``
    # applies by their time alone.
    return body


@upcaster("heartbeat", 3)
def _heartbeat_v4(body: dict[str, Any]) -> dict[str, Any]:
    # v4 added ``kv_events`` (False: a node that publishes no KV events): absent = it does, as every
    # v3 producer did.
    return body


@upcaster("blocks_removed", 1)
def _blocks_removed_v1(body: dict[str, Any]) -> dict[str, Any]:
    # v2 added ``node``: absent = the producer's own blocks, as every v1 record meant.
    return dict(body)


@upcaster("dead_letter", 1)
def _dead_letter_v1(body: dict[str, Any]) -> dict[str, Any]:
    # v2 added the value's whole size and digest and the key: unknown for a v1 letter (None),
    # whose original may have been cut with nothing to say so.
    return body


@upcaster("request_outcome", 1)
@upcaster("control", 1)
def _fitted_costs_v2(body: dict[str, Any]) -> dict[str, Any]:
    # v2 added optional fields (outcome: the TTFT split and what predicted it; control: set_profile's
    # profile and model): absent = not measured, no profile, as every v1 record was.
    return body


@upcaster("routing_request", 1)
def _routing_request_v1(body: dict[str, Any]) -> dict[str, Any]:
    # v2 added cache_salt, exclude and retry_of, all with defaults: nothing to fill in.
    return body


@upcaster("kv_command", 1)
def _kv_command_v1_to_v2(body: dict[str, Any]) -> dict[str, Any]:
    # v1 had no command id: derive one from the body, so every re-delivery of the same v1
    # record gets the same id (and is executed once). No deadline: it never expires.
    body = dict(body)
    digest = hashlib.blake2b(msgpack.packb(body, use_bin_type=True), digest_size=12).hexdigest()
    body.setdefault("command_id", f"v1-{digest}")
    return body


@upcaster("kv_command", 2)
def _kv_command_v2(body: dict[str, Any]) -> dict[str, Any]:
    # v3 added ``by_node``: absent = the default executor (the target of a replicate, else the holder).
    return body


def encode(record: Envelope) -> bytes:
    """Serialise an envelope (at its current schema version)."""
    if not isinstance(record, Envelope):
        raise TypeError(f"encode() takes an Envelope, not {type(record).__name__}")
    data = record.model_dump(mode="python", exclude_none=True)
    wire = {_WIRE[k]: v for k, v in data.items()}
    out: bytes = msgpack.packb(wire, use_bin_type=True)
    return out


def pack_script_args(value: Any) -> bytes:
    """msgpack of plain values for a Redis Lua script (``cmsgpack.unpack``): str, not bin,
    because Lua's cmsgpack has no separate bytes type."""
    out: bytes = msgpack.packb(value, use_bin_type=False)
    return out


def unpack_foreign(data: bytes, *, strict_map_key: bool = False) -> Any:
    """Plain msgpack of another system's wire format (the engines' KV-event batches).

    Raises whatever msgpack raises; the caller owns that format's errors.
    """
    return msgpack.unpackb(data, raw=False, strict_map_key=strict_map_key, use_list=True)


def pack_foreign(value: Any) -> bytes:
    """Plain msgpack in another system's wire format (for emulated engines)."""
    out: bytes = msgpack.packb(value, use_bin_type=True)
    return out


DECIDED_BY_HEADER = "decided-by"
"""The header naming the process that decided a request (or made a decision) where it arrived:
the routers of ``requests`` pass such a request over without decoding it."""


def headers(record: Envelope) -> list[tuple[str, bytes]]:
    """Kafka headers that let a consumer route, reject or skip a record without decoding it."""
    out = [
        ("content-type", CONTENT_TYPE.encode()),
        ("schema", record.schema_name.encode()),
        ("schema-version", str(record.schema_version).encode()),
    ]
    decided_by: str | None = getattr(record.body, "decided_by", None)
    if decided_by:
        out.append((DECIDED_BY_HEADER, decided_by.encode()))
    return out


def decided_by(record_headers: Sequence[tuple[str, bytes]]) -> str | None:
    """The ``decided-by`` header of a record's headers (None: none, as on records written before
    it existed, whose body still says it)."""
    for name, value in record_headers:
        if name == DECIDED_BY_HEADER:
            return value.decode(errors="replace")
    return None


def decode(data: bytes | bytearray | memoryview) -> Envelope:
    """Parse, upcast and validate one record; raise :class:`DecodeError` on anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError("malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise DecodeError("too_large", f"{len(data)} bytes exceeds the {MAX_RECORD_BYTES}-byte cap")
    try:
        raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types for bad input; decode raises DecodeError only
        raise DecodeError("malformed", f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(raw, dict):
        raise DecodeError("malformed", f"expected a map, got {type(raw).__name__}")
    fields = {long: raw[short] for long, short in _WIRE.items() if short in raw}
    unknown = set(raw) - set(_WIRE.values())
    if unknown:
        raise DecodeError("malformed", f"unknown envelope fields {sorted(map(str, unknown))[:5]}")
    kind = fields.get("schema_name")
    version = fields.get("schema_version")
    body = fields.get("body")
    if not isinstance(kind, str) or kind not in BODY_TYPES:
        raise DecodeError("unknown_schema", f"unknown schema {kind!r}"[:200])
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise DecodeError("unsupported_version", f"bad schema version {version!r}"[:200])
    current = SCHEMA_VERSIONS[kind]
    if version > current:
        raise DecodeError("unsupported_version", f"{kind} v{version} is newer than v{current}")
    if not isinstance(body, dict):
        raise DecodeError("malformed", "body is not a map")
    try:
        while version < current:
            body = _UPCASTERS[(kind, version)](body)
            version += 1
    except KeyError:
        raise DecodeError("unsupported_version", f"no upcaster for {kind} v{version}") from None
    except Exception as e:  # noqa: BLE001 - an upcaster failing on a bad old body is that record's DecodeError
        raise DecodeError("unsupported_version", f"upcasting {kind} v{version} failed: {e}") from None
    body = dict(body)
    body.setdefault("kind", kind)
    fields["body"] = body
    fields["schema_version"] = version
    fast = _plain_block_event(fields)
    if fast is not None:
        return fast
    try:
        return Envelope.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise DecodeError("invalid", f"{kind}: {where}: {first.get('msg')}"[:500]) from None
    except Exception as e:  # noqa: BLE001 - e.g. RecursionError on absurd nesting; decode raises DecodeError only
        raise DecodeError("invalid", f"{kind}: {type(e).__name__}") from None


# --- the block events' fast path -----------------------------------------------------------
#
# Nearly every record of kv-events is a plain ``blocks_stored`` or ``blocks_removed``: a list of
# block keys, maybe a tier (and a stored event's default block size and no extra keys). Validating its ~100 keys one by one through pydantic was most of
# the stream worker's decode. Such a record is checked here with a few C-level passes and built
# without validation; everything else, and anything this check is not sure of, goes through
# ``Envelope.model_validate``. The fast path only ever accepts, and only what validation
# accepts, as the same model (tests/unit/test_codec_fast_path.py): every refusal, with its
# reason, still comes from validation.

_U64_MAX = 2**64 - 1
_M = TypeVar("_M", bound=BaseModel)
_PLAIN_BODY_FIELDS = {
    "blocks_stored": frozenset({"kind", "block_keys", "tier", "block_size", "extra_keys"}),
    "blocks_removed": frozenset({"kind", "block_keys", "tier", "node"}),
}
_PLAIN_MODELS: dict[str, type[BlocksStored | BlocksRemoved]] = {
    "blocks_stored": BlocksStored, "blocks_removed": BlocksRemoved,
}
_ENVELOPE_INTS = ("schema_version", "producer_seq", "ts_ms")


def _plain_block_event(fields: dict[str, Any]) -> Envelope | None:
    """``fields`` (an envelope's, its body upcast and kind set) as the :class:`Envelope` that
    validation would build, when it is a plain block event at the current version whose every
    value has the exact type and range validation wants; ``None`` when unsure."""
    body = fields["body"]
    kind = body["kind"]
    allowed = _PLAIN_BODY_FIELDS.get(kind)
    if allowed is None or fields["schema_name"] != kind or not allowed.issuperset(body):
        return None
    keys = body.get("block_keys")
    if type(keys) is not list or len(keys) > MAX_BLOCKS:
        return None
    if keys and (set(map(type, keys)) != {int} or min(keys) < 0 or max(keys) > _U64_MAX):
        return None
    tier = body.get("tier", "hbm")
    if type(tier) is not str or tier not in TIERS:
        return None
    node = body.get("node")
    if node is not None and (type(node) is not str or len(node) > MAX_NAME):
        return None
    block_size = body.get("block_size", 16)  # (what encode writes of every blocks_stored: its defaults)
    if type(block_size) is not int or not 1 <= block_size <= 4096 or body.get("extra_keys", []) != []:
        return None
    for name in _ENVELOPE_INTS:
        v = fields.get(name)
        if type(v) is not int or v < 0:
            return None
    epoch = fields.get("epoch", 0)  # the one envelope number with a default
    if type(epoch) is not int or epoch < 0:
        return None
    if fields["schema_version"] > 1000:
        return None
    event_id, producer = fields.get("event_id"), fields.get("producer_id")
    if type(event_id) is not str or not 0 < len(event_id) <= 64:
        return None
    if type(producer) is not str or not 0 < len(producer) <= MAX_NAME:
        return None
    return _build_envelope({**fields, "body": _BUILDERS[kind](body)})


def _builder(cls: type[_M]) -> Callable[[dict[str, Any]], _M]:
    """``cls.model_construct(**values)`` for a model of plain fields (no alias, no post-init),
    with its immutable defaults looked up once instead of per record."""
    fields = cls.__pydantic_fields__
    assert not cls.__pydantic_post_init__
    assert all(f.alias is None and f.validation_alias is None for f in fields.values())
    order = tuple(fields)
    fixed = {n: f.default for n, f in fields.items()
             if not f.is_required() and f.default_factory is None and type(f.default) in (type(None), bool, int, str)}
    made = {n: f for n, f in fields.items() if not f.is_required() and n not in fixed}
    setattr_ = object.__setattr__

    def build(values: dict[str, Any]) -> _M:
        d: dict[str, Any] = {}
        for n in order:
            if n in values:
                d[n] = values[n]
            elif n in fixed:
                d[n] = fixed[n]
            else:
                d[n] = made[n].get_default(call_default_factory=True, validated_data=d)
        m = object.__new__(cls)
        setattr_(m, "__dict__", d)
        setattr_(m, "__pydantic_fields_set__", set(values))
        setattr_(m, "__pydantic_extra__", None)
        setattr_(m, "__pydantic_private__", None)
        return m

    return build


_BUILDERS = {kind: _builder(cls) for kind, cls in _PLAIN_MODELS.items()}
_build_envelope = _builder(Envelope)
