"""StreamingAccumulator: FedAvg or the mean folded in as contributions arrive, O(model) memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorswap.aggregate._kernels import build_values, quiet
from tensorswap.aggregate.clip import check_rows, clip_scales, ensure_finite
from tensorswap.aggregate.types import (
    AggregateResult,
    AggregatorKind,
    AggregatorSpec,
    InvalidAggregatorOption,
    Layout,
    NonFinitePolicy,
)
from tensorswap.aggregate.validate import (
    check_against,
    check_dtype,
    check_num_samples,
    default_accumulate,
    flat_view,
    ordered,
    tensors_of,
)
from tensorswap.errors import EmptyInput, NonFiniteValues

#: Values per fold step; the scratch product of one step stays in cache.
FOLD_CHUNK = 1 << 15


class StreamingAccumulator:
    """Folds contributions into running sums as they arrive; never holds more than one model.

    kind FEDAVG (default) gives exactly FedAvg's semantics: Σ n_i x_i / Σ n_i, or the uniform
    mean while every num_samples is 0. That needs only one sum per tensor: contributions with
    n_i = 0 weigh nothing once any n_i > 0 has arrived, so the uniform sum of the zero-sample
    ones is kept only until then and overwritten by the first weighted term. kind MEAN ignores
    num_samples. Memory: one accumulator per tensor plus a FOLD_CHUNK scratch.

    Each `add` validates and screens its contribution before touching the sums: a rejected
    contribution (error raised) leaves the accumulator exactly as it was. The first accepted
    contribution fixes the layout (tensor names, shapes, dtypes) that later ones must match.
    """

    def __init__(
        self,
        kind: AggregatorKind = AggregatorKind.FEDAVG,
        *,
        dtype: Any = None,
        max_norm: float | None = None,
        non_finite: NonFinitePolicy = NonFinitePolicy.RAISE,
    ) -> None:
        if kind not in (AggregatorKind.MEAN, AggregatorKind.FEDAVG):
            raise InvalidAggregatorOption("kind", kind, "streaming supports MEAN and FEDAVG")
        self.spec = AggregatorSpec(kind=kind, dtype=dtype, max_norm=max_norm, non_finite=non_finite)
        self.layout: Layout | None = None
        self._dtypes: list[np.dtype] = []
        self._sums: list[np.ndarray] = []
        self._scratch: np.ndarray | None = None
        self._weighted = False  # the sums hold Σ n_i x_i (some n_i > 0 has arrived)
        self._uniform = 0  # contributions in the sums while not weighted
        self._total = 0
        self._seen = 0
        self._used: list[int] = []
        self._dropped: list[NonFiniteValues] = []

    @property
    def count(self) -> int:
        """Contributions folded in (dropped ones excluded)."""
        return len(self._used)

    @property
    def total_samples(self) -> int:
        return self._total

    @property
    def nbytes(self) -> int:
        """Bytes of array state held: the running sums and the fold scratch."""
        scratch = 0 if self._scratch is None else self._scratch.nbytes
        return sum(s.nbytes for s in self._sums) + scratch

    @property
    def dropped(self) -> tuple[NonFiniteValues, ...]:
        """One NonFiniteValues per contribution left out by the DROP policy, in arrival order."""
        return tuple(self._dropped)

    @quiet
    def add(self, values: object, num_samples: int = 0) -> bool:
        """Fold one contribution in; True if folded, False if dropped by the DROP policy.

        The contribution's index (in `used`, `dropped` and errors) is the number of earlier
        adds that returned. Raises AggregationError subclasses for bad input, leaving the
        accumulator unchanged.
        """
        index = self._seen
        n = check_num_samples(num_samples, index)
        keys, arrays = tensors_of(values, index)
        layout = self.layout
        if layout is None:
            layout = Layout(keys, tuple(a.shape for a in arrays))
            for name, arr in zip(layout.names, arrays, strict=True):
                check_dtype(arr, index, "" if name is None else f"tensor {name!r}")
            dtypes = [a.dtype for a in arrays]
        else:
            dtypes = self._dtypes
        arrays = ordered(layout, keys, arrays, index)
        check_against(layout, dtypes, arrays, index)
        rows = [flat_view(a) for a in arrays]
        scale = self._screen(rows, index)
        if self.layout is None:
            self.layout, self._dtypes = layout, dtypes
        self._seen += 1
        if scale is None:
            return False
        self._fold(rows, n, scale)
        self._used.append(index)
        self._total += n
        return True

    def _screen(self, rows: list[np.ndarray], index: int) -> float | None:
        """The clip factor for the rows, None if DROP rejects them; raises under RAISE."""
        policy, max_norm = self.spec.non_finite, self.spec.max_norm
        if policy is NonFinitePolicy.PROPAGATE and max_norm is None:
            return 1.0
        check = check_rows(rows)
        if check.nonfinite and policy is not NonFinitePolicy.PROPAGATE:
            error = NonFiniteValues(index, check.nonfinite)
            if policy is NonFinitePolicy.RAISE:
                raise error
            self._dropped.append(error)
            return None
        return 1.0 if max_norm is None else float(clip_scales([check.norm], max_norm)[0])

    def _fold(self, rows: list[np.ndarray], n: int, scale: float) -> None:
        if not self._sums:
            assert self.layout is not None  # set by add before folding
            acc = [default_accumulate(d, self.spec.dtype) for d in self._dtypes]
            sizes = self.layout.sizes
            self._sums = [np.empty(n, dtype=a) for n, a in zip(sizes, acc, strict=True)]
            first = True
        else:
            first = False
        if self.spec.kind is AggregatorKind.FEDAVG and n > 0:
            factor = float(n) * scale
            first = first or not self._weighted
            self._weighted = True
        elif self.spec.kind is AggregatorKind.FEDAVG and self._weighted:
            return  # n = 0 among positive counts: weight 0
        else:
            factor = scale
            self._uniform += 1
        for dst, src in zip(self._sums, rows, strict=True):
            self._fold_row(dst, src, factor, first)

    def _fold_row(self, dst: np.ndarray, src: np.ndarray, factor: float, first: bool) -> None:
        """dst = factor * src (first) or dst += factor * src, in dst's dtype, chunk by chunk."""
        f = dst.dtype.type(factor)
        if first:
            np.multiply(src, f, out=dst)
            return
        if factor == 1.0:
            np.add(dst, src, out=dst)
            return
        if self._scratch is None or self._scratch.dtype != dst.dtype:
            self._scratch = np.empty(FOLD_CHUNK, dtype=dst.dtype)
        for start in range(0, dst.size, FOLD_CHUNK):
            stop = min(start + FOLD_CHUNK, dst.size)
            tmp = self._scratch[: stop - start]
            np.multiply(src[start:stop], f, out=tmp)
            np.add(dst[start:stop], tmp, out=dst[start:stop])

    @quiet
    def result(self) -> AggregateResult:
        """The aggregate of everything folded so far, as new arrays (the accumulator goes on).

        Raises EmptyInput if nothing was folded, AggregateOverflow if finite contributions
        overflowed the accumulator dtype.
        """
        if not self._used or self.layout is None:
            raise EmptyInput(
                "no contribution was added"
                if not self._dropped
                else f"all {len(self._dropped)} contributions were dropped for non-finite values"
            )
        divisor = self._total if self._weighted else self._uniform
        outs = [np.divide(s, s.dtype.type(divisor)) for s in self._sums]
        values = build_values(self.layout, outs)
        ensure_finite(values, self.spec.kind, self.spec.non_finite)
        return AggregateResult(
            values=values,
            kind=self.spec.kind,
            used=tuple(self._used),
            total_samples=self._total,
            dropped=tuple(self._dropped),
        )
