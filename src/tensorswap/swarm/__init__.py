"""Swarm distribution of results: peers serve the blocks they hold to each other.

A coordinator's ``SwarmTracker`` (the ``"swarm"`` app on its port) lists the peers that
serve a root; a ``SwarmPeer`` runs a read-only ``SwarmSeeder`` on its own port, announces
the roots it fetches, and fetches chunks from the coordinator and those peers at once
(``SwarmSchedule``), every block checked against its CID before it is stored.
"""

from tensorswap.swarm.errors import BadSwarmMessage, SwarmError, SwarmExhausted, SwarmReadOnly
from tensorswap.swarm.peer import SwarmFetch, SwarmPeer
from tensorswap.swarm.scheduler import ChunkSource, SourceReport, SwarmSchedule
from tensorswap.swarm.seeder import Holdings, ReadOnlyView, SwarmSeeder
from tensorswap.swarm.tracker import SwarmTracker

__all__ = [
    "BadSwarmMessage",
    "ChunkSource",
    "Holdings",
    "ReadOnlyView",
    "SourceReport",
    "SwarmError",
    "SwarmExhausted",
    "SwarmFetch",
    "SwarmPeer",
    "SwarmReadOnly",
    "SwarmSchedule",
    "SwarmSeeder",
    "SwarmTracker",
]
