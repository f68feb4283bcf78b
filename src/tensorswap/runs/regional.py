"""Regions at the top of a run: the sampled peers a regional coordinator folds stand at the
top as one unit, the region, which contributes their partial aggregate once per round.

A regional coordinator (``tensorswap serve --upstream``) relays its peers' registrations
with the fact ``region = <its name upstream>``. The top samples peers as it always does (by
name, from ``(seed, round)``: the same sample as flat). In a run whose rounds compose under
regional folding (``folds``: sync, plain FedAvg, no DP, not secure), the round's coordinator
round then expects one contribution per *unit*: each sampled peer not behind a region, and
each region that has sampled peers (its covered peers). The region asks for its part of the
round (``PartRequest``), folds its covered peers' updates, and submits the fold under its
own name, weighted by their summed num_samples; so the top's FedAvg gives the flat result.
Runs that do not fold (async, DP, secure, robust strategies) keep every peer its own unit.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tensorswap.rounds.core import DETERMINISTIC, RoundId
from tensorswap.runs.messages import PartWire
from tensorswap.runs.model import RunInfo, RunMode, RunSpec
from tensorswap.runs.registry import ClientRegistry

if TYPE_CHECKING:
    from tensorswap.rounds.engine import Coordinator

__all__ = ["REGION_FACT", "RunUnits", "folds", "part_for"]

REGION_FACT = "region"
"""The registration fact a regional coordinator sets on the peers it relays."""


def folds(spec: RunSpec) -> bool:
    """Whether a run's rounds are folded per region: a sync run aggregating with plain
    FedAvg (no options; ``deterministic`` 0 is none), without DP or secure aggregation.
    FedAvg of regional FedAvgs weighted by summed num_samples is the flat FedAvg; nothing
    else composes that way (a deterministic run is relayed: its bits are name-ordered)."""
    options = {k: v for k, v in spec.params.items() if not (k == DETERMINISTIC and v == 0)}
    return (
        spec.mode is RunMode.SYNC
        and spec.strategy == "fedavg"
        and not options
        and spec.dp_clip is None
        and not spec.secagg
    )


class RunUnits:
    """Each run round's units (who contributes to its coordinator round), computed once per
    round from the sample and the registry's ``region`` facts, then kept for the round (a
    re-registration mid-round does not move a peer). Recomputed after a restart from the
    journaled sample and registrations. Thread-safe."""

    def __init__(self, registry: ClientRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[int, dict[str, tuple[str, ...]], dict[str, str]]] = {}

    def of(self, info: RunInfo) -> Mapping[str, tuple[str, ...]]:
        """The round ``info.round``'s units: unit name -> the sampled peers it covers."""
        return self._entry(info)[1]

    def unit(self, info: RunInfo, peer: str) -> str:
        """The unit that contributes for ``peer`` in round ``info.round`` (itself if none)."""
        return self._entry(info)[2].get(peer, peer)

    def _entry(self, info: RunInfo) -> tuple[int, dict[str, tuple[str, ...]], dict[str, str]]:
        with self._lock:
            cached = self._cache.get(info.name)
            if cached is not None and cached[0] == info.round:
                return cached
        groups: dict[str, list[str]] = {}
        unit_of: dict[str, str] = {}
        fold = folds(info.spec)
        for peer in info.selected:
            client = self._registry.get(peer) if fold else None
            region = client.facts.get(REGION_FACT) if client is not None else None
            unit = region if isinstance(region, str) and region else peer
            groups.setdefault(unit, []).append(peer)
            unit_of[peer] = unit
        entry = (info.round, {u: tuple(sorted(p)) for u, p in groups.items()}, unit_of)
        with self._lock:
            self._cache[info.name] = entry
        return entry

    def sample_cap(self, info: RunInfo, peer: str, limit: int | None) -> int | None:
        """The most samples ``peer``'s contribution to round ``info.round`` may claim: the
        tighter of ``limit`` (the coordinator's) and the run's ``max_samples_per_peer``, times
        the sampled peers its unit stands for (a region's fold claims their sum); None: any."""
        caps = [c for c in (limit, info.spec.max_samples_per_peer) if c is not None]
        if not caps:
            return None
        covers = len(self.of(info).get(peer, ())) if info.spec.mode is RunMode.SYNC else 1
        return min(caps) * max(covers, 1)


def part_for(units: RunUnits, coordinator: Coordinator, info: RunInfo, region: str) -> PartWire:
    """What ``region`` folds in run ``info``'s current round (on ``coordinator``, its units
    ``units``): the sampled peers registered through it, the quorum it needs of them and
    the seconds left to the top's deadline."""
    run = info.name
    fold = folds(info.spec) and not info.finished and info.round > 0
    covers = list(units.of(info).get(region, ())) if fold else []
    left: float | None = None
    round_info = coordinator.info(RoundId(info.round, run)) if covers else None
    if round_info is not None and round_info.deadline is not None:
        left = max(0.0, round_info.deadline - coordinator.clock.now())
    open_ = round_info is not None and not round_info.status.is_terminal
    return PartWire(
        run=run,
        round=info.round,
        version=info.version,
        global_cid=str(info.global_cid),
        fold=fold and open_ and region not in (round_info.peers if round_info else ()),
        covers=covers,
        quorum=info.spec.quorum_of(len(covers)) if covers else 0,
        left_s=left,
    )
