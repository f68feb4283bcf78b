"""A call's input copied a chunk at a time, and its result assembled slice by slice."""

from __future__ import annotations

import numpy as np

from tensorswap.collective._assemble import Assembly
from tensorswap.collective._compress import codec_for
from tensorswap.collective._layout import fill, flatten, inputs_of
from tensorswap.store import MemoryStore


def test_fill_copies_any_range_of_the_arrays_laid_end_to_end() -> None:
    rng = np.random.default_rng(3)
    tensors = {
        "b": rng.standard_normal((7, 5)),  # float64, converted
        "a": rng.standard_normal((6, 9)).astype(np.float32).T,  # not C-contiguous
        "c": rng.standard_normal(11).astype(np.float16),
    }
    layout, arrays = inputs_of(tensors)
    expected = np.concatenate([np.asarray(tensors[n], np.float32).reshape(-1) for n in "abc"])
    assert layout.names == ("a", "b", "c")
    _, whole = flatten(tensors)
    assert np.array_equal(whole, expected)
    for step in (1, 4, 13, 54, 200):
        out = np.full(layout.total, np.nan, np.float32)
        for start in range(0, layout.total, step):
            fill(arrays, out, start, min(layout.total, start + step))
        assert np.array_equal(out, expected)


def test_a_chunk_placed_under_a_cid_not_published_is_copied_again() -> None:
    store = MemoryStore()
    old, new, other = (np.full(4, v, np.float32) for v in (1.0, 2.0, 3.0))
    cid_old, cid_new, cid_other = (store.put(x.data) for x in (old, new, other))
    assembly = Assembly(store, codec_for("none"), [(0, 4), (4, 8)], 8)
    assembly.place([(0, cid_old)])  # a slice published over a live set a drop then changed
    assert assembly.lacking([(0, cid_old), (1, cid_other)]) == [(1, cid_other)]
    out = assembly.finish([(0, cid_new), (1, cid_other)])
    assert np.array_equal(out, np.concatenate([new, other]))
    assert assembly.placed == {0: cid_new, 1: cid_other}
