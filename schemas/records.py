"""Every record that travels on a Conductor topic.

Each body is a frozen pydantic model with a literal ``kind``; an :class:`Envelope`
carries one body plus the producer's identity, sequence number and epoch. Lists
and strings are capped so that a hostile or broken producer cannot make a
consumer allocate without bound.
"""

from __future__ import annotations

import hashlib
import itertools
import uuid
from typing import Annotated, Literal, TypeAlias, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from .blocks import request_keys

# --- caps -------------------------------------------------------------------
MAX_NAME = 256
MAX_TEXT = 4096
MAX_BLOCKS = 16_384  # block keys in one event or one request chain
MAX_TOKENS = 1_048_576  # token ids in one event or request (2,048 x 512-token blocks)
MAX_EXTRA_KEYS = 64
MAX_PARAMS = 64
MAX_ORIGINAL_BYTES = 65_536
"""At most this much of a bad record rides in its dead letter (with topic, partition and
offset to fetch the rest): a dead letter always fits the topic's 1 MB message limit."""
MAX_KEY_BYTES = 1024
"""At most this much of a bad record's Kafka key rides in its dead letter (``key_size`` says the rest)."""
MAX_GROUP = 64  # prefill instances in one chunked-pipeline (CPP) group
MAX_SEEN = 1024  # producers named in a decision's cut of the shared decision-time streams

U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME)]
OptName = Annotated[str, StringConstraints(max_length=MAX_NAME)] | None
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
Scalar = bool | int | float | Annotated[str, StringConstraints(max_length=MAX_NAME)] | None

Tier = Literal["hbm", "dram", "ssd"]
"""Where a block lives: GPU memory, host memory, or local disk/remote pool SSD."""
TIERS: tuple[Tier, ...] = ("hbm", "dram", "ssd")

Role = Literal["prefill", "decode", "both", "store"]
"""``store`` is a shared KV pool node (the Mooncake Store): it holds blocks but runs no model."""

MAX_DP_RANK = 1023
Url = Annotated[str, StringConstraints(max_length=MAX_NAME, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")]
"""An engine's base URL: http(s), a host and port, optionally a path prefix; no query."""
Mode = Literal["disaggregated", "aggregated"]
"""How a request runs: prefill on one instance and decode on another (the KV handed off), or
both on one instance in one call."""


def can_hand_off(role: str, kv_transfer: bool | None) -> bool:
    """Whether an instance takes part in P/D hand-offs: as its heartbeat says, else by role."""
    if kv_transfer is not None:
        return kv_transfer
    return role in ("prefill", "decode")

PolicyRejectReason = Literal["ttft_slo", "tbt_slo", "no_live_instance", "overloaded"]
"""Why a policy turns a request away (its prediction, or nothing to run it on)."""
RejectReason = Literal[PolicyRejectReason, "invalid_request", "view_unavailable", "view_rebuilding"]
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
    def _keys_or_tokens(self) -> BlocksStored:
        if self.block_keys is None and self.token_ids is None:
            raise ValueError("blocks_stored needs block_keys or token_ids")
        if self.block_keys is None and len(self.token_ids or ()) // self.block_size > MAX_BLOCKS:
            raise ValueError(f"token_ids make {len(self.token_ids or ()) // self.block_size} blocks of "
                             f"{self.block_size}; at most {MAX_BLOCKS} blocks per record")
        return self


class BlocksRemoved(Record):
    kind: Literal["blocks_removed"] = "blocks_removed"
    block_keys: Annotated[list[U64], Field(max_length=MAX_BLOCKS)]
    tier: Tier = "hbm"
    node: OptName = None
    """Whose blocks left, when not the producer's own: a shared pool (a ``store`` node) is written
    and found missing by many engines, each publishing on its own stream (v2)."""


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
    # v3: how to reach the engine (discovery) and whether it takes part in P/D hand-offs
    endpoint: Url | None = None
    """The engine's serving base URL (``http://host:port``, no path): gateways send to it."""
    dp_rank: int | None = Field(default=None, ge=0, le=MAX_DP_RANK)
    """The data-parallel rank this node is, when the engine runs several behind one URL: a
    gateway pins the request to it (vLLM's ``X-data-parallel-rank`` header)."""
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    """SGLang: the prefill server's bootstrap port (P/D hand-off rendezvous)."""
    kv_transfer: bool | None = None
    """Whether the engine runs a KV connector and can hand a prefill's KV to a peer (or pull
    one). None: by role (``prefill`` and ``decode`` can, an aggregated ``both`` cannot)."""
    # v4: engines that publish no KV events
    kv_events: bool | None = None
    """False: the node publishes no KV events (a bridge in ``--no-events`` mode), so the view holds
    none of its blocks and routing knows them only from its own decisions (pending blocks, bounded
    by ``total_kv_blocks`` where the engine's ``/metrics`` tells it). None: it does (or did not say:
    every producer before v4)."""

    @property
    def handoff(self) -> bool:
        return can_hand_off(self.role, self.kv_transfer)


# --- routing (topics requests and dispatch) -----------------------------------


class MmItem(Record):
    """One multimodal input of a prompt: its identifier (vLLM's ``mm_hash``) and placeholder tokens."""

    identifier: Name
    offset: int = Field(ge=0, le=MAX_TOKENS)
    length: int = Field(ge=1, le=MAX_TOKENS)


class RoutingRequest(Record):
    """A request to be placed. Carries token ids or a precomputed block-key chain.

    ``lora_name``, ``mm_items`` and ``cache_salt`` go into the block keys exactly as vLLM
    puts them into its own block hashes; ``extra_keys`` (one entry per full block, as an
    engine's ``BlockStored.extra_keys`` reports them) overrides all three when given.
    """

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
    cache_salt: OptName = None
    """vLLM's per-request cache salt: an extra key of every block, so salted prefixes never match unsalted ones."""
    mm_items: Annotated[list[MmItem], Field(max_length=MAX_EXTRA_KEYS)] = []
    extra_keys: Annotated[
        list[Annotated[list[Scalar], Field(max_length=MAX_EXTRA_KEYS)] | None], Field(max_length=MAX_BLOCKS)
    ] | None = None
    reply_to: OptName = None
    """The gateway id that waits for this decision: the router also writes it to that gateway's reply topic."""
    exclude: Annotated[list[Name], Field(max_length=64)] = []
    """Instances the decision must not name (a retry after an instance failed mid-request)."""
    retry_of: OptName = None
    """The request id this one retries (the failed attempt's decision stays in the log)."""
    reachable: Annotated[list[Name], Field(max_length=4096)] | None = None
    """v3, from a gateway: the decision must name only engines it can reach, those whose
    heartbeats announce an ``endpoint`` and these (its ``--engine`` overrides). None: any."""
    decided_by: OptName = None
    """v4: the process that already decided this request in its own process (a gateway's
    colocated router) and wrote the decision to ``dispatch`` itself: the record is here for the
    audit trail (``explain`` reads it), and routers skip it. None: a router decides it."""
    session: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    """v5: the conversation this request belongs to (the ``x-conductor-session`` header, else the
    OpenAI ``user`` field): the router keeps it on the instance that served the session last
    unless leaving pays (the stay rule). None: no session."""
    releases: bool = False
    """v5: its producer releases its in-flight work at the first token and at the end (a gateway
    does, colocated or through the log): a router charges Conductor's in-flight ledger for such
    requests only; other producers' work is counted by the engines' heartbeats, not left to a lease."""

    @model_validator(mode="after")
    def _tokens_or_chain(self) -> RoutingRequest:
        if self.token_ids is None and self.block_keys is None:
            raise ValueError("routing_request needs token_ids or block_keys")
        if self.token_ids is not None and len(self.token_ids) != self.prompt_tokens:
            raise ValueError("prompt_tokens must equal len(token_ids)")
        return self


class Endpoint(Record):
    """Where a gateway reaches one engine (from the node's heartbeats)."""

    url: Url
    dp_rank: int | None = Field(default=None, ge=0, le=MAX_DP_RANK)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)


class ModeOption(Record):
    """One way to run a request the router costed: the instances and the predictions."""

    mode: Mode
    prefill_instance: Name
    decode_instance: Name
    predicted_ttft_s: float = Field(ge=0)
    predicted_tbt_ms: float = Field(ge=0)
    fits: bool = True
    """Whether it met the SLOs (and the decode had room)."""


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
    # v2: what re-deriving the decision needs besides the log (explain needs no environment)
    control_offset: int = Field(default=-1, ge=-1)
    """Offset of the last ``control`` record applied when deciding (-1: none)."""
    block_size: int | None = Field(default=None, ge=1, le=4096)
    model_profile: OptName = None
    view_now_ms: int | None = Field(default=None, ge=0)
    """v3: the view's clock (Redis TIME) the router read the view and stamped reservations
    at; `explain` re-derives at this instant (older decisions: the envelope's ts_ms)."""
    degraded_reason: Text = ""
    """Why the decision is ``degraded`` (view unreachable, lost, or being rebuilt from the log)."""
    prefill_group: Annotated[list[Name], Field(min_length=2, max_length=MAX_GROUP)] | None = None
    """Chunked pipeline parallelism: the prefill instances in pipeline order, the first being
    ``prefill_instance``; each computes its chunk and hands the KV so far on to the next, the
    last hands the whole prompt's KV to ``decode_instance``. None = one prefill instance."""
    chunk_boundaries: Annotated[list[Annotated[int, Field(ge=1, le=MAX_TOKENS)]],
                                Field(min_length=2, max_length=MAX_GROUP)] | None = None
    """With ``prefill_group``: the end token of each member's chunk, increasing, the last being
    the prompt length; the first chunk starts at ``reused_tokens``."""
    # v3: the mode, the other mode's costs, and where the named instances are reached
    mode: Mode = "disaggregated"
    """``aggregated``: ``prefill_instance == decode_instance`` runs the whole request in one call."""
    options: Annotated[list[ModeOption], Field(max_length=2)] = []
    """Each mode the router costed for this request (the chosen one and the other, when
    there was a choice): what ``explain`` shows."""
    endpoints: Annotated[dict[Name, Endpoint], Field(max_length=MAX_GROUP + 1)] = {}
    """How to reach each instance the decision names, as their heartbeats announced it
    (absent when the engine announced none: a gateway's ``--engine`` then says)."""
    # v4: decisions made where the request arrived (a gateway's colocated router)
    decided_by: OptName = None
    """The process that decided in its own process (a gateway id); None: a router of ``requests``."""
    ordinal: int | None = Field(default=None, ge=0)
    """The turn order-based policies rotated by, when it is not the request's ``requests``
    offset (a colocated router decides before its request is on the log): what ``explain`` uses."""
    # v5: decision-time knowledge (pending blocks, Conductor's own in-flight work)
    pending_ttl_ms: int | None = Field(default=None, ge=1)
    """The pending blocks' TTL the router counted earlier decisions' placements with (their
    blocks reusable as if confirmed, up to this long); None: it counted none."""
    inflight_lease_ms: int | None = Field(default=None, ge=1)
    """The in-flight ledger's lease when the loads were Conductor's own in-flight work (each
    quantity the larger of it and the heartbeat's); None: heartbeats plus reservations."""
    queued_tokens_ahead: int | None = Field(default=None, ge=0)
    """Uncached prompt tokens queued ahead of this request on its prefill instance (its
    capacity group's) as the decision counted them: the work its predicted queue wait drains."""
    left_holder: Text | None = None
    """Why the instance holding the longest prefix of the chain was not chosen, when it was not
    (its predicted TTFT lost by more than the prediction's measured error); None: it was, or none held one."""
    # v6: sessions
    session_instance: OptName = None
    """The prefill instance that served the request's session last, as the router knew it when
    deciding (it counts as a holder in the stay rule; ``explain`` decides again with it)."""
    # also v6: what the decision-time records held when it was made (state.shared_log)
    event: int | None = Field(default=None, ge=0)
    """This decision's number among its router's shared operations (its pending blocks and its
    charge), under ``event_producer``; None: the router shares none."""
    event_producer: OptName = None
    """Whose numbering ``event`` is (the deciding process's id on the shared streams)."""
    seen_pending: Annotated[dict[Name, int], Field(max_length=MAX_SEEN)] | None = None
    """Per producer, the last event whose pending-block operations the router had applied when
    deciding (a producer not named: none of its); None: not recorded (``explain`` goes by time)."""
    seen_inflight: Annotated[dict[Name, int], Field(max_length=MAX_SEEN)] | None = None
    """The same for the in-flight ledger's operations (charges, first tokens, ends)."""
    seen_reservations: Annotated[dict[Name, int], Field(max_length=MAX_SEEN)] | None = None
    """The same for the reservations (per replica, its last reservation applied) when the loads
    were heartbeats plus reservations."""
    reservation_event: int | None = Field(default=None, ge=0)
    """This decision's reservation, by number under ``reservation_producer``."""
    reservation_producer: OptName = None
    """Whose numbering ``reservation_event`` is (the deciding router's id on the reservations' stream)."""

    @property
    def aggregated(self) -> bool:
        return self.mode == "aggregated"

    @model_validator(mode="after")
    def _group_and_chunks(self) -> RoutingDecision:
        g, b = self.prefill_group, self.chunk_boundaries
        if g is None and b is None:
            return self
        if g is None or b is None or len(g) != len(b):
            raise ValueError("prefill_group and chunk_boundaries go together, one chunk per member")
        if g[0] != self.prefill_instance:
            raise ValueError(f"prefill_group must start with prefill_instance {self.prefill_instance!r}")
        if len(set(g)) != len(g):
            raise ValueError("prefill_group names an instance twice")
        if b[0] <= self.reused_tokens or any(x >= y for x, y in itertools.pairwise(b)):
            raise ValueError("chunk_boundaries must increase, starting past reused_tokens")
        return self

    @model_validator(mode="after")
    def _mode_matches(self) -> RoutingDecision:
        if self.mode == "aggregated" and (self.prefill_instance != self.decode_instance or self.prefill_group):
            raise ValueError("an aggregated decision names one instance as prefill_instance and decode_instance, "
                             "and no prefill_group")
        return self


class RoutingRejection(Record):
    kind: Literal["routing_rejection"] = "routing_rejection"
    request_id: Name
    reason: RejectReason
    message: Text = ""
    policy: OptName = None
    params: Annotated[dict[Name, Scalar], Field(max_length=MAX_PARAMS)] = {}
    seed: U64 = 0
    watermark: Annotated[dict[Name, int], Field(max_length=4096)] = {}
    control_offset: int = Field(default=-1, ge=-1)  # v2
    block_size: int | None = Field(default=None, ge=1, le=4096)  # v2
    model_profile: OptName = None  # v2
    view_now_ms: int | None = Field(default=None, ge=0)  # v3: see RoutingDecision.view_now_ms


# --- runtime control (topic control, one partition: one total order) -------------

ControlAction = Literal["set_policy", "set_params", "cordon", "drain", "uncordon", "set_profile"]


class ControlCommand(Record):
    """An operator's change, applied by every router in log order.

    ``set_policy`` switches the policy (``params`` replace the old ones); ``set_params``
    replaces the current policy's parameters; ``cordon`` and ``drain`` stop new requests
    to ``node_id`` (running ones finish; ``drain`` says the node is going away);
    ``uncordon`` takes it back. ``set_profile`` (v2) replaces the cost model the policy
    predicts with by ``profile`` (a :class:`~conductor.costmodel.profiles.ModelProfile` as a dict, fitted
    from the engines' measurements, with its observed prediction error).
    """

    kind: Literal["control"] = "control"
    action: ControlAction
    policy: OptName = None
    params: Annotated[dict[Name, Scalar], Field(max_length=MAX_PARAMS)] = {}
    node_id: OptName = None
    reason: Text = ""
    operator: OptName = None
    """Who asked (the admin token's scope name or a CLI user), for the audit trail."""
    profile: Annotated[dict[Name, Scalar], Field(max_length=MAX_PARAMS)] | None = None
    """v2, ``set_profile``: the whole model profile, field by field (validated by the routers:
    one they cannot build is skipped like a bad policy)."""
    model: OptName = None
    """v2, ``set_profile``: the model the profile was fitted on (None: every model)."""

    @model_validator(mode="after")
    def _complete(self) -> ControlCommand:
        if self.action == "set_policy" and not self.policy:
            raise ValueError("set_policy needs policy")
        if self.action == "set_profile" and not self.profile:
            raise ValueError("set_profile needs profile")
        if self.action in ("cordon", "drain", "uncordon") and not self.node_id:
            raise ValueError(f"{self.action} needs node_id")
        return self


# --- what happened to a request (topic request-outcomes, key = request id) -------


class RequestOutcome(Record):
    """What a gateway observed for one client request, once it ended (served, rejected or failed).

    Placed next to the decision's predictions, it gives the prediction error, the real
    cache-hit rate and the measurements ``profile fit`` needs, from production traffic.
    """

    kind: Literal["request_outcome"] = "request_outcome"
    request_id: Name
    """The client request's id (the first attempt's routing request id)."""
    gateway: Name
    status: int = Field(ge=100, le=599)
    """The HTTP status the client got (200 even when a stream ended in an error event)."""
    error: OptName = None
    """A short code: a rejection reason, ``engine_failed``, ``decision_timeout``...; None when served."""
    message: Text = ""
    attempts: Annotated[list[Name], Field(max_length=16)] = []
    """The routing request id of every attempt, first to last."""
    prefill_instance: OptName = None
    decode_instance: OptName = None
    excluded: Annotated[list[Name], Field(max_length=64)] = []
    """Instances that failed during this request (and were excluded from its retries)."""
    prompt_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    cached_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    """Prompt tokens the prefill engine reported as read from cache, when it reports them."""
    output_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    predicted_ttft_s: float | None = Field(default=None, ge=0)
    predicted_tbt_ms: float | None = Field(default=None, ge=0)
    ttft_s: float | None = Field(default=None, ge=0)
    """Arrival at the gateway to the first output token leaving it."""
    tbt_p50_ms: float | None = Field(default=None, ge=0)
    tbt_p99_ms: float | None = Field(default=None, ge=0)
    routing_ms: float | None = Field(default=None, ge=0)
    """Tokenizing + the request's round trip through the log to its decision (all attempts)."""
    total_s: float = Field(default=0.0, ge=0)
    stream: bool = False
    # v2: the TTFT split as the gateway sees it, and what the prediction was made with
    model: OptName = None
    """The model the client asked for (what a fitted cost model is kept per)."""
    decided_s: float | None = Field(default=None, ge=0)
    """Arrival to the (last) decision: parse, tokenize, routing. ``ttft_s - decided_s`` is what
    the decision's ``predicted_ttft_s`` predicts (queue, prefill, transfer, first token)."""
    prefill_s: float | None = Field(default=None, ge=0)
    """Wall time of the prefill call(s) of a P/D hand-off (None when aggregated)."""
    decode_ttft_s: float | None = Field(default=None, ge=0)
    """From sending the decode (or aggregated) call to its first token."""
    reused_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    """The decision's predicted reuse (``cached_tokens`` is what the engine reported)."""
    mode: Mode | None = None
    control_offset: int | None = Field(default=None, ge=-1)
    """The decision's control offset: which cost model predicted it."""
    # v3: when the request's prefill and the whole request ended, on the view's clock
    first_token_view_ms: int | None = Field(default=None, ge=0)
    """The first token's time on the view's clock (the decision's ``view_now_ms`` plus the
    gateway's monotonic time since the decision): its prefill's in-flight work ends here."""
    finished_view_ms: int | None = Field(default=None, ge=0)
    """When the request ended (served, failed or cancelled) on the view's clock: its in-flight
    work ends here, and a failed request's pending blocks too."""
    # v4: which shared operations were those releases (state.shared_log's numbering)
    release_producer: OptName = None
    """Who shared the releases below (the door's id on the shared streams; a colocated gateway's own)."""
    first_token_event: int | None = Field(default=None, ge=0)
    """The first token's release, by number under ``release_producer`` (None: not shared)."""
    finished_event: int | None = Field(default=None, ge=0)
    """The end's release (its in-flight end and, failed, its pending blocks' release)."""


# --- KV balance commands (topics kv-commands and kv-command-results) -----------
# The executor protocol (which events prove which action, idempotence, deadlines) is
# described in schemas/README.md.

KvAction = Literal["replicate", "migrate", "demote", "evict"]
KvCommandStatus = Literal["done", "failed", "expired"]
KvFailure = Literal["not_held", "no_room", "source_unreachable", "unsupported", "internal_error"]
"""Why an executor could not carry a command out (``kv_command_result.error``)."""

_TIER_RANK = {t: i for i, t in enumerate(TIERS)}  # fastest first


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

    ``by_node`` names the executor when it is not the default one: a shared KV pool (a
    ``store`` node) has no process of its own, so a ``replicate`` into it is pushed by the
    holder (``by_node == from_node``), and an ``evict`` from it is carried out by an engine
    joined to the pool.
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
    by_node: OptName = None

    @model_validator(mode="after")
    def _consistent(self) -> KvCommand:
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
        if a == "replicate" and self.by_node not in (None, self.from_node, self.to_node):
            raise ValueError("a replicate is carried out by its target (pull) or its source (push into a pool)")
        return self

    @property
    def executor(self) -> str:
        """The node that carries the command out (and the key it travels under)."""
        if self.by_node:
            return self.by_node
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
    def _error_iff_failed(self) -> KvCommandResult:
        if (self.status == "failed") != (self.error is not None):
            raise ValueError("error is set exactly when status is failed")
        return self


# --- dead letters (topic dead-letter) -----------------------------------------


class DeadLetter(Record):
    """A record a consumer could not take, set aside with why; build one with :meth:`of`."""

    kind: Literal["dead_letter"] = "dead_letter"
    source_topic: Name
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)
    reason: Name
    """A short machine-readable code: ``decode_error``, ``validation_error``, ``wrong_kind``..."""
    error: Text
    original: bytes = Field(max_length=MAX_ORIGINAL_BYTES)
    """The record's value, or its first ``MAX_ORIGINAL_BYTES`` when longer (see ``original_size``)."""
    # v2: what a cut ``original`` leaves out is named, never silently lost
    original_size: int | None = Field(default=None, ge=0)
    """The whole value's length in bytes (None: not recorded, a v1 letter)."""
    original_sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None
    """The whole value's SHA-256 (hex): what the record fetched from its position must hash to."""
    key: bytes | None = Field(default=None, max_length=MAX_KEY_BYTES)
    """The record's Kafka key as sent (any bytes), or its first ``MAX_KEY_BYTES``; None: no key."""
    key_size: int | None = Field(default=None, ge=0)

    @property
    def complete(self) -> bool:
        """Whether ``original`` and ``key`` are the whole record (a cut one cannot be re-sent as is)."""
        return ((self.original_size is None or self.original_size == len(self.original))
                and (self.key_size is None or self.key is None or self.key_size == len(self.key)))

    @classmethod
    def of(cls, source_topic: str, partition: int, offset: int, reason: str, error: str,
           value: bytes | bytearray | memoryview | None, key: bytes | bytearray | memoryview | None = None,
           ) -> DeadLetter:
        """The dead letter of any record: never raises, whatever the bytes, key or texts.

        Texts are cut to their caps (characters that are not UTF-8 escaped), the value to
        ``MAX_ORIGINAL_BYTES`` with its whole length and SHA-256 kept, the key to ``MAX_KEY_BYTES``.
        """
        whole = bytes(value) if value is not None else b""
        raw_key = bytes(key) if key is not None else None
        return cls(
            source_topic=_printable(source_topic, MAX_NAME) or "?",
            partition=max(0, int(partition)),
            offset=max(0, int(offset)),
            reason=_printable(reason, MAX_NAME) or "unknown",
            error=_printable(error, MAX_TEXT),
            original=whole[:MAX_ORIGINAL_BYTES],
            original_size=len(whole),
            original_sha256=hashlib.sha256(whole).hexdigest(),
            key=raw_key[:MAX_KEY_BYTES] if raw_key is not None else None,
            key_size=len(raw_key) if raw_key is not None else None,
        )


def _printable(text: object, cap: int) -> str:
    """``text`` as a string that encodes as UTF-8 (lone surrogates escaped), at most ``cap`` characters."""
    s = text if isinstance(text, str) else repr(text)
    return s[:cap].encode("utf-8", "backslashreplace").decode("utf-8")[:cap]


# --- capacity plans (topic plans) ----------------------------------------------


class CapacityPlan(Record):
    """What ``conductor planner`` advised: the fewest instances per role that meet the SLOs for
    ``target`` of the traffic of ``window_start_ms``..``window_end_ms`` (times ``growth``), as the
    simulator predicts with the policy in force, beside today's cluster. An advice, never an
    action: an autoscaler reads it (the planner's gauges) and scales."""

    kind: Literal["capacity_plan"] = "capacity_plan"
    prefill: int = Field(ge=1)
    decode: int = Field(ge=1)
    predicted_slo_attainment: float = Field(ge=0.0, le=1.0)
    cluster_prefill: int = Field(ge=1)
    cluster_decode: int = Field(ge=1)
    cluster_slo_attainment: float = Field(ge=0.0, le=1.0)
    target: float = Field(gt=0.0, le=1.0)
    target_met: bool = True
    """False: no cluster up to the search's bound met ``target``; the plan is the smallest that came
    within the search's slack of the best attainment reached."""
    growth: float = Field(gt=0.0)
    ttft_slo_s: float = Field(gt=0.0)
    tbt_slo_ms: float = Field(gt=0.0)
    policy: Name
    model_profile: Name
    window_start_ms: int = Field(ge=0)
    window_end_ms: int = Field(ge=0)
    requests: int = Field(ge=0)
    goodput_rps: float = Field(ge=0.0)
    rejection_rate: float = Field(ge=0.0, le=1.0)
    headroom: float | None = None
    """Extra traffic the plan carries before falling below target (0.1 = 10 %); None: not measured."""
    simulations: int = Field(ge=0)


AnyBody: TypeAlias = (
    BlocksStored | BlocksRemoved | AllBlocksCleared | BlocksMigrated | Heartbeat | RoutingRequest | RoutingDecision
    | RoutingRejection | RequestOutcome | KvCommand | KvCommandResult | DeadLetter | ControlCommand
    | CapacityPlan
)
"""Every record body, declared once: the envelope's union, :data:`BODIES` and the codec's table
come from it."""
BODIES: tuple[type[Record], ...] = get_args(AnyBody)
Body = Annotated[AnyBody, Field(discriminator="kind")]
KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared | BlocksMigrated

BODY_TYPES: dict[str, type[Record]] = {t.model_fields["kind"].default: t for t in BODIES}

# Current schema version per kind. Bump it and register an upcaster in
# ``schemas.codec`` whenever a body changes incompatibly.
SCHEMA_VERSIONS: dict[str, int] = {kind: 1 for kind in BODY_TYPES}
SCHEMA_VERSIONS["heartbeat"] = 4  # v2 added decode_context_tokens and zone; v3 endpoint, dp_rank, bootstrap_port, kv_transfer; v4 kv_events
SCHEMA_VERSIONS["routing_request"] = 5  # v2 added cache_salt, exclude and retry_of; v3 reachable; v4 decided_by; v5 session
SCHEMA_VERSIONS["routing_decision"] = 6  # v2 added control_offset, block_size, model_profile, prefill_group, chunk_boundaries; v3 mode, options, endpoints; v4 decided_by, ordinal; v5 pending_ttl_ms, inflight_lease_ms, queued_tokens_ahead, left_holder; v6 session_instance (some v5 records have it), event, event_producer, seen_pending, seen_inflight, seen_reservations, reservation_event, reservation_producer
SCHEMA_VERSIONS["routing_rejection"] = 2  # v2 added control_offset, block_size, model_profile
SCHEMA_VERSIONS["kv_command"] = 3  # v2 added command_id (required), deadline_ms, token_ids, block_size; v3 by_node
SCHEMA_VERSIONS["blocks_removed"] = 2  # v2 added node (a shared pool's blocks removed by another producer)
SCHEMA_VERSIONS["dead_letter"] = 2  # v2 added original_size, original_sha256, key and key_size
SCHEMA_VERSIONS["request_outcome"] = 4  # v2 added model, decided_s, prefill_s, decode_ttft_s, reused_tokens, mode, control_offset; v3 first_token_view_ms, finished_view_ms; v4 release_producer, first_token_event, finished_event
SCHEMA_VERSIONS["control"] = 2  # v2 added set_profile with profile and model


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
    def _name_matches(self) -> Envelope:
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
    """Wrap ``body`` (one of :data:`BODIES`) at the current schema version."""
    if not isinstance(body, AnyBody):
        raise TypeError(f"{type(body).__name__} is not a record body (one of schemas.records.BODIES)")
    return Envelope(
        schema_name=body.kind,
        schema_version=SCHEMA_VERSIONS[body.kind],
        event_id=event_id or uuid.uuid4().hex,
        producer_id=producer_id,
        producer_seq=producer_seq,
        epoch=epoch,
        ts_ms=ts_ms,
        body=body,
    )


def request_chain_keys(req: RoutingRequest, block_size: int) -> list[int]:
    """The block keys of a request given as token ids (LoRA, multimodal items, cache salt included)."""
    return request_keys(
        req.token_ids or [], block_size, lora_name=req.lora_name,
        mm_items=[(m.identifier, m.offset, m.length) for m in req.mm_items], cache_salt=req.cache_salt,
        extra_keys=req.extra_keys,
    )
