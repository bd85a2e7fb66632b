"""What the gateway learns from an engine's SSE stream while it forwards the bytes as they came.

Pure (no I/O): :class:`SseScan` is fed the decode's raw chunks and gives back the bytes to send
on — whole events, unchanged — and how many tokens they carry (for the first token's time and
the gaps between tokens). Only the usage chunk, once per stream, is parsed as JSON: for the
outcome's output (and, aggregated, cached) tokens, and to drop it when the gateway asked the
engine for usage and the client did not. Everything else is two byte searches per chunk (the
last event boundary, the usage key) and one regex count of non-empty ``text``/``content``
fields; an earlier relay split every chunk into events and ran a regex over each.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_USAGE = re.compile(rb'"usage":\s*\{')
_TOKEN = re.compile(rb'"(?:text|content)":\s*"(?!")')
"""A non-empty ``text`` (completions) or ``delta.content`` (chat) in an SSE chunk's JSON."""


class EventTooLong(Exception):
    """An SSE event grew past the bound without ending."""


class SseScan:
    """One decode stream's scan. :meth:`feed` each raw chunk; forward what it returns."""

    def __init__(self, *, drop_usage: bool, max_event_bytes: int) -> None:
        self.drop_usage = drop_usage
        """The client did not ask for usage (the gateway did): its usage-only chunk is not forwarded."""
        self.max_event_bytes = max_event_bytes
        self.held = b""
        """The start of an event whose end has not come yet (held back so that events leave whole)."""
        self.usage: dict[str, Any] | None = None
        """The usage chunk's JSON object, once it came."""

    def feed(self, raw: bytes) -> tuple[bytes, int]:
        """The whole events ``raw`` completes (to forward now) and how many of them carry a token.
        :class:`EventTooLong` when an unfinished event exceeds the bound."""
        data = self.held + raw if self.held else raw
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.held = data
            self._check()
            return b"", 0
        cut += 2
        whole, self.held = (data, b"") if cut == len(data) else (data[:cut], data[cut:])
        self._check()
        if _USAGE.search(whole) is None:
            return whole, len(_TOKEN.findall(whole))
        return self._with_usage(whole)

    def _check(self) -> None:
        if len(self.held) > self.max_event_bytes:
            raise EventTooLong(f"an SSE event of the decode stream is longer than {self.max_event_bytes} bytes "
                               "(it never ends?)")

    def _with_usage(self, whole: bytes) -> tuple[bytes, int]:
        """The slow path, once per stream: events one by one, the usage one parsed (and maybe dropped)."""
        out: list[bytes] = []
        tokens = 0
        for ev in whole.split(b"\n\n")[:-1]:
            if ev.startswith(b"data: {") and _USAGE.search(ev):
                try:
                    obj = orjson.loads(ev[6:])
                except ValueError:
                    obj = None
                if isinstance(obj, dict):
                    self.usage = obj
                    if not obj.get("choices") and self.drop_usage:
                        continue
                    tokens += _has_token(obj)
            elif _TOKEN.search(ev):
                tokens += 1
            out.append(ev + b"\n\n")
        return b"".join(out), tokens


def _has_token(obj: dict[str, Any]) -> bool:
    for c in obj.get("choices") or ():
        if not isinstance(c, dict):
            continue
        delta = c.get("delta")
        if c.get("text") or (isinstance(delta, dict) and delta.get("content")):
            return True
    return False
