"""The options of `tensorswap run create`, grouped by concern, and the RunSpec they make."""

from __future__ import annotations

from typing import Any

import click

from tensorswap.cli._util import SECONDS, option_group, parse_numbers, policy_params
from tensorswap.runs.errors import InvalidRunSpec
from tensorswap.runs.model import AUTO, MAX_PEERS_PER_ROUND, RunMode, RunSpec, Staleness

__all__ = ["ASYNC_OPTIONS", "DP_OPTIONS", "ROUND_OPTIONS", "SECAGG_OPTIONS", "run_spec"]


class _Timeout(click.ParamType):
    """``--round-timeout``: seconds > 0, or ``auto``."""

    name = "seconds|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        try:
            return SECONDS.convert(value, param, ctx)
        except click.BadParameter:
            self.fail(f"{value!r} is neither seconds > 0 nor 'auto'", param, ctx)


# What each round of the run samples and waits for, and when it stops.
ROUND_OPTIONS = option_group(
    click.option(
        "--initial",
        required=True,
        type=click.Path(exists=True, dir_okay=False),
        help="The initial global model: .npz, safetensors, .npy or a tensorswap block.",
    ),
    click.option(
        "--mode", type=click.Choice([m.value for m in RunMode]), default="sync", show_default=True
    ),
    click.option(
        "--per-round",
        type=click.IntRange(1, MAX_PEERS_PER_ROUND),
        help="Peers sampled per round (K).",
    ),
    click.option(
        "--fraction",
        type=click.FloatRange(0, 1, min_open=True),
        help="Or this fraction of the active peers.",
    ),
    click.option(
        "--min-clients",
        type=click.IntRange(1, MAX_PEERS_PER_ROUND),
        default=1,
        show_default=True,
        help="A round starts once this many peers are active (and samples at least this many).",
    ),
    click.option(
        "--quorum",
        type=click.FloatRange(0, 1, min_open=True),
        default=1.0,
        show_default=True,
        help="Fraction of the sampled peers a round needs at its deadline.",
    ),
    click.option(
        "--round-timeout",
        type=_Timeout(),
        help="Each round's deadline in seconds, or 'auto': from the arrivals of earlier rounds"
        " (default: none).",
    ),
    click.option(
        "--deadline-floor",
        type=SECONDS,
        default=1.0,
        show_default=True,
        help="Auto deadlines: never below this (seconds).",
    ),
    click.option(
        "--deadline-cap",
        type=SECONDS,
        default=600.0,
        show_default=True,
        help="Auto deadlines: never above this (seconds); the first round's deadline.",
    ),
    click.option(
        "--deadline-k",
        type=click.FloatRange(min=0),
        default=3.0,
        show_default=True,
        help="Auto deadlines: median + K x MAD of the quorum-th arrival.",
    ),
    click.option("--rounds", type=click.IntRange(min=1), help="Stop after this many versions."),
)

# The sampling seed, async-mode buffering and staleness, and the per-peer sample cap.
ASYNC_OPTIONS = option_group(
    click.option(
        "--seed",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Seeds the sampling of peers (with the round number).",
    ),
    click.option(
        "--buffer",
        type=click.IntRange(1, MAX_PEERS_PER_ROUND),
        default=4,
        show_default=True,
        help="Async: contributions per new version.",
    ),
    click.option(
        "--max-staleness",
        type=click.IntRange(min=0),
        default=8,
        show_default=True,
        help="Async: versions a contribution may lag behind.",
    ),
    click.option(
        "--staleness",
        type=click.Choice([s.value for s in Staleness]),
        default="sqrt",
        show_default=True,
        help="Async: how a stale delta is scaled.",
    ),
    click.option(
        "--max-samples-per-peer",
        type=click.IntRange(min=1),
        help="Refuse a contribution claiming more samples than this (its FedAvg weight, the "
        "peer's own word: TooManySamples); a region's fold may claim it once per peer it covers.",
    ),
)

# Differential privacy.
DP_OPTIONS = option_group(
    click.option(
        "--dp-clip",
        type=click.FloatRange(min=0, min_open=True),
        help="Differential privacy: clip each peer's update to this L2 norm (C); turns DP on.",
    ),
    click.option(
        "--dp-noise",
        type=click.FloatRange(min=0),
        default=0.0,
        show_default=True,
        help="DP: the noise multiplier z (noise std z x C / peers sampled).",
    ),
    click.option(
        "--dp-delta",
        type=click.FloatRange(0, 1, min_open=True, max_open=True),
        default=1e-5,
        show_default=True,
        help="DP: the delta epsilon is reported at.",
    ),
    click.option(
        "--dp-max-epsilon",
        type=click.FloatRange(min=0, min_open=True),
        help="DP: stop the run before a round would spend more than this epsilon.",
    ),
    click.option(
        "--dp-clipping",
        type=click.Choice(["server", "client"]),
        default="server",
        show_default=True,
        help="DP: who clips (client: the coordinator refuses an update above C).",
    ),
    click.option(
        "--dp-adaptive",
        is_flag=True,
        help="DP: adapt C to a quantile of the update norms (Andrew et al.).",
    ),
)

# Secure aggregation (SecAgg+).
SECAGG_OPTIONS = option_group(
    click.option(
        "--secagg",
        is_flag=True,
        help="Secure aggregation (SecAgg+): the coordinator learns only the sum of the deltas.",
    ),
    click.option(
        "--secagg-threshold",
        type=click.IntRange(min=2),
        help="SecAgg+: shares needed to unmask a peer (t; default: SecAgg+'s for the sample).",
    ),
    click.option(
        "--secagg-clip",
        type=click.FloatRange(min=0, min_open=True),
        help="SecAgg+: clip each delta coordinate to [-r, r] (default: --dp-clip, else 1.0).",
    ),
    click.option(
        "--secagg-bits",
        type=click.IntRange(1, 31),
        help="SecAgg+: bits per coordinate (default: the most the sample size allows).",
    ),
    click.option(
        "--secagg-phase-timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=30.0,
        show_default=True,
        help="SecAgg+: seconds each phase after the first waits for the peers (the masked-input "
        "phase, where peers train, lasts until --round-timeout at least; without one it waits for "
        "every peer).",
    ),
    click.option(
        "--secagg-min-survivors",
        type=click.IntRange(min=2),
        default=3,
        show_default=True,
        help="SecAgg+: the fewest peers a round's sum is unmasked over (and never fewer than the "
        "threshold); a round with fewer fails. 2 lets each survivor learn the other's delta.",
    ),
)


def run_spec(o: dict[str, Any]) -> RunSpec:
    """The RunSpec the options of ``run create`` (less the connection's) describe; an invalid
    one is a usage error."""
    try:
        return RunSpec(
            mode=RunMode(o["mode"]),
            per_round=o["per_round"],
            fraction=o["fraction"],
            min_clients=o["min_clients"],
            quorum=o["quorum"],
            round_timeout_s=o["round_timeout"],
            deadline_floor_s=o["deadline_floor"],
            deadline_cap_s=o["deadline_cap"],
            deadline_k=o["deadline_k"],
            strategy=o["strategy"],
            params=policy_params(o),
            optimizer=o["optimizer"],
            optimizer_params=parse_numbers(o["opts"]),
            seed=o["seed"],
            rounds=o["rounds"],
            buffer=o["buffer"],
            max_staleness=o["max_staleness"],
            staleness=Staleness(o["staleness"]),
            max_samples_per_peer=o["max_samples_per_peer"],
            dp_clip=o["dp_clip"],
            dp_noise=o["dp_noise"],
            dp_delta=o["dp_delta"],
            dp_max_epsilon=o["dp_max_epsilon"],
            dp_clipping=o["dp_clipping"],
            dp_adaptive=o["dp_adaptive"],
            secagg=o["secagg"],
            secagg_threshold=o["secagg_threshold"],
            secagg_clip=o["secagg_clip"],
            secagg_bits=o["secagg_bits"],
            secagg_phase_timeout_s=o["secagg_phase_timeout"],
            secagg_min_survivors=o["secagg_min_survivors"],
        )
    except InvalidRunSpec as exc:
        raise click.UsageError(str(exc)) from exc
