"""Where the engines are: a front door's ``--engine`` overrides plus what the view says.

Bridges announce each engine's serving URL in its heartbeats (``Heartbeat.endpoint``); the
view keeps it with the node. Decisions carry the endpoints of the nodes they name, so the
request path needs nothing else; the directory serves what happens before a decision or
beside it: ``/tokenize`` and ``/v1/models`` go to a live engine found here. It reads the
view's node table at most every ``refresh_s`` (one ``HGETALL``), and keeps the last answer
when the view cannot be read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from schemas import RoutingDecision
from state.view import NodeState

log = logging.getLogger(__name__)

NodesReader = Callable[[], Awaitable[Sequence[NodeState]]]


class EngineDirectory:
    """Node id → base URL of the engines a front door can reach."""

    def __init__(self, overrides: Mapping[str, str], read_nodes: NodesReader | None = None, *,
                 ttl_s: float = 3.0, refresh_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.overrides = {k: v.rstrip("/") for k, v in overrides.items()}
        self._read = read_nodes
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.clock = clock
        self._found: dict[str, str] = {}
        self._at = float("-inf")

    async def refresh(self, force: bool = False) -> None:
        """Read the view's nodes again if the last read is older than ``refresh_s``."""
        if self._read is None or (not force and self.clock() - self._at < self.refresh_s):
            return
        self._at = self.clock()
        try:
            nodes = await self._read()
        except Exception as e:  # noqa: BLE001 - the view's client raises its own errors; keep the last answer
            log.warning("engine directory: the view could not be read (%s); keeping %d engine(s)", e, len(self._found))
            return
        now_ms = time.time_ns() // 1_000_000
        self._found = {n.node_id: n.endpoint.rstrip("/") for n in nodes
                       if n.endpoint and n.role != "store" and (not n.last_heartbeat_ms or
                                                               now_ms - n.last_heartbeat_ms <= self.ttl_s * 1000)}

    def urls(self) -> list[str]:
        """Every distinct base URL: the overrides first, then the announced ones (DP ranks of
        one engine share a URL)."""
        out = dict.fromkeys(self.overrides.values())
        out.update(dict.fromkeys(u for n, u in sorted(self._found.items()) if n not in self.overrides))
        return list(out)

    def found(self) -> dict[str, str]:
        """Node id → base URL of the live engines the view announced at the last read (no overrides)."""
        return dict(self._found)

    def __len__(self) -> int:
        return len(set(self.overrides) | set(self._found))


def decided_url(node: str, decision: RoutingDecision, overrides: Mapping[str, str]) -> str | None:
    """The base URL of ``node``, an instance ``decision`` names: its ``--engine`` override, else the
    endpoint its heartbeats announce (carried in the decision); None when neither is known."""
    url = overrides.get(node)
    if url is None:
        ep = decision.endpoints.get(node)
        if ep is None:
            return None
        url = ep.url
    return url.rstrip("/")
