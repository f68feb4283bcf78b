"""RunPrivacy: DP-FedAvg on a run's rounds (what the run manager calls at its few DP points:
a round's start, a peer's submit, a round's step)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tensorswap.cid import Cid
from tensorswap.privacy.accountant import epsilon
from tensorswap.privacy.dp import (
    adaptive_noise,
    clip_factor,
    next_clip,
    noise_std,
    secure_generator,
    update_norm,
)
from tensorswap.privacy.errors import ClipBoundExceeded, PrivacyBudgetExhausted
from tensorswap.rounds.core import Contribution
from tensorswap.rounds.engine import inspect_update, load_pieces
from tensorswap.runs.dp_ledger import PrivacyLedger, PrivacyRound, PrivacyStep
from tensorswap.runs.dp_params import MAX_DP_CLIP, default_count_stddev
from tensorswap.runs.errors import FutureVersion, NotSelected, RunsError, StaleContribution
from tensorswap.runs.finite import FiniteGuard
from tensorswap.runs.stream import stream_noised
from tensorswap.store import BlockStore

if TYPE_CHECKING:  # runs.model imports runs.dp_params: no runs.model import at import time
    from tensorswap.runs.journal import RunDatabase
    from tensorswap.runs.model import RunInfo, RunSpec

__all__ = ["CLIP_TOLERANCE", "RunPrivacy"]

log = logging.getLogger(__name__)

CLIP_TOLERANCE = 1e-5
"""Relative slack on a client-clipped update's norm: a peer's float32 clip may land an ulp or
two above the bound."""


def is_private(spec: RunSpec) -> bool:
    return spec.dp_clip is not None


class RunPrivacy:
    """The DP side of every run of a manager (runs without ``dp_clip`` pass through).

    Guarantees: a round's clipping norm and sampling rate are journaled before it starts; a
    round whose ε would exceed ``dp_max_epsilon`` is never started (the run finishes with
    the reason); each released round's noised aggregate is stored and journaled (with ε)
    before the optimizer uses it, so a step redone after a restart reuses that very noise.
    """

    def __init__(self, journal: RunDatabase) -> None:
        self.ledger = PrivacyLedger(journal)
        self._lock = threading.Lock()
        self._rounds: dict[tuple[str, int], PrivacyRound] = {}

    # ── a round starts ───────────────────────────────────────────────────────
    def before_round(self, info: RunInfo, round: int, sampled: int, population: int) -> None:
        """Journal round ``round``'s rate and clipping norm; PrivacyBudgetExhausted (after
        finishing the run in the journal) if releasing it would take ε past the limit."""
        spec = info.spec
        if not is_private(spec):
            return
        steps = self.ledger.steps(info.name)
        entry = PrivacyRound(round, sampled, max(population, sampled, 1), self._clip(spec, steps))
        if spec.dp_max_epsilon is not None:
            spent = steps[-1].epsilon if steps else 0.0
            rates = [s.rate for s in steps] + [entry.rate]
            upcoming = epsilon(spec.dp_noise, rates, spec.dp_delta)
            if upcoming > spec.dp_max_epsilon:
                exc = PrivacyBudgetExhausted(info.name, round, spent, upcoming, spec.dp_max_epsilon)
                self.ledger.stop(info.name, str(exc))
                raise exc
        self.ledger.start_round(info.name, entry)
        with self._lock:
            self._rounds[(info.name, round)] = entry

    def clip_for(self, info: RunInfo, round: int) -> float | None:
        """The clipping norm of round ``round`` (None for a run without DP)."""
        if not is_private(info.spec):
            return None
        return self._round(info.name, round).clip

    # ── a peer submits ───────────────────────────────────────────────────────
    def admit(
        self,
        store: BlockStore,
        info: RunInfo,
        round: int,
        peer: str,
        update: Cid,
        trained_on: int | None,
        clipped: bool | None,
    ) -> float:
        """Check a DP contribution (a delta from version ``trained_on``, the current one) and
        the scale the coordinator folds it with: ``min(1, C / norm)`` with server-side
        clipping; 1 with client-side clipping, after refusing a norm above C
        (ClipBoundExceeded). Journals the norm and the clip bit."""
        if round != info.round or peer not in info.selected:
            raise NotSelected(info.name, round, peer, len(info.selected))
        if trained_on is None:
            raise ValueError(
                f"run {info.name!r} is differentially private: submit the delta from the task's "
                f"model with trained_on=<version> (RunClient.submit does)"
            )
        if trained_on > info.version:
            raise FutureVersion(info.name, peer, trained_on, info.version)
        if trained_on != info.version:
            raise StaleContribution(info.name, peer, trained_on, info.version, 0)
        clip = self._round(info.name, round).clip
        facts = inspect_update(store, update, f"{info.name}@{round}", peer, verify=True)
        pieces, _, _ = load_pieces(store, facts, None)  # chunk views, re-hashed: no copies
        norm = update_norm(pieces)
        if info.spec.dp_clipping == "client":
            if math.isfinite(norm) and norm > clip * (1 + CLIP_TOLERANCE):
                raise ClipBoundExceeded(info.name, round, peer, norm, clip)
            scale, bit = 1.0, bool(clipped)
        else:
            scale = clip_factor(norm, clip)
            bit = scale < 1.0
        self.ledger.note_contribution(info.name, round, peer, str(update), norm, bit)
        return scale

    # ── a round is released ──────────────────────────────────────────────────
    def noised_aggregate(
        self,
        store: BlockStore,
        info: RunInfo,
        aggregate: Cid,
        contributions: Sequence[Contribution],
    ) -> Cid:
        """The round's noised mean delta: recorded already (a redone step), or drawn now:
        ``sum of clipped deltas / sampled + N(0, (z C / sampled)**2)`` (the fixed denominator of
        DP-FedAvg: a dropped peer lowers the sum, never the sensitivity), stored and journaled
        with the next clipping norm and ε before it is returned. Each noised chunk is checked
        before it is stored: NaN or Inf raises NonFiniteStep (stage ``DP release``) and
        nothing is released or journaled (no ε spent)."""
        spec, name = info.spec, info.name
        steps = self.ledger.steps(name)
        for step in steps:
            if step.round == info.round:
                return Cid.parse(step.noised_cid)
        entry = self._round(name, info.round)
        m, kept = entry.sampled, len(contributions)
        rng = secure_generator()
        bits = self.ledger.clip_bits(name, info.round)
        clipped = sum(bits.get((c.peer, c.update_cid), False) for c in contributions)
        z, count_std = spec.dp_noise, 0.0
        if spec.dp_adaptive:
            given = spec.dp_clipped_count_stddev
            if given is None:  # Flower's default: m / 20 with noise, none without
                count_std = default_count_stddev(m) if spec.dp_noise > 0 else 0.0
            else:
                count_std = float(given)
            z = adaptive_noise(spec.dp_noise, count_std)
        std = noise_std(z, entry.clip, m)
        meta = {"run": name, "round": str(info.round), "dp": "noised mean delta"}
        # chunk by chunk, a few chunks in memory: sum of clipped deltas / m, plus the noise
        guard = FiniteGuard.of(info, contributions)
        cid = stream_noised(
            store,
            aggregate,
            kept / m,
            std,
            rng,
            metadata=meta,
            name=f"{name}@{info.round}/dp",
            guard=guard,
        )
        noised_clipped, upcoming = float(clipped), entry.clip
        if spec.dp_adaptive:
            noised_clipped = float(rng.normal(clipped, count_std)) if count_std > 0 else clipped
            upcoming = next_clip(
                entry.clip,
                noised_clipped / max(kept, 1),
                spec.dp_target_clipped_quantile,
                spec.dp_clip_norm_lr,
                MAX_DP_CLIP,
            )
        rates = [s.rate for s in steps] + [entry.rate]
        eps = epsilon(spec.dp_noise, rates, spec.dp_delta)
        step = PrivacyStep(
            info.round,
            str(cid),
            entry.clip,
            std,
            kept,
            clipped,
            noised_clipped,
            upcoming,
            entry.rate,
            eps,
        )
        self.ledger.add_step(name, step)
        log.info(
            "run %s: round %d released with noise std %.4g (clip %.4g), epsilon %.4g at delta %g",
            name,
            info.round,
            std,
            entry.clip,
            eps,
            spec.dp_delta,
        )
        return cid

    # ── reading ──────────────────────────────────────────────────────────────
    def steps(self, name: str) -> list[PrivacyStep]:
        """Every released round of the run, with ε after it."""
        return self.ledger.steps(name)

    def spent(self, info: RunInfo) -> float | None:
        """The run's ε so far (None for a run without DP)."""
        if not is_private(info.spec):
            return None
        steps = self.ledger.steps(info.name)
        return steps[-1].epsilon if steps else 0.0

    def stop_reason(self, name: str) -> str:
        return self.ledger.stop_reason(name)

    def _clip(self, spec: RunSpec, steps: list[PrivacyStep]) -> float:
        assert spec.dp_clip is not None
        return steps[-1].next_clip if steps else float(spec.dp_clip)

    def _round(self, name: str, round: int) -> PrivacyRound:
        with self._lock:
            entry = self._rounds.get((name, round))
        if entry is None:
            entry = self.ledger.round(name, round)
            if entry is None:
                raise RunsError(f"run {name!r}: round {round} has no privacy record")
            with self._lock:
                self._rounds[(name, round)] = entry
        return entry
