"""The cache-location view: the pure fold from events to view operations, and its stores.

- :mod:`state.fold`: ``fold(envelope, node_stream) -> Folded`` (pure).
- :mod:`state.write`: ``fold_and_write``: the one write path of both stores.
- :mod:`state.view`: the read/write contracts (``ViewReader``, ``ViewStore``), ``Outcome``, types.
- :mod:`state.keys`: the Redis layout (key names under the ``{ns}`` hash tag, block-key bytes, node-hash fields; pure).
- :mod:`state.connect`: which Redis client a URL means (one server, or ``redis+cluster://``).
- :mod:`state.memory`: ``InMemoryViewStore`` (sync + async API; the simulator's view).
- :mod:`state.redis_view`: ``RedisViewStore`` (the production view).
- :mod:`state.reader`: ``RawSnapshotReader`` (the router's fast ``ViewReader``).
"""

from .fold import NodeStream, fold
from .memory import InMemoryViewStore
from .view import NodeState, Outcome, SourcePosition, ViewReader, ViewSnapshot, ViewStore

__all__ = [
    "InMemoryViewStore",
    "NodeState",
    "NodeStream",
    "Outcome",
    "SourcePosition",
    "ViewReader",
    "ViewSnapshot",
    "ViewStore",
    "fold",
]
