"""StreamingAccumulator: FedAvg or the mean folded in as contributions arrive, O(model) memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorswap import _alloc
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
#: Weighted sums are kept relative to R >= 2**HEADROOM_BITS * Σ n_i when R is chosen, so that
#: Σ n_i can grow that much before the sums need rescaling (a round rarely rescales at all).
HEADROOM_BITS = 8


class StreamingAccumulator:
    """Folds contributions into running sums as they arrive; never holds more than one model.

    kind FEDAVG (default) gives exactly FedAvg's semantics: Σ n_i x_i / Σ n_i, or the uniform
    mean while every num_samples is 0. That needs only one sum per tensor: contributions with
    n_i = 0 weigh nothing once any n_i > 0 has arrived, so the uniform sum of the zero-sample
    ones is kept only until then and overwritten by the first weighted term. kind MEAN ignores
    num_samples. Memory: one accumulator per tensor plus a FOLD_CHUNK scratch.

    Weighted terms are not summed as raw n_i x_i, which overflows float32 for a peer claiming
    ~2**64 samples where batch FedAvg (weights n_i / Σ n) does not: the sums hold
    Σ (n_i / R) x_i for a power of two R >= Σ n_i, so their weights add up to at most 1, as
    batch FedAvg's do. R is chosen 2**HEADROOM_BITS times above Σ n_i; when a contribution
    takes Σ n_i past R, a new R is chosen and the sums are rescaled by the (exact) power-of-two
    ratio in the same chunked pass that folds the contribution in. `result` divides by
    Σ n_i / R. Uniform terms (MEAN, or FEDAVG while every count is 0) are summed as they are
    and divided by their count, so k of them above float32's max / k overflow
    (AggregateOverflow; use dtype="float64") where the batch mean, weighting by 1/k, does not.

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
        self._empty()

    def _empty(self) -> None:
        """Nothing folded: the state of a new accumulator of this spec."""
        self.layout: Layout | None = None
        self._dtypes: list[np.dtype] = []
        self._sums: list[np.ndarray] = []
        self._scratch: np.ndarray | None = None
        self._weighted = False  # the sums hold weighted terms (some n_i > 0 has arrived)
        self._weight = 0  # Σ n_i of the weighted terms in the sums, or the uniform terms' count
        self._ref = 1  # weighted: R, a power of two >= self._weight (sums hold Σ (n_i / R) x_i)
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
    def add(self, values: object, num_samples: int = 0, *, scale: float = 1.0) -> bool:
        """Fold one contribution in; True if folded, False if dropped by the DROP policy.

        ``scale`` (in (0, 1]) multiplies its values before they are folded (after any
        clipping), without changing its weight: an asynchronous run's staleness factor.
        The contribution's index (in `used`, `dropped` and errors) is the number of earlier
        adds that returned. Raises AggregationError subclasses for bad input, leaving the
        accumulator unchanged.
        """
        if not (isinstance(scale, int | float) and 0 < scale <= 1):
            raise InvalidAggregatorOption("scale", scale, "must be a number in (0, 1]")
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
        scale_clip = self._screen(rows, index)
        if self.layout is None:
            self.layout, self._dtypes = layout, dtypes
        self._seen += 1
        if scale_clip is None:
            return False
        self._fold(rows, n, scale_clip * scale)
        self._used.append(index)
        self._total += n
        return True

    def _screen(self, rows: list[np.ndarray], index: int) -> float | None:
        """The clip factor for the rows, None if DROP rejects them; raises under RAISE."""
        policy, max_norm = self.spec.non_finite, self.spec.max_norm
        if policy is NonFinitePolicy.PROPAGATE and max_norm is None:
            return 1.0
        check = check_rows(rows, exact=max_norm is not None)
        if check.nonfinite and policy is not NonFinitePolicy.PROPAGATE:
            error = NonFiniteValues(index, check.nonfinite)
            if policy is NonFinitePolicy.RAISE:
                raise error
            self._dropped.append(error)
            return None
        return 1.0 if max_norm is None else float(clip_scales([check.norm], max_norm)[0])

    def _fold(self, rows: list[np.ndarray], n: int, scale: float) -> None:
        restart = not self._sums
        if restart:
            assert self.layout is not None  # set by add before folding
            acc = [default_accumulate(d, self.spec.dtype) for d in self._dtypes]
            sizes = self.layout.sizes
            # pooled memory: the slabs the uploads arrived in, already faulted in
            self._sums = [_alloc.empty(size, a) for size, a in zip(sizes, acc, strict=True)]
        if self.spec.kind is AggregatorKind.FEDAVG and n > 0:
            weight = n
            restart = restart or not self._weighted  # the first weighted term replaces the sums
            self._weighted = True
        elif self.spec.kind is AggregatorKind.FEDAVG and self._weighted:
            return  # n = 0 among positive counts: weight 0
        else:
            weight = 1
        if restart:
            self._weight, self._ref = 0, 1
        total = self._weight + weight
        ref = self._ref
        if self._weighted and (restart or total > ref):
            ref = 1 << ((total - 1).bit_length() + HEADROOM_BITS)
        rescale = self._ref / ref  # a power of two <= 1: exact, unless values become subnormal
        factor = scale * (weight / ref)  # int / int is correctly rounded
        for dst, src in zip(self._sums, rows, strict=True):
            self._fold_row(dst, src, factor, rescale, restart)
        self._weight, self._ref = total, ref

    def _fold_row(
        self, dst: np.ndarray, src: np.ndarray, factor: float, rescale: float, first: bool
    ) -> None:
        """dst = factor * src (first) or dst = rescale * dst + factor * src, chunk by chunk."""
        f = dst.dtype.type(factor)
        if first:
            np.multiply(src, f, out=dst)
            return
        if factor == 1.0 and rescale == 1.0:  # uniform terms without clipping
            np.add(dst, src, out=dst)
            return
        if self._scratch is None or self._scratch.dtype != dst.dtype:
            self._scratch = np.empty(FOLD_CHUNK, dtype=dst.dtype)
        r = dst.dtype.type(rescale) if rescale != 1.0 else None
        for start in range(0, dst.size, FOLD_CHUNK):
            stop = min(start + FOLD_CHUNK, dst.size)
            tmp, into = self._scratch[: stop - start], dst[start:stop]
            if r is not None:  # while the chunk is in cache
                np.multiply(into, r, out=into)
            np.multiply(src[start:stop], f, out=tmp)
            np.add(into, tmp, out=into)

    @quiet
    def result(self, *, consume: bool = False) -> AggregateResult:
        """The aggregate of everything folded so far, as new arrays (the accumulator goes on).

        ``consume``: the sums are divided in place and become the result's arrays (the same
        bits, no second copy of the model in memory), and the accumulator is left empty, as
        new, whether this returns or raises. Raises EmptyInput if nothing was folded,
        AggregateOverflow if finite contributions overflowed the accumulator dtype.
        """
        if not self._used or self.layout is None:
            raise EmptyInput(
                "no contribution was added"
                if not self._dropped
                else f"all {len(self._dropped)} contributions were dropped for non-finite values"
            )
        fraction = self._weight / self._ref  # weighted: Σ n_i / R <= 1; uniform: the count
        layout, used, total, dropped = self.layout, tuple(self._used), self._total, self.dropped
        if consume:
            outs = self._sums
            self._empty()
            for s in outs:
                np.divide(s, s.dtype.type(fraction), out=s)
        else:
            outs = [
                np.divide(s, s.dtype.type(fraction), out=_alloc.empty(s.size, s.dtype))
                for s in self._sums
            ]
        values = build_values(layout, outs)
        ensure_finite(values, self.spec.kind, self.spec.non_finite)
        return AggregateResult(
            values=values,
            kind=self.spec.kind,
            used=used,
            total_samples=total,
            dropped=dropped,
        )
