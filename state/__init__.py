"""The cache-location view: the pure fold from events to view operations, and its stores.

- :mod:`state.fold`: ``fold(envelope, node_stream) -> Folded`` (pure).
- :mod:`state.view`: the read/write contracts (``ViewReader``, ``ViewStore``) and types.
- :mod:`state.memory`: ``InMemoryViewStore`` (sync + async API; the simulator's view).
- :mod:`state.redis_view`: ``RedisViewStore`` (the production view).
"""

from .fold import NodeStream, fold
from .memory import InMemoryViewStore
from .view import NodeState, SourcePosition, ViewReader, ViewSnapshot, ViewStore

__all__ = [
    "NodeStream", "fold", "InMemoryViewStore", "NodeState", "SourcePosition", "ViewReader",
    "ViewSnapshot", "ViewStore",
]
