"""The regional tier's errors, under ``RegionError`` (a branch of ``RoundsError``).

::

    RegionError
    ├── UpstreamIncompatible   the upstream round aggregates in a way regional partials
    │                          do not compose with (anything but plain FedAvg)
    ├── UpstreamUnavailable    the upstream coordinator stayed unreachable past the patience
    ├── SecureRunThroughRegion a secure (SecAgg+) run's peer asked through a region
    ├── RegionLoop             the chain of coordinators a request passes through loops back
    ├── RegionNameTaken        a live region of another coordinator holds this region name
    └── ForeignContribution    the upstream holds a contribution under the region's name that
                               is not the region's fold (another region uses the name)
"""

from __future__ import annotations

from tensorswap.errors import RoundsError, register_remote

__all__ = [
    "ForeignContribution",
    "RegionError",
    "RegionLoop",
    "RegionNameTaken",
    "SecureRunThroughRegion",
    "UpstreamIncompatible",
    "UpstreamUnavailable",
]


class RegionError(RoundsError):
    """A regional coordinator could not forward a round to, or finish it from, its upstream."""


class UpstreamIncompatible(RegionError):
    """The upstream round's strategy does not compose with regional partial aggregates.

    A region submits its partial aggregate weighted by its peers' summed num_samples (by its
    peer count for ``mean``); only an upstream FedAvg without clipping turns those into the
    flat result, so any other upstream strategy is refused rather than silently wrong.
    """

    def __init__(self, round_key: str, strategy: str, detail: str = "") -> None:
        self.round_key = round_key
        self.strategy = strategy
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"upstream round {round_key} aggregates with {strategy!r}{extra}: a regional tier "
            "composes only under an upstream 'fedavg' (start the upper round with fedavg)"
        )


class UpstreamUnavailable(RegionError, ConnectionError):
    """The upstream coordinator could not be reached (or kept failing) for ``waited`` s."""

    def __init__(self, upstream: str, what: str, waited: float, last: str) -> None:
        self.upstream = upstream
        self.what = what
        self.waited = waited
        self.last = last
        super().__init__(
            f"upstream {upstream} unreachable for {waited:.1f} s while {what}: last error {last}"
        )


class SecureRunThroughRegion(RegionError):
    """A secure (SecAgg+) run cannot go through a region: the masks of its peers cancel only
    in the sum of all the sampled peers at the top, so a region could not fold them without
    unmasking, and it does not relay the masked protocol either. Connect to the top."""

    def __init__(self, run: str) -> None:
        self.run = run
        super().__init__(
            f"run {run!r} aggregates securely (SecAgg+): its peers connect to the top "
            "coordinator, not through a region (masks do not compose through a region)"
        )


class RegionLoop(RegionError):
    """A coordinator found itself in the chain of coordinators a region connection passes
    through (or found one of its own upstreams below it): the regions are configured in a
    loop (X upstream of Y, Y upstream of X). Not transient: a region that meets it stops
    relaying upstream until it is restarted with another ``--upstream``."""

    def __init__(self, coordinator: str, chain: str, detail: str = "") -> None:
        self.coordinator = coordinator
        self.chain = chain
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"region loop: coordinator {coordinator} is already on the chain {chain}{extra}; "
            "the regions' --upstream options form a cycle: point one of them at the top"
        )


class RegionNameTaken(RegionError):
    """A second live region asked for a region name another coordinator holds upstream: both
    would submit under one peer name and one's updates would be refused as duplicates."""

    def __init__(self, region: str, holder: str, claimant: str) -> None:
        self.region = region
        self.holder = holder
        self.claimant = claimant
        super().__init__(
            f"region name {region!r} is held upstream by a live region (coordinator {holder});"
            f" this one is coordinator {claimant}: give each region its own --region name"
        )


class ForeignContribution(RegionError):
    """The upstream round already holds a contribution under the region's name, and it is not
    the region's fold (its CID differs): another region submitted under the same name. The
    regional round fails instead of completing with a result that lacks its peers' updates."""

    def __init__(self, key: str, region: str, held: str, partial: str) -> None:
        self.key = key
        self.region = region
        self.held = held
        self.partial = partial
        super().__init__(
            f"upstream round {key} already holds update {held} from {region!r}, not this "
            f"region's fold {partial}: another region submits under the name {region!r}"
        )


register_remote(
    *(c for n in __all__ if isinstance(c := globals()[n], type) and issubclass(c, RoundsError))
)
