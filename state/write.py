"""Fold records from the view's own stream state and write them: the one write path of the
stream worker, replays and :meth:`state.redis_view.RedisViewStore.apply`.

Each pass reads the stream state of the records' nodes from the store, folds the records in
order, and writes them with ``apply_groups``; every write is a compare-and-set on the state
it was folded from (``SetStream.prev``). If another writer moved a node's stream in between,
the store refuses that record and all after it (``CONFLICT``), and the next pass reads and
folds them again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from schemas import Envelope
from schemas.errors import ViewStoreError

from .fold import APPLIED, Folded, NodeStream, Op, UnfoldableRecord, fold
from .view import CONFLICT, MAX_REFOLDS, SourcePosition

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Written:
    flags: list[int]
    """Per record: ``APPLIED_GROUP`` or ``FENCED_GROUP`` (the view had its position already)."""
    folds: list[Folded | UnfoldableRecord | None]
    """Per record: how it folded; ``None`` for a record given without an envelope, and the
    error for one that cannot fold. Both were written as an empty group: their positions
    are dealt with, so the fence moves past them."""
    refolds: int = 0
    """Passes that found a node's stream moved by another writer."""


async def fold_and_write(store, records: Sequence[tuple[Envelope | None, SourcePosition | None]]) -> Written:
    """Fold and write ``records`` (envelope, source position) in order; see the module docstring.

    Raises ``ViewStoreError`` when streams keep moving for :data:`state.view.MAX_REFOLDS` passes.
    """
    out = Written([0] * len(records), [None] * len(records))
    todo = list(range(len(records)))
    for _ in range(MAX_REFOLDS):
        nodes = sorted({env.producer_id for i in todo if (env := records[i][0]) is not None})
        local: dict[str, NodeStream | None] = dict(await store.streams(nodes)) if nodes else {}
        groups: list[tuple[SourcePosition | None, Sequence[Op]]] = []
        for i in todo:
            env, pos = records[i]
            ops: Sequence[Op] = ()
            if env is not None:
                try:
                    f: Folded | UnfoldableRecord = fold(env, local.get(env.producer_id))
                except UnfoldableRecord as e:
                    f = e
                else:
                    if f.outcome == APPLIED:
                        local[env.producer_id] = f.stream
                        ops = f.ops
                out.folds[i] = f
            groups.append((pos, ops))
        flags = await store.apply_groups(groups) if groups else []
        redo: list[int] = []
        for k, (i, ok) in enumerate(zip(todo, flags)):
            if ok == CONFLICT:
                redo = todo[k:]
                out.refolds += 1
                log.warning(
                    "a node's stream state in the view moved under this batch (another writer?); folding %d records again",
                    len(redo),
                )
                break
            out.flags[i] = ok
        if not redo:
            return out
        todo = redo
    raise ViewStoreError(f"view stream state kept changing under {MAX_REFOLDS} attempts (another writer?)")
