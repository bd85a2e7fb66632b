"""Fold records from the view's own stream state and write them: the one write path of both
stores (``apply`` and the in-memory ``apply_sync``), the stream worker and replays.

Each pass reads the stream state of the records' nodes from the store, folds the records in
order, and writes them with ``apply_groups``; every write is a compare-and-set on the state
it was folded from (``SetStream.prev``). If another writer moved a node's stream in between,
the store refuses that record and all after it (``Outcome.CONFLICT``), and the next pass
reads and folds them again.

The passes are written once, as a generator that asks for the store's two calls
(``streams``, ``apply_groups``) and is handed their answers; :func:`fold_and_write` drives
it against an async store, :func:`fold_and_write_sync` against the in-memory store's sync
calls (the simulator's loop has no event loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from schemas import Envelope
from schemas.errors import ViewRefused, ViewStoreError

from .fold import Folded, NodeStream, Op, UnfoldableRecord, fold
from .view import MAX_REFOLDS, Outcome, SourcePosition

log = logging.getLogger(__name__)

Record = tuple[Envelope | None, SourcePosition | None]
Group = tuple[SourcePosition | None, Sequence[Op]]


@dataclass(slots=True)
class Written:
    flags: list[Outcome]
    """Per record: ``APPLIED`` or ``FENCED`` (the view had its position already): what the
    store did with its group."""
    folds: list[Folded | UnfoldableRecord | None]
    """Per record: how it folded; ``None`` for a record given without an envelope, and the
    error for one that cannot fold. Both were written as an empty group: their positions
    are dealt with, so the fence moves past them."""
    refolds: int = 0
    """Passes that found a node's stream moved by another writer."""

    def outcomes(self) -> list[Outcome]:
        """Per record: ``FENCED`` when the store skipped it, else how it folded (what
        ``ViewStore.apply`` returns). Raises the :class:`UnfoldableRecord` of a record that
        cannot fold."""
        out = []
        for flag, f in zip(self.flags, self.folds):
            if isinstance(f, UnfoldableRecord):
                raise f
            out.append(f.outcome if flag == Outcome.APPLIED and f is not None else Outcome.FENCED)
        return out


# What the passes ask of the store: ("streams", node ids) or ("write", groups).
_Ask = tuple[str, Any]


def _passes(records: Sequence[Record]) -> Generator[_Ask, Any, Written]:
    out = Written([Outcome.FENCED] * len(records), [None] * len(records))
    todo = list(range(len(records)))
    for _ in range(MAX_REFOLDS):
        nodes = sorted({env.producer_id for i in todo if (env := records[i][0]) is not None})
        local: dict[str, NodeStream | None] = dict((yield ("streams", nodes))) if nodes else {}
        groups: list[Group] = []
        for i in todo:
            env, pos = records[i]
            ops: Sequence[Op] = ()
            if env is not None:
                try:
                    f = fold(env, local.get(env.producer_id))
                except UnfoldableRecord as e:
                    out.folds[i] = e
                else:
                    if f.outcome == Outcome.APPLIED:
                        local[env.producer_id] = f.stream
                        ops = f.ops
                    out.folds[i] = f
            groups.append((pos, ops))
        flags = (yield ("write", groups)) if groups else []
        redo: list[int] = []
        for k, (i, flag) in enumerate(zip(todo, flags)):
            if flag in (Outcome.HOLE, Outcome.LOST):
                pos = records[i][1]
                where = f" at {pos.key}@{pos.offset} (continuing from {pos.after})" if pos is not None else ""
                raise ViewRefused(flag.value, f"the view refused the write{where}: " + (
                    "its generation changed (lost or replaced)" if flag == Outcome.LOST
                    else "its fence is not the one the record continues from"))
            if flag == Outcome.CONFLICT:
                redo = todo[k:]
                out.refolds += 1
                log.warning(
                    "a node's stream state in the view moved under this batch (another writer?); folding %d records again",
                    len(redo),
                )
                break
            out.flags[i] = flag
        if not redo:
            return out
        todo = redo
    raise ViewStoreError(f"view stream state kept changing under {MAX_REFOLDS} attempts (another writer?)")


async def fold_and_write(store: Any, records: Sequence[Record]) -> Written:
    """Fold and write ``records`` (envelope, source position) in order through ``store``'s
    async ``streams`` and ``apply_groups``; see the module docstring.

    Raises ``ViewStoreError`` when streams keep moving for :data:`state.view.MAX_REFOLDS` passes.
    """
    steps = _passes(records)
    answer: Any = None
    try:
        while True:
            what, arg = steps.send(answer)
            answer = await (store.streams(arg) if what == "streams" else store.apply_groups(arg))
    except StopIteration as done:
        written: Written = done.value
        return written


def fold_and_write_sync(
    streams: Callable[[Sequence[str]], dict[str, NodeStream]],
    apply_groups: Callable[[Sequence[Group]], list[Outcome]],
    records: Sequence[Record],
) -> Written:
    """:func:`fold_and_write` over synchronous ``streams`` and ``apply_groups`` calls."""
    steps = _passes(records)
    answer: Any = None
    try:
        while True:
            what, arg = steps.send(answer)
            answer = streams(arg) if what == "streams" else apply_groups(arg)
    except StopIteration as done:
        written: Written = done.value
        return written
