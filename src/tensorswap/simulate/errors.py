"""The errors of a simulation."""

from __future__ import annotations

from tensorswap.errors import TensorSwapError

__all__ = ["InvalidSimulation", "SimulationError"]


class SimulationError(TensorSwapError, RuntimeError):
    """A simulation could not run (a worker or the coordinator failed, a round stalled)."""


class InvalidSimulation(SimulationError, ValueError):
    """The options of a simulation do not fit together (more sampled than clients, ...)."""
