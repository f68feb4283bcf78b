"""Helpers shared by the aggregation tests: small float32 arrays and matrices of contributions."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


def f32(*values: float) -> np.ndarray:
    """A 1-d float32 array of ``values``."""
    return np.array(values, dtype=np.float32)


def float32_matrices(max_rows: int, max_cols: int, bound: float) -> st.SearchStrategy[np.ndarray]:
    """float32 matrices of 1..max_rows rows and 1..max_cols columns, values within ±bound."""
    return st.integers(1, max_rows).flatmap(
        lambda k: hnp.arrays(
            np.float32,
            st.tuples(st.just(k), st.integers(1, max_cols)),
            elements=st.floats(-bound, bound, width=32),
        )
    )
