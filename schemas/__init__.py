"""Records, the wire codec and block keys. Imports nothing else of Conductor."""

from .blocks import ROOT_KEY, chain_from_precomputed, chain_keys
from .codec import CONTENT_TYPE, DecodeError, decode, encode, headers
from .records import (
    BODY_TYPES,
    SCHEMA_VERSIONS,
    TIERS,
    AllBlocksCleared,
    BlocksMigrated,
    BlocksRemoved,
    BlocksStored,
    DeadLetter,
    Envelope,
    Heartbeat,
    KvAction,
    KvCommand,
    KvCommandResult,
    KvCommandStatus,
    KvFailure,
    KvEvent,
    RejectReason,
    Role,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
    Tier,
    envelope,
)

__all__ = [
    "ROOT_KEY", "chain_from_precomputed", "chain_keys", "CONTENT_TYPE", "DecodeError", "decode",
    "encode", "headers", "BODY_TYPES", "SCHEMA_VERSIONS", "TIERS", "AllBlocksCleared",
    "BlocksMigrated", "BlocksRemoved", "BlocksStored", "DeadLetter", "Envelope", "Heartbeat",
    "KvAction", "KvCommand", "KvCommandResult", "KvCommandStatus", "KvFailure", "KvEvent", "RejectReason", "Role", "RoutingDecision", "RoutingRejection",
    "RoutingRequest", "Tier", "envelope",
]
