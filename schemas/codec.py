"""The one place that knows msgpack.

``encode(envelope) -> bytes`` and ``decode(bytes) -> Envelope``. Older schema
versions are upcast to the current one on decode; anything that is not a valid
record of a known schema raises :class:`DecodeError` (and nothing else).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
from pydantic import ValidationError

from .errors import ConductorError
from .records import BODY_TYPES, SCHEMA_VERSIONS, Envelope

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
    # Request v5 (session) and decision v6 (session_instance) added optional fields: absent = a
    # request of no session, decided without one.
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
    try:
        return Envelope.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise DecodeError("invalid", f"{kind}: {where}: {first.get('msg')}"[:500]) from None
    except Exception as e:  # noqa: BLE001 - e.g. RecursionError on absurd nesting; decode raises DecodeError only
        raise DecodeError("invalid", f"{kind}: {type(e).__name__}") from None
