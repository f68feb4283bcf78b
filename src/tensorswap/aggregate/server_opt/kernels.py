"""The update rules, as cache-blocked in-place numpy kernels over flat tensors of one dtype.

Every kernel walks a tensor in chunks of CHUNK values: the temporaries (two scratch buffers of
one chunk) stay in the L2 cache, so each big array is read or written once per step and the
dozen ufunc calls of an Adam-style update run on cached data. Elementwise IEEE operations do
not depend on where a chunk starts, so the result is the same for any chunk size, and for
any split of a large model into pieces run on a few threads (numpy releases the GIL in them).

FedAdam, FedYogi and FedAdagrad also have a fused one-pass form in C (`_fused.c`, built at
install where a compiler is found): the same IEEE operations in the same order, so the same
bits, with each array read or written once instead of a dozen cached passes. It is used when
it was built, unless TENSORSWAP_FUSED=0; `FUSED` says which form runs.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import TypeAlias

import numpy as np

from tensorswap.aggregate.server_opt.types import (
    FedAdagradHyper,
    FedAdamHyper,
    FedAvgHyper,
    FedAvgMHyper,
    FedYogiHyper,
    Hyper,
    NesterovHyper,
)

try:
    from tensorswap.aggregate.server_opt import _fused  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler at install): the numpy kernels serve
    _fused = None

#: Whether the fused C kernels run (built, and not turned off with TENSORSWAP_FUSED=0).
FUSED = _fused is not None and os.environ.get("TENSORSWAP_FUSED", "1") != "0"


def native() -> ModuleType | None:
    """The fused C extension module (its ``adaptive`` entry point and the ``ADAM``, ``YOGI``,
    ``ADAGRAD`` rule codes), or None where it was not built; whether it runs is ``FUSED``.
    For tests and benchmarks that check or time the C form against the numpy kernels."""
    return _fused


#: Values per chunk: 2 scratch buffers + 5 array slices of 256 KiB (float32) fit in L2.
CHUNK = 1 << 16


class Scratch:
    """Two reusable buffers of CHUNK values per dtype (allocated once, on first use)."""

    def __init__(self) -> None:
        self._buffers: dict[np.dtype, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, dtype: np.dtype, n: int) -> tuple[np.ndarray, np.ndarray]:
        pair = self._buffers.get(dtype)
        if pair is None:
            pair = (np.empty(CHUNK, dtype), np.empty(CHUNK, dtype))
            self._buffers[dtype] = pair
        return pair[0][:n], pair[1][:n]


#: A kernel: (hyper, server_round, current, aggregate, state by prefix, out, scratch); all
#: arrays flat, contiguous and of one dtype; it updates the state and writes `out` in place.
Kernel: TypeAlias = Callable[
    [Hyper, int, np.ndarray, np.ndarray, Mapping[str, np.ndarray], np.ndarray, Scratch], None
]


def _spans(n: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, CHUNK):
        yield start, min(start + CHUNK, n)


def fedavg(
    hyper: Hyper,
    server_round: int,
    cur: np.ndarray,
    agg: np.ndarray,
    state: Mapping[str, np.ndarray],
    out: np.ndarray,
    scratch: Scratch,
) -> None:
    """x <- aggregate."""
    np.copyto(out, agg)


def fedavgm(
    hyper: Hyper,
    server_round: int,
    cur: np.ndarray,
    agg: np.ndarray,
    state: Mapping[str, np.ndarray],
    out: np.ndarray,
    scratch: Scratch,
) -> None:
    """g = x - aggregate; m <- mu m + g (when mu > 0, else m = g); x <- x - lr m.

    With lr == 1 and mu == 0 Flower skips the server step and returns the aggregate as is; so
    does this kernel (x - (x - a) is not always a bit for bit).
    """
    assert isinstance(hyper, FedAvgMHyper)
    if hyper.server_learning_rate == 1.0 and hyper.server_momentum == 0.0:
        np.copyto(out, agg)
        return
    dt = cur.dtype
    lr, mu = dt.type(hyper.server_learning_rate), dt.type(hyper.server_momentum)
    mom = state.get("momentum")
    for s, e in _spans(cur.size):
        g, _ = scratch.get(dt, e - s)
        np.subtract(cur[s:e], agg[s:e], out=g)
        if mom is not None:
            mm = mom[s:e]
            np.multiply(mm, mu, out=mm)
            np.add(mm, g, out=mm)
            np.multiply(mm, lr, out=g)
        else:
            np.multiply(g, lr, out=g)
        np.subtract(cur[s:e], g, out=out[s:e])


def _first_moment(
    mm: np.ndarray, d: np.ndarray, t: np.ndarray, b1: np.generic, a1: np.generic
) -> None:
    """m <- beta_1 m + (1 - beta_1) d, in place (t is scratch)."""
    np.multiply(mm, b1, out=mm)
    np.multiply(d, a1, out=t)
    np.add(mm, t, out=mm)


def _adaptive_step(
    cur: np.ndarray, num: np.ndarray, vv: np.ndarray, out: np.ndarray, d: np.ndarray,
    t: np.ndarray, eta: np.generic, tau: np.generic,
) -> None:  # fmt: skip
    """out <- x + (eta num) / (sqrt(v) + tau); d and t are scratch (d may be num's buffer)."""
    np.sqrt(vv, out=t)
    np.add(t, tau, out=t)
    np.multiply(num, eta, out=d)
    np.divide(d, t, out=d)
    np.add(cur, d, out=out)


def fedadam(
    hyper: Hyper,
    server_round: int,
    cur: np.ndarray,
    agg: np.ndarray,
    state: Mapping[str, np.ndarray],
    out: np.ndarray,
    scratch: Scratch,
) -> None:
    """d = aggregate - x; m <- b1 m + (1-b1) d; v <- b2 v + (1-b2) d^2;
    x <- x + eta sqrt(1 - b2^(r+1)) / (1 - b1^(r+1)) m / (sqrt(v) + tau), r = server_round.
    """
    assert isinstance(hyper, FedAdamHyper)
    dt = cur.dtype
    b1, b2 = hyper.beta_1, hyper.beta_2
    # Flower's bias correction, with its exponent server_round + 1; computed in float64.
    eta_norm = (
        hyper.eta * math.sqrt(1.0 - b2 ** (server_round + 1.0)) / (1.0 - b1 ** (server_round + 1.0))
    )
    eta, tau = dt.type(eta_norm), dt.type(hyper.tau)
    b1s, a1, b2s, a2 = dt.type(b1), dt.type(1.0 - b1), dt.type(b2), dt.type(1.0 - b2)
    m, v = state["m"], state["v"]
    if FUSED:
        _fused.adaptive(_fused.ADAM, cur, agg, m, v, out, b1, 1.0 - b1, b2, 1.0 - b2, eta_norm,
                        hyper.tau)  # fmt: skip
        return
    for s, e in _spans(cur.size):
        d, t = scratch.get(dt, e - s)
        mm, vv = m[s:e], v[s:e]
        np.subtract(agg[s:e], cur[s:e], out=d)
        _first_moment(mm, d, t, b1s, a1)
        np.square(d, out=d)
        np.multiply(d, a2, out=d)
        np.multiply(vv, b2s, out=vv)
        np.add(vv, d, out=vv)
        _adaptive_step(cur[s:e], mm, vv, out[s:e], d, t, eta, tau)


def fedyogi(
    hyper: Hyper,
    server_round: int,
    cur: np.ndarray,
    agg: np.ndarray,
    state: Mapping[str, np.ndarray],
    out: np.ndarray,
    scratch: Scratch,
) -> None:
    """d = aggregate - x; m <- b1 m + (1-b1) d; v <- v - (1-b2) d^2 sign(v - d^2);
    x <- x + eta m / (sqrt(v) + tau).
    """
    assert isinstance(hyper, FedYogiHyper)
    dt = cur.dtype
    eta, tau = dt.type(hyper.eta), dt.type(hyper.tau)
    b1s, a1, a2 = dt.type(hyper.beta_1), dt.type(1.0 - hyper.beta_1), dt.type(1.0 - hyper.beta_2)
    m, v = state["m"], state["v"]
    if FUSED:
        b1, b2 = hyper.beta_1, hyper.beta_2
        _fused.adaptive(_fused.YOGI, cur, agg, m, v, out, b1, 1.0 - b1, b2, 1.0 - b2, hyper.eta,
                        hyper.tau)  # fmt: skip
        return
    for s, e in _spans(cur.size):
        d, t = scratch.get(dt, e - s)
        mm, vv = m[s:e], v[s:e]
        np.subtract(agg[s:e], cur[s:e], out=d)
        _first_moment(mm, d, t, b1s, a1)
        np.square(d, out=d)
        np.subtract(vv, d, out=t)
        np.sign(t, out=t)
        np.multiply(t, d, out=t)
        np.multiply(t, a2, out=t)
        np.subtract(vv, t, out=vv)
        _adaptive_step(cur[s:e], mm, vv, out[s:e], d, t, eta, tau)


def fedadagrad(
    hyper: Hyper,
    server_round: int,
    cur: np.ndarray,
    agg: np.ndarray,
    state: Mapping[str, np.ndarray],
    out: np.ndarray,
    scratch: Scratch,
) -> None:
    """d = aggregate - x; v <- v + d^2; x <- x + eta d / (sqrt(v) + tau).

    Flower keeps m = 0 m + 1 d, which is d itself; so no m is stored.
    """
    assert isinstance(hyper, FedAdagradHyper)
    dt = cur.dtype
    eta, tau = dt.type(hyper.eta), dt.type(hyper.tau)
    v = state["v"]
    if FUSED:  # m is unused by this rule: v stands in for it
        _fused.adaptive(_fused.ADAGRAD, cur, agg, v, v, out, 0.0, 1.0, 0.0, 1.0, hyper.eta,
                        hyper.tau)  # fmt: skip
        return
    for s, e in _spans(cur.size):
        d, t = scratch.get(dt, e - s)
        vv = v[s:e]
        np.subtract(agg[s:e], cur[s:e], out=d)
        np.square(d, out=t)
        np.add(vv, t, out=vv)
        _adaptive_step(cur[s:e], d, vv, out[s:e], d, t, eta, tau)


def nesterov(
    hyper: Hyper,
    server_round: int,
    cur: np.ndarray,
    agg: np.ndarray,
    state: Mapping[str, np.ndarray],
    out: np.ndarray,
    scratch: Scratch,
) -> None:
    """g = x - aggregate; b <- mu b + g; x <- x - lr (g + mu b) (torch SGD, nesterov=True).

    With momentum 0 this is plain SGD on the pseudo-gradient, x - lr g, and no b is kept.
    """
    assert isinstance(hyper, NesterovHyper)
    dt = cur.dtype
    lr, mu = dt.type(hyper.lr), dt.type(hyper.momentum)
    buf = state.get("momentum")
    for s, e in _spans(cur.size):
        g, t = scratch.get(dt, e - s)
        np.subtract(cur[s:e], agg[s:e], out=g)
        if buf is not None:
            bb = buf[s:e]
            np.multiply(bb, mu, out=bb)
            np.add(bb, g, out=bb)
            np.multiply(bb, mu, out=t)
            np.add(g, t, out=g)
        np.multiply(g, lr, out=g)
        np.subtract(cur[s:e], g, out=out[s:e])


def state_prefixes(hyper: Hyper) -> tuple[str, ...]:
    """The names of the per-tensor state arrays a kind keeps under these hyper-parameters."""
    if isinstance(hyper, FedAdamHyper | FedYogiHyper):
        return ("m", "v")
    if isinstance(hyper, FedAdagradHyper):
        return ("v",)
    if isinstance(hyper, FedAvgMHyper):
        return ("momentum",) if hyper.server_momentum > 0.0 else ()
    if isinstance(hyper, NesterovHyper):
        return ("momentum",) if hyper.momentum > 0.0 else ()
    assert isinstance(hyper, FedAvgHyper)
    return ()


#: Values per piece of work handed to a thread; a model under two pieces runs on one thread.
PIECE = 16 * CHUNK


@dataclass(frozen=True)
class Job:
    """One tensor's update: flat, contiguous arrays of one dtype."""

    cur: np.ndarray
    agg: np.ndarray
    state: Mapping[str, np.ndarray]
    out: np.ndarray

    def piece(self, s: int, e: int) -> Job:
        state = {p: a[s:e] for p, a in self.state.items()}
        return Job(self.cur[s:e], self.agg[s:e], state, self.out[s:e])


def run(
    kernel: Kernel,
    hyper: Hyper,
    server_round: int,
    jobs: Sequence[Job],
    workers: int,
    scratch: Scratch,
) -> None:
    """Run `kernel` over every job: on this thread, or in pieces on up to `workers` threads
    (each with its own scratch) when the model has at least two pieces. Returns when all is
    written; the pieces are disjoint, so the result does not depend on the split."""
    total = sum(job.cur.size for job in jobs)
    if workers <= 1 or total < 2 * PIECE:
        for job in jobs:
            kernel(hyper, server_round, job.cur, job.agg, job.state, job.out, scratch)
        return
    pieces = [
        job.piece(s, min(s + PIECE, job.cur.size))
        for job in jobs
        for s in range(0, job.cur.size, PIECE)
    ]
    local = threading.local()

    def work(job: Job) -> None:
        mine = getattr(local, "scratch", None)
        if mine is None:
            mine = local.scratch = Scratch()
        # numpy's error state is per thread: the caller's `quiet` does not reach this one
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            kernel(hyper, server_round, job.cur, job.agg, job.state, job.out, mine)

    with ThreadPoolExecutor(min(workers, len(pieces)), "server-opt") as pool:
        for _ in pool.map(work, pieces):
            pass
