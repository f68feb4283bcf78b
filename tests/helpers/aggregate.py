"""Helpers shared by the aggregation tests: small float32 arrays and matrices of contributions."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


def f32(*values: float) -> np.ndarray:
    """A 1-d float32 array of ``values``."""
    return np.array(values, dtype=np.float32)


def _rows_of(k: int, min_cols: int, max_cols: int, bound: float) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(
        np.float32,
        st.tuples(st.just(k), st.integers(min_cols, max_cols)),
        elements=st.floats(-bound, bound, width=32),
    )


def float32_matrices(max_rows: int, max_cols: int, bound: float) -> st.SearchStrategy[np.ndarray]:
    """float32 matrices of 1..max_rows rows and 1..max_cols columns, values within ±bound."""
    return st.integers(1, max_rows).flatmap(lambda k: _rows_of(k, 1, max_cols, bound))


def weighted_float32_matrices(
    max_rows: int, max_cols: int, bound: float, samples: st.SearchStrategy[int]
) -> st.SearchStrategy[tuple[np.ndarray, list[int]]]:
    """(matrix, sample counts): 1..max_rows rows of 0..max_cols values, a count drawn per row."""
    return st.integers(1, max_rows).flatmap(
        lambda k: st.tuples(
            _rows_of(k, 0, max_cols, bound), st.lists(samples, min_size=k, max_size=k)
        )
    )
