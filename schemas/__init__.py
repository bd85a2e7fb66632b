"""Records, the wire codec and block keys. Imports nothing else of Conductor."""

from .blocks import ROOT_KEY, chain_from_precomputed, chain_keys, chain_keys_per_block, request_keys, vllm_block_extras
from .codec import CONTENT_TYPE, DECIDED_BY_HEADER, DecodeError, decided_by, decode, encode, headers
from .records import (
    BODY_TYPES,
    SCHEMA_VERSIONS,
    TIERS,
    AllBlocksCleared,
    BlocksMigrated,
    BlocksRemoved,
    BlocksStored,
    ControlAction,
    ControlCommand,
    DeadLetter,
    Endpoint,
    Envelope,
    Heartbeat,
    KvAction,
    KvCommand,
    KvCommandResult,
    KvCommandStatus,
    KvEvent,
    KvFailure,
    MmItem,
    Mode,
    ModeOption,
    RejectReason,
    RequestOutcome,
    Role,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
    Tier,
    can_hand_off,
    envelope,
    request_chain_keys,
)

__all__ = [
    "BODY_TYPES", "CONTENT_TYPE", "DECIDED_BY_HEADER", "ROOT_KEY", "SCHEMA_VERSIONS", "TIERS", "AllBlocksCleared", "BlocksMigrated",
    "BlocksRemoved", "BlocksStored", "ControlAction", "ControlCommand", "DeadLetter", "DecodeError", "Endpoint",
    "Envelope", "Heartbeat", "KvAction", "KvCommand", "KvCommandResult", "KvCommandStatus", "KvEvent", "KvFailure",
    "MmItem", "Mode", "ModeOption", "RejectReason", "RequestOutcome", "Role", "RoutingDecision", "RoutingRejection",
    "RoutingRequest", "Tier", "can_hand_off", "chain_from_precomputed", "chain_keys", "chain_keys_per_block",
    "decided_by", "decode", "encode", "envelope", "headers", "request_chain_keys", "request_keys", "vllm_block_extras",
]
