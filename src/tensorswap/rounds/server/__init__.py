"""Rounds server: the coordinator served on the wire (``RoundServer``) and its intake queue."""

from tensorswap.rounds.server.server import RoundServer, TrafficStats

__all__ = ["RoundServer", "TrafficStats"]
