"""tensorswap: move gradients and weight deltas between training peers and aggregate them."""

from __future__ import annotations

from tensorswap.errors import TensorSwapError

__version__ = "0.1.0"

__all__ = ["TensorSwapError", "__version__"]
