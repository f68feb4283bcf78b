"""The rounds journal's rows: column values, and the writes that journal contributions."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tensorswap.errors import RoundsError
from tensorswap.rounds.core.state import (
    Aggregating,
    Collecting,
    Complete,
    Contribution,
    Failed,
    LayerSpec,
    Layout,
    Pending,
    RoundId,
    RoundStatus,
)
from tensorswap.rounds.journal._group import Write
from tensorswap.rounds.journal.wal import Tx

__all__ = [
    "ContributionRow",
    "contributions_write",
    "layout_json",
    "parse_layout",
    "parse_status",
    "round_number",
    "status_columns",
]

ContributionRow = tuple[Contribution, RoundStatus, Layout | None, int]
"""A contribution to journal, the round's status with it counted, the round's first layout,
and its place in fold order (``seq``: reserved places in order, never reused by a process)."""

_INSERT = (
    "INSERT INTO contributions (round, initiator, peer, seq, update_cid,"
    " num_samples, nbytes, submitted_at, scale) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_STATUS = (
    "UPDATE rounds SET status = ?, result_cid = ?, reason = ?"
    " WHERE round = ? AND initiator = ? AND status IN (?, ?)"
)
_LAYOUT = "UPDATE rounds SET layout = ? WHERE round = ? AND initiator = ?"


def contributions_write(items: Sequence[ContributionRow]) -> Write:
    """One write journaling every item, in order: their rows in one ``executemany``, then
    per round the status of its last item and any first layout. The same rows and the same
    final columns as one write per item, each moving the status in turn (the status only
    moves while the round is Pending or Collecting, so the last one is what stays)."""
    rows = []
    last: dict[tuple[int, str], RoundStatus] = {}
    layouts: list[tuple[str | None, int, str]] = []
    for contribution, status, layout, seq in items:
        rid = contribution.round_id
        key = (round_number(rid), rid.initiator)
        rows.append(
            (
                *key,
                contribution.peer,
                seq,
                contribution.update_cid,
                contribution.num_samples,
                contribution.nbytes,
                contribution.submitted_at,
                contribution.scale,
            )
        )
        last[key] = status
        if layout is not None:
            layouts.append((layout_json(layout), *key))

    def write(db: Tx) -> None:
        if len(rows) == 1:
            db.execute(_INSERT, rows[0])
        else:
            db.executemany(_INSERT, rows)
        for key, status in last.items():
            db.execute(_STATUS, (*status_columns(status), *key, Pending.name, Collecting.name))
        for layout_row in layouts:
            db.execute(_LAYOUT, layout_row)

    return write


def round_number(rid: RoundId) -> int:
    if rid.round > 2**63 - 1:
        raise RoundsError(f"round number {rid.round} does not fit the round database")
    return rid.round


def status_columns(status: RoundStatus) -> tuple[str, str | None, str | None]:
    if isinstance(status, Complete):
        return status.name, status.cid, None
    if isinstance(status, Failed):
        return status.name, None, status.reason
    return status.name, None, None


def parse_status(
    name: str, cid: str | None, reason: str | None, received: int, expected: int
) -> RoundStatus:
    if name == Pending.name:
        return Pending()
    if name == Collecting.name:
        return Collecting(received, expected)
    if name == Aggregating.name:
        return Aggregating()
    if name == Complete.name and cid is not None:
        return Complete(cid)
    if name == Failed.name and reason is not None:
        return Failed(reason)
    raise RoundsError(f"round database holds an unknown status {name!r}")


def layout_json(layout: Layout | None) -> str | None:
    return None if layout is None else json.dumps([layer.to_list() for layer in layout])


def parse_layout(text: str | None) -> Layout | None:
    if text is None:
        return None
    return tuple(LayerSpec.from_list(item) for item in json.loads(text))
