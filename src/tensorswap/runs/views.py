"""What a run's rows show to whom: a DP run's sample is secret from peers.

The accountant amplifies a DP run's ε by subsampling (each round's rate q = m/N), which
holds only while who was sampled stays secret. So in a run with ``dp_clip`` set, a peer is
shown counts (``selected_count``, ``participant_count``) and its own part (``you_selected``,
``you_took_part``: for the name its request gives), never another peer's name; rows say so
with ``hidden``. The operator (a connection that proved the server's operator key,
``tensorswap serve --operator-key-file``) is shown the names. Runs without DP show names
to every key holder, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorswap.rounds.core import RoundId
from tensorswap.runs.errors import RunNotFound
from tensorswap.runs.messages import RunRow, VersionRow
from tensorswap.runs.model import RunInfo, VersionRecord

if TYPE_CHECKING:
    from tensorswap.runs.manager import RunManager

__all__ = ["Viewer", "hides_sample", "row_of", "version_row"]


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who asks: the peer name its request gives, and whether it proved the operator key."""

    peer: str = ""
    operator: bool = False


OPERATOR = Viewer(operator=True)


def hides_sample(manager: RunManager, rid: RoundId) -> bool:
    """Whether coordinator round ``rid`` is a DP run's (its peers hidden from peers)."""
    try:
        info = manager.run(rid.initiator)
    except RunNotFound:
        return False
    return info.spec.dp_clip is not None


def _hidden(info: RunInfo, viewer: Viewer) -> bool:
    return info.spec.dp_clip is not None and not viewer.operator


def row_of(manager: RunManager, info: RunInfo, viewer: Viewer = OPERATOR) -> RunRow:
    """The run as ``viewer`` may see it."""
    versions = manager.journal.versions(info.name)
    last = versions[-1] if versions else None
    participants = list(last.participants) if last is not None else []
    selected = list(info.selected)
    hidden = _hidden(info, viewer)
    return RunRow(
        name=info.name,
        mode=info.spec.mode.value,
        version=info.version,
        global_cid=str(info.global_cid),
        state_cid=None if info.state_cid is None else str(info.state_cid),
        round=info.round,
        selected=[] if hidden else selected,
        finished=info.finished,
        optimizer=info.spec.optimizer,
        strategy=info.spec.strategy,
        participants=[] if hidden else participants,
        created_at=info.created_at,
        deadline_s=info.deadline_s,
        deadline_reason=info.deadline_reason,
        epsilon=manager.privacy.spent(info),
        dp_delta=info.spec.dp_delta if info.spec.dp_clip is not None else None,
        stop_reason=manager.privacy.stop_reason(info.name),
        secagg=info.spec.secagg,
        selected_count=len(selected),
        participant_count=len(participants),
        hidden=hidden,
        you_selected=(viewer.peer in selected) if hidden and viewer.peer else None,
        you_took_part=(viewer.peer in participants) if hidden and viewer.peer else None,
    )


def version_row(
    info: RunInfo, r: VersionRecord, epsilon: float | None, viewer: Viewer = OPERATOR
) -> VersionRow:
    """Version ``r`` of run ``info`` as ``viewer`` may see it."""
    hidden = _hidden(info, viewer)
    return VersionRow(
        r.version,
        str(r.global_cid),
        None if r.state_cid is None else str(r.state_cid),
        r.round,
        [] if hidden else list(r.participants),
        list(r.staleness),
        r.at,
        epsilon,
        participant_count=len(r.participants),
        hidden=hidden,
        you_took_part=(viewer.peer in r.participants) if hidden and viewer.peer else None,
    )
