"""The differential-privacy options of a run spec, checked (no other privacy imports here:
``runs.model`` calls this while it is being imported)."""

from __future__ import annotations

import math
from typing import Any

from tensorswap.rounds.core import DETERMINISTIC
from tensorswap.runs.errors import InvalidRunSpec

__all__ = [
    "CLIPPING_MODES",
    "DP_STRATEGIES",
    "MAX_DP_CLIP",
    "MAX_DP_CLIP_NORM_LR",
    "MAX_DP_COUNT_STDDEV",
    "MAX_DP_NOISE",
    "MAX_DP_NOISE_NORM",
    "check_dp_options",
    "check_dp_scale",
    "check_secagg_options",
    "default_count_stddev",
]

CLIPPING_MODES = ("server", "client")
"""``server``: the coordinator clips each update; ``client``: the peer clips, the coordinator
checks the norm and refuses one above the clipping norm."""

DP_STRATEGIES = ("fedavg", "mean")
"""Strategies a DP run accepts; its rounds always aggregate with the unweighted ``mean`` of
the clipped deltas (DP-FedAvg's uniform weights, Flower's noise calibration)."""


MAX_DP_NOISE = 1e6
"""The largest noise multiplier z (practice: 0.1 to 10; z = 1e6 already drowns any update)."""

MAX_DP_CLIP = 1e9
"""The largest clipping norm C, also the ceiling adaptive clipping never moves C above; so
z x C <= 1e15: the noise stddev on each value of the sum of clipped updates (squares of
such values stay finite in float32, whose largest value is 3.4e38)."""

MAX_DP_NOISE_NORM = 1e18
"""The largest z x C x sqrt(values in the model): the expected L2 norm of the noise added
to the sum of the clipped updates. Its square (1e36) still fits in float32, so noised
models, their norms and the server optimizer's squared moments stay finite. Checked when a
run is created, against its initial model's size."""

MAX_DP_CLIP_NORM_LR = 10.0
"""The largest adaptive-clipping learning rate (Andrew et al. use 0.2): C moves by at most
a factor exp(lr) per round, as it was meant to."""

MAX_DP_COUNT_STDDEV = 1e6
"""The largest stddev of the noise on the clipped count (default: sampled peers / 20)."""


def default_count_stddev(num_sampled: int) -> float:
    """The clipped-count noise when none is given: ``num_sampled / 20`` (Andrew et al.,
    Flower's default)."""
    return num_sampled / 20


def _finite(
    name: str, value: object, low: float, *, strict: bool = True, high: float | None = None
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRunSpec(f"{name} must be a finite number, got {value!r}")
    if value < low or (strict and value == low):
        raise InvalidRunSpec(f"{name} must be {'>' if strict else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise InvalidRunSpec(f"{name} must be <= {high:g}, got {value!r}")
    return float(value)


def check_dp_options(spec: Any) -> None:
    """InvalidRunSpec unless the spec's ``dp_*`` options work together (a RunSpec)."""
    if spec.dp_clip is None:
        given = [
            name
            for name, default in (
                ("dp_noise", 0.0),
                ("dp_max_epsilon", None),
                ("dp_clipping", "server"),
                ("dp_adaptive", False),
            )
            if getattr(spec, name) != default
        ]
        if given:
            raise InvalidRunSpec(f"{', '.join(given)} need dp_clip (the clipping norm)")
        return
    _finite("dp_clip", spec.dp_clip, 0.0, high=MAX_DP_CLIP)
    _finite("dp_noise", spec.dp_noise, 0.0, strict=False, high=MAX_DP_NOISE)
    delta = _finite("dp_delta", spec.dp_delta, 0.0)
    if delta >= 1:
        raise InvalidRunSpec(f"dp_delta must be in (0, 1), got {delta!r}")
    if spec.dp_max_epsilon is not None:
        _finite("dp_max_epsilon", spec.dp_max_epsilon, 0.0)
    if spec.dp_clipping not in CLIPPING_MODES:
        raise InvalidRunSpec(
            f"dp_clipping is one of {list(CLIPPING_MODES)}, got {spec.dp_clipping!r}"
        )
    if not isinstance(spec.dp_adaptive, bool):
        raise InvalidRunSpec(f"dp_adaptive must be true or false, got {spec.dp_adaptive!r}")
    quantile = _finite(
        "dp_target_clipped_quantile", spec.dp_target_clipped_quantile, 0.0, strict=False
    )
    if quantile > 1:
        raise InvalidRunSpec(f"dp_target_clipped_quantile must be in [0, 1], got {quantile!r}")
    _finite("dp_clip_norm_lr", spec.dp_clip_norm_lr, 0.0, high=MAX_DP_CLIP_NORM_LR)
    if spec.dp_clipped_count_stddev is not None:
        stddev = spec.dp_clipped_count_stddev
        _finite("dp_clipped_count_stddev", stddev, 0.0, strict=False, high=MAX_DP_COUNT_STDDEV)
    if spec.mode.value != "sync":
        raise InvalidRunSpec("differential privacy needs a sync run (sampled rounds)")
    if spec.strategy not in DP_STRATEGIES:
        raise InvalidRunSpec(
            f"a DP run aggregates with the unweighted mean of clipped deltas; strategy "
            f"{spec.strategy!r} is not one of {list(DP_STRATEGIES)}"
        )
    if "max_norm" in spec.params:
        raise InvalidRunSpec("a DP run clips with dp_clip; drop the strategy's max_norm")
    if spec.dp_adaptive and spec.dp_noise > 0:
        # the smallest round samples min_clients: its count noise is the smallest default
        count = spec.dp_clipped_count_stddev
        count = default_count_stddev(spec.min_clients) if count is None else count
        if spec.dp_noise >= 2 * count:
            raise InvalidRunSpec(
                f"adaptive clipping splits dp_noise={spec.dp_noise} between the update and the "
                f"clipped count (stddev {count:.4g}); it needs dp_noise < 2 x that stddev: "
                f"raise dp_clipped_count_stddev (or min_clients) or lower dp_noise"
            )


def check_dp_scale(spec: Any, size: int) -> None:
    """InvalidRunSpec unless a DP run's noise on a model of ``size`` values stays well inside
    float32: ``dp_noise x dp_clip x sqrt(size) <= MAX_DP_NOISE_NORM`` (checked by
    ``RunManager.create_run``, which knows the model; ``check_dp_options`` bounds z and C)."""
    if spec.dp_clip is None or spec.dp_noise == 0:
        return
    norm = spec.dp_noise * spec.dp_clip * math.sqrt(max(size, 1))
    if norm > MAX_DP_NOISE_NORM:
        raise InvalidRunSpec(
            f"dp_noise x dp_clip x sqrt(model size) = {spec.dp_noise:g} x {spec.dp_clip:g} x "
            f"sqrt({size}) = {norm:.3g}, above {MAX_DP_NOISE_NORM:g}: noise that large would "
            f"leave float32 (lower dp_noise or dp_clip)"
        )


def _int_at_least(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRunSpec(f"{name} must be an int >= {low}, got {value!r}")
    return value


def check_secagg_options(spec: Any) -> None:
    """InvalidRunSpec unless the spec's ``secagg*`` options work together (a RunSpec).

    Secure aggregation needs a sync run of at least 2 sampled peers, a numeric (or no)
    round deadline, and with DP client-side fixed clipping: the coordinator never sees one
    delta, so it can neither clip one nor count the clipped ones."""
    if not isinstance(spec.secagg, bool):
        raise InvalidRunSpec(f"secagg must be true or false, got {spec.secagg!r}")
    if not spec.secagg:
        given = [
            name
            for name, default in (
                ("secagg_threshold", None),
                ("secagg_clip", None),
                ("secagg_bits", None),
                ("secagg_min_survivors", 3),
            )
            if getattr(spec, name) != default
        ]
        if given:
            raise InvalidRunSpec(f"{', '.join(given)} need secagg")
        return
    if spec.mode.value != "sync":
        raise InvalidRunSpec("secure aggregation needs a sync run (sampled rounds)")
    if spec.min_clients < 2:
        raise InvalidRunSpec("secure aggregation needs min_clients >= 2 (a sum of one is one)")
    if spec.round_timeout_s == "auto":
        raise InvalidRunSpec("secure aggregation takes a round deadline in seconds, not 'auto'")
    if spec.secagg_threshold is not None:
        _int_at_least("secagg_threshold", spec.secagg_threshold, 2)
    if spec.secagg_clip is not None:
        _finite("secagg_clip", spec.secagg_clip, 0.0)
    if (
        spec.secagg_bits is not None
        and not 1 <= _int_at_least("secagg_bits", spec.secagg_bits, 1) <= 31
    ):
        raise InvalidRunSpec(f"secagg_bits must be in 1..31, got {spec.secagg_bits!r}")
    weight = _int_at_least("secagg_max_weight", spec.secagg_max_weight, 1)
    if weight >= 1 << 31:
        raise InvalidRunSpec(f"secagg_max_weight must be below 2^31, got {weight}")
    _finite("secagg_phase_timeout_s", spec.secagg_phase_timeout_s, 0.0)
    floor = _int_at_least("secagg_min_survivors", spec.secagg_min_survivors, 2)
    if spec.min_clients < floor:
        raise InvalidRunSpec(
            f"secagg_min_survivors={floor} needs min_clients >= {floor}: a secure round's sum "
            f"is never unmasked over fewer peers (with 2, each learns the other's delta)"
        )
    if spec.strategy not in DP_STRATEGIES:
        raise InvalidRunSpec(
            f"a secure run sums the peers' deltas (FedAvg-weighted by num_samples); strategy "
            f"{spec.strategy!r} is not one of {list(DP_STRATEGIES)}"
        )
    if any(name != DETERMINISTIC for name in spec.params):  # integer sums: exact in any order
        raise InvalidRunSpec("a secure run sums the peers' deltas: it takes no strategy params")
    if spec.dp_clip is not None and (spec.dp_clipping != "client" or spec.dp_adaptive):
        raise InvalidRunSpec(
            "secure aggregation with DP needs dp_clipping='client' and fixed clipping: the "
            "coordinator sees only the sum, so it can neither clip a delta nor count clipped ones"
        )
