"""Every record that travels on a Conductor topic.

Each body is a frozen pydantic model with a literal ``kind``; an :class:`Envelope`
carries one body plus the producer's identity, sequence number and epoch. Lists
and strings are capped so that a hostile or broken producer cannot make a
consumer allocate without bound.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

# --- caps -------------------------------------------------------------------
MAX_NAME = 256
MAX_TEXT = 4096
MAX_BLOCKS = 16_384  # block keys in one event or one request chain
MAX_TOKENS = 1_048_576  # token ids in one event or request (2,048 x 512-token blocks)
MAX_EXTRA_KEYS = 64
MAX_PARAMS = 64
MAX_ORIGINAL_BYTES = 1_048_576

U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME)]
OptName = Annotated[str, StringConstraints(max_length=MAX_NAME)] | None
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
Scalar = Union[bool, int, float, Annotated[str, StringConstraints(max_length=MAX_NAME)], None]

Tier = Literal["hbm", "dram", "ssd"]
"""Where a block lives: GPU memory, host memory, or local disk/remote pool SSD."""
TIERS: tuple[Tier, ...] = ("hbm", "dram", "ssd")

Role = Literal["prefill", "decode", "both", "store"]
"""``store`` is a shared KV pool node (the Mooncake Store): it holds blocks but runs no model."""

PolicyRejectReason = Literal["ttft_slo", "tbt_slo", "no_live_instance", "overloaded"]
"""Why a policy turns a request away (its prediction, or nothing to run it on)."""
RejectReason = Literal[PolicyRejectReason, "invalid_request", "view_unavailable"]
"""Every reason a ``routing_rejection`` can carry: a policy's, or the router's own (a request
it cannot read or place as given, a view it cannot reach)."""


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


# --- KV events (topic kv-events, key = node id) --------------------------------


class BlocksStored(Record):
    """Blocks became resident on the producing node.

    ``block_keys`` are Conductor block keys (see :mod:`schemas.blocks`); when they are
    absent, ``token_ids`` must be present and the keys are derived from them with
    ``block_size`` and ``parent_key``.
    """

    kind: Literal["blocks_stored"] = "blocks_stored"
    block_keys: Annotated[list[U64], Field(max_length=MAX_BLOCKS)] | None = None
    parent_key: U64 | None = None
    token_ids: Annotated[list[TokenId], Field(max_length=MAX_TOKENS)] | None = None
    block_size: int = Field(default=16, ge=1, le=4096)
    tier: Tier = "hbm"
    lora_name: OptName = None
    extra_keys: Annotated[list[Scalar], Field(max_length=MAX_EXTRA_KEYS)] = []

    @model_validator(mode="after")
    def _keys_or_tokens(self) -> "BlocksStored":
        if self.block_keys is None and self.token_ids is None:
            raise ValueError("blocks_stored needs block_keys or token_ids")
        return self


class BlocksRemoved(Record):
    kind: Literal["blocks_removed"] = "blocks_removed"
    block_keys: Annotated[list[U64], Field(max_length=MAX_BLOCKS)]
    tier: Tier = "hbm"


class AllBlocksCleared(Record):
    kind: Literal["all_blocks_cleared"] = "all_blocks_cleared"


class BlocksMigrated(Record):
    """Blocks copied (``replicate``) or moved (``migrate``) between tiers and/or nodes."""

    kind: Literal["blocks_migrated"] = "blocks_migrated"
    mode: Literal["migrate", "replicate"] = "migrate"
    block_keys: Annotated[list[U64], Field(max_length=MAX_BLOCKS)]
    from_node: Name
    from_tier: Tier
    to_node: Name
    to_tier: Tier


# --- heartbeats (topic heartbeats, key = node id) -----------------------------


class Heartbeat(Record):
    """A node's load and capacity, published every heartbeat interval."""

    kind: Literal["heartbeat"] = "heartbeat"
    role: Role
    model: Name = "default"
    queue_depth: int = Field(default=0, ge=0)
    queued_prefill_tokens: int = Field(default=0, ge=0)
    running_requests: int = Field(default=0, ge=0)
    batch_size: int = Field(default=0, ge=0)
    decode_context_tokens: int = Field(default=0, ge=0)
    free_kv_blocks: int = Field(default=0, ge=0)
    total_kv_blocks: int = Field(default=0, ge=0)
    tier_capacity: Annotated[dict[Tier, int], Field(max_length=3)] = {}
    rack: OptName = None
    zone: OptName = None
    interval_s: float = Field(default=1.0, gt=0, le=3600)


# --- routing (topics requests and dispatch) -----------------------------------


class RoutingRequest(Record):
    """A request to be placed. Carries token ids or a precomputed block-key chain."""

    kind: Literal["routing_request"] = "routing_request"
    request_id: Name
    model: Name = "default"
    token_ids: Annotated[list[TokenId], Field(max_length=MAX_TOKENS)] | None = None
    block_keys: Annotated[list[U64], Field(max_length=MAX_BLOCKS)] | None = None
    block_size: int | None = Field(default=None, ge=1, le=4096)
    prompt_tokens: int = Field(ge=0, le=MAX_TOKENS)
    expected_output_tokens: int = Field(default=256, ge=0, le=MAX_TOKENS)
    ttft_slo_s: float | None = Field(default=None, gt=0)
    tbt_slo_ms: float | None = Field(default=None, gt=0)
    priority: int = Field(default=0, ge=-100, le=100)
    lora_name: OptName = None
    reply_to: OptName = None

    @model_validator(mode="after")
    def _tokens_or_chain(self) -> "RoutingRequest":
        if self.token_ids is None and self.block_keys is None:
            raise ValueError("routing_request needs token_ids or block_keys")
        if self.token_ids is not None and len(self.token_ids) != self.prompt_tokens:
            raise ValueError("prompt_tokens must equal len(token_ids)")
        return self


class RoutingDecision(Record):
    """Where a request runs, why, and on which view it was decided."""

    kind: Literal["routing_decision"] = "routing_decision"
    request_id: Name
    prefill_instance: Name
    decode_instance: Name
    reused_tokens: int = Field(ge=0)
    reuse_source: OptName = None
    """Node the reused prefix is read from (the prefill instance itself when local)."""
    reuse_tier: Tier | None = None
    predicted_ttft_s: float = Field(ge=0)
    predicted_tbt_ms: float = Field(ge=0)
    policy: Name
    params: Annotated[dict[Name, Scalar], Field(max_length=MAX_PARAMS)] = {}
    seed: U64 = 0
    watermark: Annotated[dict[Name, int], Field(max_length=4096)] = {}
    degraded: bool = False
    snapshot_age_ms: float = Field(default=0.0, ge=0)


class RoutingRejection(Record):
    kind: Literal["routing_rejection"] = "routing_rejection"
    request_id: Name
    reason: RejectReason
    message: Text = ""
    policy: OptName = None
    params: Annotated[dict[Name, Scalar], Field(max_length=MAX_PARAMS)] = {}
    seed: U64 = 0
    watermark: Annotated[dict[Name, int], Field(max_length=4096)] = {}


# --- KV balance commands (topics kv-commands and kv-command-results) -----------
# The executor protocol (which events prove which action, idempotence, deadlines) is
# described in schemas/README.md.

KvAction = Literal["replicate", "migrate", "demote", "evict"]
KvCommandStatus = Literal["done", "failed", "expired"]
KvFailure = Literal["not_held", "no_room", "source_unreachable", "unsupported", "internal_error"]
"""Why an executor could not carry a command out (``kv_command_result.error``)."""

_TIER_RANK = {"hbm": 0, "dram": 1, "ssd": 2}


class KvCommand(Record):
    """An order to move KV blocks, for exactly one executing node (:attr:`executor`).

    * ``replicate``: ``to_node`` pulls ``block_keys`` from ``from_node``/``from_tier`` into
      ``to_tier``; the holder keeps its copy.
    * ``migrate``: ``from_node`` moves the blocks from ``from_tier`` to ``to_tier`` (within the
      node; a move across nodes is a ``replicate`` followed by an ``evict``).
    * ``demote``: ``from_node`` moves the blocks to a lower (cheaper) tier.
    * ``evict``: ``from_node`` drops the blocks from ``from_tier``.

    ``command_id`` makes delivery at-least-once safe: an executor carries out one id once.
    ``deadline_ms`` (the producer's clock, ms since the epoch) is when the command stops
    being worth doing; an executor that reads it later answers ``expired``. ``token_ids``
    (with ``block_size``) are the prefix's tokens when the producer knows them, so that an
    engine that names blocks by its own hashes can materialise them.
    """

    kind: Literal["kv_command"] = "kv_command"
    command_id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    action: KvAction
    block_keys: Annotated[list[U64], Field(min_length=1, max_length=MAX_BLOCKS)]
    from_node: Name
    from_tier: Tier = "hbm"
    to_node: OptName = None
    to_tier: Tier | None = None
    deadline_ms: int | None = Field(default=None, ge=0)
    token_ids: Annotated[list[TokenId], Field(max_length=MAX_TOKENS)] | None = None
    block_size: int | None = Field(default=None, ge=1, le=4096)
    reason: Text = ""

    @model_validator(mode="after")
    def _consistent(self) -> "KvCommand":
        a = self.action
        if a == "replicate":
            if not self.to_node or self.to_node == self.from_node or self.to_tier is None:
                raise ValueError("replicate needs a to_node other than from_node, and a to_tier")
        elif a in ("migrate", "demote"):
            if self.to_node not in (None, self.from_node) or self.to_tier is None:
                raise ValueError(f"{a} stays on from_node and needs a to_tier (across nodes: replicate, then evict)")
            if a == "demote" and _TIER_RANK[self.to_tier] <= _TIER_RANK[self.from_tier]:
                raise ValueError("demote needs a to_tier below from_tier")
        elif self.to_node not in (None, self.from_node) or self.to_tier is not None:
            raise ValueError("evict names no destination")
        if self.token_ids is not None and self.block_size is None:
            raise ValueError("token_ids need block_size")
        return self

    @property
    def executor(self) -> str:
        """The node that carries the command out (and the key it travels under)."""
        return self.to_node if self.action == "replicate" and self.to_node else self.from_node


class KvCommandResult(Record):
    """What an executor did with one :class:`KvCommand` (topic ``kv-command-results``).

    ``done`` is only a claim: the proof is the KV events the executor published (see
    schemas/README.md). A re-delivered command id gets the same result again and no new
    events."""

    kind: Literal["kv_command_result"] = "kv_command_result"
    command_id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    action: KvAction
    node: Name
    """The executor."""
    status: KvCommandStatus
    error: KvFailure | None = None
    reason: Text = ""
    blocks: int = Field(default=0, ge=0)
    """Blocks that changed place (0 when everything was already where the command wanted it)."""
    bytes_moved: int = Field(default=0, ge=0)
    duration_ms: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _error_iff_failed(self) -> "KvCommandResult":
        if (self.status == "failed") != (self.error is not None):
            raise ValueError("error is set exactly when status is failed")
        return self


# --- dead letters (topic dead-letter) -----------------------------------------


class DeadLetter(Record):
    kind: Literal["dead_letter"] = "dead_letter"
    source_topic: Name
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)
    reason: Name
    """A short machine-readable code: ``decode_error``, ``validation_error``, ``wrong_kind``..."""
    error: Text
    original: bytes = Field(max_length=MAX_ORIGINAL_BYTES)


Body = Annotated[
    Union[
        BlocksStored,
        BlocksRemoved,
        AllBlocksCleared,
        BlocksMigrated,
        Heartbeat,
        RoutingRequest,
        RoutingDecision,
        RoutingRejection,
        KvCommand,
        KvCommandResult,
        DeadLetter,
    ],
    Field(discriminator="kind"),
]
KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared | BlocksMigrated

BODY_TYPES: dict[str, type[Record]] = {
    t.model_fields["kind"].default: t
    for t in (
        BlocksStored,
        BlocksRemoved,
        AllBlocksCleared,
        BlocksMigrated,
        Heartbeat,
        RoutingRequest,
        RoutingDecision,
        RoutingRejection,
        KvCommand,
        KvCommandResult,
        DeadLetter,
    )
}

# Current schema version per kind. Bump it and register an upcaster in
# ``schemas.codec`` whenever a body changes incompatibly.
SCHEMA_VERSIONS: dict[str, int] = {kind: 1 for kind in BODY_TYPES}
SCHEMA_VERSIONS["heartbeat"] = 2  # v2 added decode_context_tokens and zone
SCHEMA_VERSIONS["kv_command"] = 2  # v2 added command_id (required), deadline_ms, token_ids, block_size


class Envelope(Record):
    """The wire unit: who produced ``body``, in which order, and when."""

    schema_name: Name
    schema_version: int = Field(ge=1, le=1000)
    event_id: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    producer_id: Name
    producer_seq: int = Field(ge=0)
    epoch: int = Field(default=0, ge=0)
    ts_ms: int = Field(ge=0)
    body: Body

    @model_validator(mode="after")
    def _name_matches(self) -> "Envelope":
        if self.schema_name != self.body.kind:
            raise ValueError(f"schema_name {self.schema_name!r} does not match body kind {self.body.kind!r}")
        return self


def envelope(
    body: Record,
    *,
    producer_id: str,
    producer_seq: int,
    ts_ms: int,
    epoch: int = 0,
    event_id: str | None = None,
) -> Envelope:
    """Wrap ``body`` at the current schema version."""
    kind: Any = getattr(body, "kind")
    return Envelope(
        schema_name=kind,
        schema_version=SCHEMA_VERSIONS[kind],
        event_id=event_id or uuid.uuid4().hex,
        producer_id=producer_id,
        producer_seq=producer_seq,
        epoch=epoch,
        ts_ms=ts_ms,
        body=body,
    )
