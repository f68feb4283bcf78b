"""The run domain: a federation's spec (policies, optimizer, sampling) and its snapshots."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from types import MappingProxyType

from tensorswap.cid import Cid
from tensorswap.rounds.core import DETERMINISTIC, RoundId
from tensorswap.runs.dp_params import check_dp_options, check_secagg_options
from tensorswap.runs.errors import InvalidRunSpec

__all__ = [
    "AUTO",
    "MAX_DEADLINE_WINDOW",
    "MAX_PEERS_PER_ROUND",
    "MAX_RUN_NAME",
    "ClientInfo",
    "RunInfo",
    "RunMode",
    "RunSpec",
    "Staleness",
    "Task",
    "VersionRecord",
    "check_run_name",
]

AUTO = "auto"
"""``RunSpec.round_timeout_s`` for adaptive deadlines."""

MAX_RUN_NAME = 128
"""The longest run name (UTF-8 bytes); a run's rounds are ``RoundId(n, name)``."""


class RunMode(StrEnum):
    """``sync``: rounds with a barrier (sampled peers, a deadline, a quorum). ``async``:
    FedBuff, no barrier: every ``buffer`` contributions make a new version."""

    SYNC = "sync"
    ASYNC = "async"


class Staleness(StrEnum):
    """How an asynchronous contribution's delta is scaled by its staleness ``s`` (versions
    behind): ``constant`` 1, ``sqrt`` ``1 / sqrt(1 + s)`` (FedBuff's default), ``poly``
    ``(1 + s) ** -a`` with ``a`` = ``staleness_exponent``."""

    CONSTANT = "constant"
    SQRT = "sqrt"
    POLY = "poly"


MAX_PEERS_PER_ROUND = 1_000_000
"""The most peers a round may sample or wait for (``per_round``, ``min_clients``, an async
``buffer``): past it, SecAgg+ configurations and per-round tables stop being sane sizes."""

MAX_DEADLINE_WINDOW = 1000
"""The most earlier rounds an ``auto`` deadline is computed from (``deadline_window``)."""

MAX_SAMPLES_CLAIM = 1 << 53
"""The largest ``max_samples_per_peer`` (counts stay exact in a float64 weight)."""

Param = float | int | str


@dataclass(frozen=True, slots=True)
class RunSpec:
    """How a run goes: who trains each round, how rounds end, how the global model moves.

    Sampling (sync): ``per_round`` peers, or ``fraction`` of the active ones (at least
    ``min_clients``, at most all); a round starts only once ``min_clients`` are active.
    ``quorum`` is the fraction of the sampled peers a round needs when its deadline passes.
    ``round_timeout_s`` is each round's deadline in seconds (None: none), or ``"auto"``: each
    round's deadline is computed from the arrival times of the run's previous
    ``deadline_window`` rounds (the quorum-th arrival's median + ``deadline_k`` x its MAD),
    clamped to ``[deadline_floor_s, deadline_cap_s]``; with no history it is
    ``deadline_initial_s`` (None: the cap). See ``tensorswap.runs.deadlines``.
    ``strategy`` / ``params`` aggregate the contributions (see ``RoundSpec``);
    ``optimizer`` / ``optimizer_params`` turn the aggregate into the next global model
    (``tensorswap.aggregate.server_optimizer``).
    ``rounds`` stops the run after that many versions (None: never). Asynchronous runs use
    ``buffer``, ``max_staleness`` and ``staleness`` / ``staleness_exponent``.

    Differential privacy (sync runs; docs/privacy.md): ``dp_clip`` (the clipping norm C;
    None: no DP), ``dp_noise`` (the noise multiplier z), ``dp_delta``, ``dp_max_epsilon``,
    ``dp_clipping`` (``server`` or ``client``), ``dp_adaptive`` with
    ``dp_target_clipped_quantile``, ``dp_clip_norm_lr``, ``dp_clipped_count_stddev``.

    Secure aggregation (sync runs; docs/privacy-secagg.md): ``secagg`` (SecAgg+: the
    coordinator learns only the sum of the sampled peers' deltas), ``secagg_threshold`` (t;
    None: SecAgg+'s default for the round's size), ``secagg_clip`` (each coordinate of a
    delta is clipped to ``[-r, r]``; None: ``dp_clip`` in a DP run, else 1.0),
    ``secagg_bits`` (None: the most the sample size allows), ``secagg_max_weight`` (the
    largest num_samples; a DP run weighs every peer 1), ``secagg_phase_timeout_s`` (each
    phase after the first closes when all answered or after this long; the masked-input
    phase, where peers train, not before ``round_timeout_s``, and with none it waits for all),
    ``secagg_min_survivors`` (the floor: a round's sum is unmasked over at least this many
    peers, and the threshold t; fewer fail the round, so no sum exposes one peer's delta).

    ``max_samples_per_peer`` (None: any) refuses a contribution whose num_samples (its FedAvg
    weight, the peer's own claim) is above it (TooManySamples); a region's fold may claim it
    once per peer it covers. Sizes are bounded: ``per_round``, ``min_clients`` and ``buffer``
    by ``MAX_PEERS_PER_ROUND``, ``deadline_window`` by ``MAX_DEADLINE_WINDOW``.
    """

    mode: RunMode = RunMode.SYNC
    per_round: int | None = None
    fraction: float | None = None
    min_clients: int = 1
    quorum: float = 1.0
    round_timeout_s: float | str | None = None
    strategy: str = "fedavg"
    params: Mapping[str, Param] = field(default_factory=dict)
    optimizer: str = "fedavg"
    optimizer_params: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0
    rounds: int | None = None
    buffer: int = 4
    max_staleness: int = 8
    staleness: Staleness = Staleness.SQRT
    staleness_exponent: float = 0.5
    deadline_floor_s: float = 1.0
    deadline_cap_s: float = 600.0
    deadline_k: float = 3.0
    deadline_window: int = 5
    deadline_initial_s: float | None = None
    dp_clip: float | None = None
    dp_noise: float = 0.0
    dp_delta: float = 1e-5
    dp_max_epsilon: float | None = None
    dp_clipping: str = "server"
    dp_adaptive: bool = False
    dp_target_clipped_quantile: float = 0.5
    dp_clip_norm_lr: float = 0.2
    dp_clipped_count_stddev: float | None = None
    secagg: bool = False
    secagg_threshold: int | None = None
    secagg_clip: float | None = None
    secagg_bits: int | None = None
    secagg_max_weight: int = 1 << 16
    secagg_phase_timeout_s: float = 30.0
    secagg_min_survivors: int = 3  # privacy.secagg.protocol.DEFAULT_MIN_SURVIVORS
    max_samples_per_peer: int | None = None

    @property
    def deterministic(self) -> bool:
        """Whether each round folds in canonical order (``params`` ``"deterministic": 1``;
        ``run create --deterministic``): the global model's bits do not depend on arrival
        order, and regions relay each peer's contribution rather than fold them."""
        return self.params.get(DETERMINISTIC) == 1  # other values: refused at run create

    @property
    def auto_deadline(self) -> bool:
        """Whether each round's deadline is computed from earlier rounds' arrivals."""
        return self.round_timeout_s == AUTO

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", RunMode(self.mode))
            object.__setattr__(self, "staleness", Staleness(self.staleness))
        except ValueError as exc:
            raise InvalidRunSpec(str(exc)) from None
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "optimizer_params", MappingProxyType(dict(self.optimizer_params)))
        if self.per_round is not None and self.fraction is not None:
            raise InvalidRunSpec("give per_round or fraction, not both")
        _positive_int("min_clients", self.min_clients, MAX_PEERS_PER_ROUND)
        _positive_int("buffer", self.buffer, MAX_PEERS_PER_ROUND)
        if self.per_round is not None:
            _positive_int("per_round", self.per_round, MAX_PEERS_PER_ROUND)
            if self.per_round < self.min_clients:
                raise InvalidRunSpec(
                    f"per_round ({self.per_round}) is below min_clients ({self.min_clients})"
                )
        if self.fraction is not None and not (0 < self.fraction <= 1):
            raise InvalidRunSpec(f"fraction must be in (0, 1], got {self.fraction!r}")
        if not (0 < self.quorum <= 1):
            raise InvalidRunSpec(f"quorum must be a fraction in (0, 1], got {self.quorum!r}")
        timeout = self.round_timeout_s
        if isinstance(timeout, str):
            if timeout != AUTO:
                raise InvalidRunSpec(f"round_timeout_s is seconds or 'auto', got {timeout!r}")
        elif timeout is not None and not (_number(timeout) and timeout > 0):
            raise InvalidRunSpec(f"round_timeout_s must be > 0, got {timeout!r}")
        self._check_deadline_policy()
        if self.rounds is not None:
            _positive_int("rounds", self.rounds)
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int):
            raise InvalidRunSpec(f"max_staleness must be an int, got {self.max_staleness!r}")
        if self.max_staleness < 0:
            raise InvalidRunSpec(f"max_staleness must be >= 0, got {self.max_staleness}")
        if not (math.isfinite(self.staleness_exponent) and self.staleness_exponent >= 0):
            raise InvalidRunSpec(f"staleness_exponent must be >= 0, got {self.staleness_exponent}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidRunSpec(f"seed must be an int >= 0, got {self.seed!r}")
        if self.max_samples_per_peer is not None:
            _positive_int("max_samples_per_peer", self.max_samples_per_peer, MAX_SAMPLES_CLAIM)
            if self.secagg:
                raise InvalidRunSpec(
                    "a secure run's weights travel masked: bound them with secagg_max_weight, "
                    "not max_samples_per_peer"
                )
        check_dp_options(self)
        check_secagg_options(self)

    def _check_deadline_policy(self) -> None:
        floor, cap, k = self.deadline_floor_s, self.deadline_cap_s, self.deadline_k
        if not (_number(floor) and _number(cap) and 0 < floor <= cap):
            raise InvalidRunSpec(
                f"need 0 < deadline_floor_s <= deadline_cap_s, got {floor!r} and {cap!r}"
            )
        if not (_number(k) and k >= 0):
            raise InvalidRunSpec(f"deadline_k must be >= 0, got {k!r}")
        _positive_int("deadline_window", self.deadline_window, MAX_DEADLINE_WINDOW)
        initial = self.deadline_initial_s
        if initial is not None and not (_number(initial) and initial > 0):
            raise InvalidRunSpec(f"deadline_initial_s must be > 0, got {initial!r}")

    def sample_size(self, active: int) -> int:
        """How many peers a round samples when ``active`` peers are active (sync runs)."""
        if self.per_round is not None:
            want = self.per_round
        elif self.fraction is not None:
            want = math.ceil(self.fraction * active)
        else:
            want = active
        return min(active, max(want, self.min_clients))

    def quorum_of(self, sampled: int) -> int:
        """Contributions a round of ``sampled`` peers needs at its deadline."""
        return max(1, min(sampled, math.ceil(self.quorum * sampled - 1e-9)))

    def scale_for(self, staleness: int) -> float:
        """The factor an asynchronous delta ``staleness`` versions behind is scaled by."""
        if self.staleness is Staleness.CONSTANT:
            return 1.0
        if self.staleness is Staleness.SQRT:
            return 1.0 / math.sqrt(1.0 + staleness)
        return float((1.0 + staleness) ** -self.staleness_exponent)

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["params"], data["optimizer_params"] = dict(self.params), dict(self.optimizer_params)
        data["mode"], data["staleness"] = self.mode.value, self.staleness.value
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise InvalidRunSpec(f"a run spec is a JSON object, got {type(data).__name__}")
        if data.get("secagg") is True and "secagg_min_survivors" not in data:
            # journaled before the floor existed: the floor its min_clients can serve, so the
            # run goes on (a 2-peer run stays one, as it was created)
            clients = data.get("min_clients", 1)
            data["secagg_min_survivors"] = min(3, clients) if isinstance(clients, int) else 3
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidRunSpec(f"run spec: {exc}") from None


def _number(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(name: str, value: object, most: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRunSpec(f"{name} must be an int >= 1, got {value!r}")
    if most is not None and value > most:
        raise InvalidRunSpec(f"{name} must be at most {most}, got {value}")


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """One step of the global model: version ``version`` is ``global_cid`` (with the
    optimizer's state ``state_cid``), made from round ``round``'s aggregate of
    ``participants``; ``staleness`` per participant in asynchronous runs."""

    version: int
    global_cid: Cid
    state_cid: Cid | None
    round: int
    participants: tuple[str, ...] = ()
    staleness: tuple[int, ...] = ()
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class RunInfo:
    """A snapshot of a run: its spec, the current version, the round in flight."""

    name: str
    spec: RunSpec
    version: int
    global_cid: Cid
    state_cid: Cid | None
    round: int
    """The newest round started (0: none yet)."""
    selected: tuple[str, ...]
    """The peers sampled for that round (sync runs)."""
    finished: bool
    created_at: float
    deadline_s: float | None = None
    """The deadline chosen for round ``round`` of an ``auto`` run (seconds; None otherwise)."""
    deadline_reason: str = ""
    """Why that deadline (one line, as logged)."""


@dataclass(frozen=True, slots=True)
class ClientInfo:
    """A registered peer: its facts (``num_samples``, tags, ...) and when it was last seen."""

    name: str
    facts: Mapping[str, Param]
    registered_at: float
    last_seen: float


@dataclass(frozen=True, slots=True)
class Task:
    """What a peer is asked to do: train from ``global_cid`` (version ``version``) and submit
    to ``round_id``; in an asynchronous run, submit the delta tagged with ``version``."""

    run: str
    round_id: RoundId
    version: int
    global_cid: Cid
    mode: RunMode
    dp: str = ""
    """A DP run's clipping side (``server`` or ``client``): submit the delta; "" otherwise."""
    clip: float | None = None
    """A DP run's clipping norm for this round (client-side clipping: clip to it)."""
    secagg: bool = False
    """A secure run: submit runs SecAgg+ with the coordinator (the delta, masked)."""


def check_run_name(name: str) -> None:
    """InvalidRunSpec unless ``name`` can name a run (and its rounds ``RoundId(n, name)``)."""
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_RUN_NAME:
        raise InvalidRunSpec(f"a run name is 1..{MAX_RUN_NAME} bytes, got {name!r:.80}")
    try:
        RoundId(1, name)
    except ValueError as exc:
        raise InvalidRunSpec(f"run name {name!r}: {exc}") from None
