"""Engines plug in: read vLLM/SGLang KV events from ZMQ and publish them as Conductor records.

``wire`` decodes (and, for emulated engines, encodes) the engines' format;
``translate`` turns one node's engine events into Conductor KV events (pure);
``runner`` follows an engine over ZMQ with replay and epochs; ``publisher`` is
a vLLM-compatible PUB + replay ROUTER for emulated engines and tests.
"""

from conductor.bridge.runner import Bridge, BridgeConfig, kafka_sink
from conductor.bridge.translate import NodeTranslator
from conductor.bridge.wire import WireError, decode_batch, encode_batch

__all__ = ["Bridge", "BridgeConfig", "NodeTranslator", "WireError", "decode_batch", "encode_batch", "kafka_sink"]
