"""Hierarchical aggregation: a regional coordinator, a coordinator for its peers and one
contribution to the coordinator above (``tensorswap serve --upstream HOST:PORT``).

- ``tier``: ``RegionalTier``, the coordinator's ``finish`` hook: a regional round's partial
  aggregate goes upstream once, the global result comes back once and is served to the
  region's peers under the same round id.
- ``link``: ``UpstreamLink``, the RoundClient connections to the upstream (reconnected with
  backoff, bytes counted); ``Backoff``.
- ``runs_proxy``: ``RunsProxy``, the region's runs app: requests relayed to the top (where
  runs, sampling and the server optimizer live), global models pulled once per region.
- ``runs_fold``: ``RunFolds``, a sync FedAvg run's round folded here: the peers the top
  sampled submit to the region, one contribution per round goes up.
- ``journal``: ``RegionJournal``, what was submitted upstream per round (kill -9 safe).
- ``errors``: ``RegionError`` and its leaves.
"""

from tensorswap.region.errors import (
    RegionError,
    SecureRunThroughRegion,
    UpstreamIncompatible,
    UpstreamUnavailable,
)
from tensorswap.region.journal import Forward, ForwardState, RegionJournal
from tensorswap.region.link import Backoff, LinkTraffic, UpstreamLink
from tensorswap.region.runs_fold import RunFolds
from tensorswap.region.runs_proxy import RunsProxy
from tensorswap.region.tier import COMPOSING_STRATEGY, RegionalTier, TierStats

__all__ = [
    "COMPOSING_STRATEGY",
    "Backoff",
    "Forward",
    "ForwardState",
    "LinkTraffic",
    "RegionError",
    "RegionJournal",
    "RegionalTier",
    "RunFolds",
    "RunsProxy",
    "SecureRunThroughRegion",
    "TierStats",
    "UpstreamIncompatible",
    "UpstreamLink",
    "UpstreamUnavailable",
]
