"""Simulation: many virtual clients, hosted many per worker, against a real coordinator.

``tensorswap simulate`` starts a coordinator (``tensorswap serve``), creates a federated run
on it (K of N registered clients sampled each round) and hosts the N virtual clients in a few
workers: local processes (``process`` backend, JSON lines on their stdin / stdout) or Ray
actors (``ray`` backend, ``tensorswap[ray]``). Every update travels to the coordinator over
tensorswap's wire (``rounds.client.virtual.VirtualClients``). See docs/scale.md, "Simulation".
"""

from tensorswap.simulate.config import SimConfig
from tensorswap.simulate.errors import InvalidSimulation, SimulationError

__all__ = ["InvalidSimulation", "SimConfig", "SimulationError"]
