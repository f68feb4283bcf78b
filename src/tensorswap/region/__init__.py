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
- ``identity``: each coordinator's stable id and the ``region`` hello (name, chain of ids).
- ``gate``: ``RegionGate``, a coordinator's side of the hello: one live coordinator per
  region name (RegionNameTaken), loops refused (RegionLoop).
- ``throttle``: ``DialThrottle``, the link-wide backoff between dials upstream.
- ``errors``: ``RegionError`` and its leaves.
"""

from tensorswap.region.errors import (
    ForeignContribution,
    RegionError,
    RegionLoop,
    RegionNameTaken,
    SecureRunThroughRegion,
    UpstreamIncompatible,
    UpstreamUnavailable,
)
from tensorswap.region.gate import RegionGate
from tensorswap.region.identity import coordinator_id
from tensorswap.region.journal import Forward, ForwardState, RegionJournal
from tensorswap.region.link import Backoff, LinkTraffic, UpstreamLink
from tensorswap.region.runs_fold import RunFolds
from tensorswap.region.runs_proxy import RunsProxy
from tensorswap.region.throttle import DialThrottle
from tensorswap.region.tier import COMPOSING_STRATEGY, RegionalTier, TierStats

__all__ = [
    "COMPOSING_STRATEGY",
    "Backoff",
    "DialThrottle",
    "ForeignContribution",
    "Forward",
    "ForwardState",
    "LinkTraffic",
    "RegionError",
    "RegionGate",
    "RegionJournal",
    "RegionLoop",
    "RegionNameTaken",
    "RegionalTier",
    "RunFolds",
    "RunsProxy",
    "SecureRunThroughRegion",
    "TierStats",
    "UpstreamIncompatible",
    "UpstreamLink",
    "UpstreamUnavailable",
    "coordinator_id",
]
