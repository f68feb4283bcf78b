"""The server-optimizer registry (kind -> kernel, complete at import), the optimizer and factory."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from tensorswap import _alloc
from tensorswap.aggregate._kernels import quiet
from tensorswap.aggregate.server_opt import kernels
from tensorswap.aggregate.server_opt.types import (
    HYPER_TYPES,
    Hyper,
    InvalidServerOptimizer,
    InvalidServerRound,
    InvalidServerStepInput,
    ServerOptimizerKind,
    ServerOptimizerStateMismatch,
    coerce_kind,
    make_hyper,
)
from tensorswap.aggregate.validate import FLOAT_DTYPE_NAMES, dtype_name
from tensorswap.codec.dtypes import as_numpy, is_torch_tensor
from tensorswap.errors import UnsupportedDtype

SERVER_OPTIMIZERS: MappingProxyType[ServerOptimizerKind, kernels.Kernel] = MappingProxyType(
    {
        ServerOptimizerKind.FEDAVG: kernels.fedavg,
        ServerOptimizerKind.FEDAVGM: kernels.fedavgm,
        ServerOptimizerKind.FEDADAM: kernels.fedadam,
        ServerOptimizerKind.FEDYOGI: kernels.fedyogi,
        ServerOptimizerKind.FEDADAGRAD: kernels.fedadagrad,
        ServerOptimizerKind.NESTEROV: kernels.nesterov,
    }
)

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _check_complete() -> None:
    for table, what in ((SERVER_OPTIMIZERS, "a kernel"), (HYPER_TYPES, "hyper-parameters")):
        missing = set(ServerOptimizerKind) - set(table)
        if missing:
            names = ", ".join(sorted(k.name for k in missing))
            raise RuntimeError(f"server optimizer registry lacks {what} for: {names}")


_check_complete()


def _array(name: str, obj: object, role: str) -> np.ndarray:
    if is_torch_tensor(obj):
        try:
            obj = as_numpy(obj)
        except (UnsupportedDtype, TypeError, RuntimeError) as exc:
            raise InvalidServerStepInput(name, f"{role} tensor not readable: {exc}") from exc
    if not isinstance(obj, np.ndarray):
        got = type(obj).__name__
        raise InvalidServerStepInput(name, f"{role} is a {got}, not a numpy array or torch tensor")
    if dtype_name(obj.dtype) not in FLOAT_DTYPE_NAMES:
        allowed = ", ".join(sorted(FLOAT_DTYPE_NAMES))
        raise InvalidServerStepInput(name, f"{role} has dtype {obj.dtype}; allowed: {allowed}")
    return obj


def _pairs(
    current: Mapping[str, Any], aggregate: Mapping[str, Any]
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, current, aggregate) per tensor in current's order; every check before arithmetic."""
    for role, obj in (("current", current), ("aggregate", aggregate)):
        if not isinstance(obj, Mapping):
            raise InvalidServerStepInput(None, f"{role} must map names to arrays")
    if set(current) != set(aggregate):
        missing = sorted(map(str, set(current) - set(aggregate)))
        extra = sorted(map(str, set(aggregate) - set(current)))
        raise InvalidServerStepInput(None, f"names differ: aggregate lacks {missing}, adds {extra}")
    out = []
    for name in current:
        if not isinstance(name, str) or not name:
            raise InvalidServerStepInput(None, f"tensor names must be non-empty str, got {name!r}")
        cur = _array(name, current[name], "current")
        agg = _array(name, aggregate[name], "aggregate")
        if cur.shape != agg.shape:
            raise InvalidServerStepInput(name, f"shapes differ: {cur.shape} vs {agg.shape}")
        out.append((name, cur, agg))
    return out


def _compute_dtype(cur: np.ndarray, agg: np.ndarray) -> np.dtype:
    """float64 when either side is float64, float32 otherwise (float16/bfloat16 included)."""
    return _F64 if _F64 in (cur.dtype, agg.dtype) else _F32


class ServerOptimizer:
    """One server optimizer: `step` turns the current global model and the round's aggregate
    into the next global model, updating the optimizer's state in place.

    The state is named arrays, `<prefix>/<tensor>` (such as `m/fc.weight`, `v/fc.weight`,
    `momentum/fc.weight`), created as zeros on the first step (Flower's initialisation) and
    kept in the compute dtype (float32, or float64 for float64 tensors). `load_state` of a
    saved state and the same inputs give bit-identical steps, for any `workers`: the threads a
    step of a model of at least 2M values is split over (default 1; numpy releases the GIL, so
    a few threads help where cores are idle).
    One step at a time: not thread-safe.
    """

    def __init__(self, kind: ServerOptimizerKind, hyper: Hyper, *, workers: int = 1) -> None:
        if not isinstance(hyper, HYPER_TYPES[kind]):
            raise InvalidServerOptimizer("hyper", hyper, f"not the {kind.value} hyper-parameters")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidServerOptimizer("workers", workers, "must be an int >= 1")
        self.workers = workers
        self.kind = kind
        self.hyper = hyper
        self.prefixes = kernels.state_prefixes(hyper)
        self._state: dict[str, np.ndarray] = {}
        self._scratch = kernels.Scratch()

    def __repr__(self) -> str:
        return (
            f"ServerOptimizer({self.kind.value}, {self.hyper!r}, {len(self._state)} state arrays)"
        )

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The state arrays by name, as read-only views (not copies): the next step changes them,
        so copy (or store) them before it if they must outlive it. Empty before the first step."""
        views = {}
        for name, arr in self._state.items():
            view = arr.view()
            view.flags.writeable = False
            views[name] = view
        return views

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Replace the state with copies of `state` (as saved from `state`); an empty mapping
        resets the optimizer. Names, dtypes and completeness are checked here, shapes against
        the model at the next step. Raises ServerOptimizerStateMismatch; nothing is changed then.
        """
        if not isinstance(state, Mapping):
            raise ServerOptimizerStateMismatch(None, "must map names to arrays")
        loaded: dict[str, np.ndarray] = {}
        tensors: dict[str, set[str]] = {}
        for name, arr in state.items():
            prefix, _, tensor = name.partition("/") if isinstance(name, str) else ("", "", "")
            if prefix not in self.prefixes or not tensor:
                expected = ", ".join(f"{p}/<tensor>" for p in self.prefixes) or "no state"
                raise ServerOptimizerStateMismatch(name, f"{self.kind.value} keeps {expected}")
            if is_torch_tensor(arr):
                arr = as_numpy(arr)
            if not isinstance(arr, np.ndarray) or arr.dtype not in (_F32, _F64):
                got = getattr(arr, "dtype", type(arr).__name__)
                raise ServerOptimizerStateMismatch(name, f"must be a float32/float64 array: {got}")
            loaded[name] = np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C", copy=True)
            tensors.setdefault(tensor, set()).add(prefix)
        for tensor, have in tensors.items():
            if have != set(self.prefixes):
                lacking = sorted(set(self.prefixes) - have)
                raise ServerOptimizerStateMismatch(f"{lacking[0]}/{tensor}", "missing")
        self._state = loaded

    def _state_for(self, name: str, cur: np.ndarray, dtype: np.dtype) -> dict[str, np.ndarray]:
        out = {}
        for prefix in self.prefixes:
            arr = self._state.get(f"{prefix}/{name}")
            if arr is None:  # only before the first step: the names were checked against it
                arr = _alloc.empty(cur.size, dtype).reshape(cur.shape)
                arr.fill(0)
            elif arr.shape != cur.shape or arr.dtype != dtype:
                raise ServerOptimizerStateMismatch(
                    f"{prefix}/{name}",
                    f"holds {arr.dtype}{list(arr.shape)}, the step needs {dtype}{list(cur.shape)}",
                )
            out[prefix] = arr
        return out

    @quiet
    def step(
        self, current: Mapping[str, Any], aggregate: Mapping[str, Any], server_round: int
    ) -> dict[str, np.ndarray]:
        """The next global model from the current one and this round's aggregate (Flower's
        aggregated model), in current's tensor order and the compute dtype; never aliases an
        input. `server_round` counts from 1 (FedAdam's bias correction uses it).

        Everything is validated before the state changes: InvalidServerRound,
        InvalidServerStepInput, ServerOptimizerStateMismatch (a loaded state that names other
        tensors or shapes). Non-finite values are not checked: IEEE rules apply.
        """
        if isinstance(server_round, bool) or not isinstance(server_round, int | np.integer):
            raise InvalidServerRound(server_round)
        if server_round < 1:
            raise InvalidServerRound(server_round)
        pairs = _pairs(current, aggregate)
        if self._state:
            kept = {n.partition("/")[2] for n in self._state}
            names = {name for name, _, _ in pairs}
            if kept != names:
                lost = sorted(kept - names) or sorted(names - kept)
                raise ServerOptimizerStateMismatch(
                    None, f"kept for other tensors than the step's (e.g. {lost[0]!r})"
                )
        plans = []
        for name, cur, agg in pairs:
            dtype = _compute_dtype(cur, agg)
            plans.append((name, cur, agg, dtype, self._state_for(name, cur, dtype)))
        result: dict[str, np.ndarray] = {}
        new_state: dict[str, np.ndarray] = {}
        jobs = []
        for name, cur, agg, dtype, arrays in plans:
            out = _alloc.empty(cur.size, dtype)  # recycled pages: no first-touch faults
            jobs.append(
                kernels.Job(
                    np.ascontiguousarray(cur, dtype=dtype).reshape(-1),
                    np.ascontiguousarray(agg, dtype=dtype).reshape(-1),
                    {p: a.reshape(-1) for p, a in arrays.items()},
                    out,
                )
            )
            result[name] = out.reshape(cur.shape)
            for prefix, arr in arrays.items():
                new_state[f"{prefix}/{name}"] = arr
        kernel = SERVER_OPTIMIZERS[self.kind]
        kernels.run(kernel, self.hyper, int(server_round), jobs, self.workers, self._scratch)
        self._state = new_state
        return result

    @quiet
    def step_piece(
        self,
        server_round: int,
        current: np.ndarray,
        aggregate: np.ndarray,
        state: Mapping[str, np.ndarray],
        out: np.ndarray,
    ) -> None:
        """One flat piece of one tensor, for a caller that streams a model chunk by chunk:
        ``out`` gets the next global values of the piece, ``state`` (prefix -> this piece's
        writable state array, zeros before the first step) is updated in place. Every kind's
        rule is elementwise, so pieces stepped one by one give exactly what ``step`` gives
        for the whole tensor. Does not touch this optimizer's own ``state``. All arrays 1-D,
        the same length; ``out`` and the state in the compute dtype (float32 or float64), none of
        them overlapping another array."""
        if isinstance(server_round, bool) or not isinstance(server_round, int | np.integer):
            raise InvalidServerRound(server_round)
        if server_round < 1:
            raise InvalidServerRound(server_round)
        dtype = _compute_dtype(current, aggregate)
        if set(state) != set(self.prefixes):
            raise ServerOptimizerStateMismatch(None, f"a piece needs state {self.prefixes}")
        arrays = [current, aggregate, out, *state.values()]
        if any(a.ndim != 1 or a.size != current.size for a in arrays):
            raise InvalidServerStepInput("piece", "arrays must be 1-D and of one length")
        if out.dtype != dtype or any(a.dtype != dtype for a in state.values()):
            raise InvalidServerStepInput("piece", f"out and state must be {dtype}")
        written = [out, *state.values()]
        for i, w in enumerate(written):
            if any(np.may_share_memory(w, a) for a in [current, aggregate, *written[i + 1 :]]):
                raise InvalidServerStepInput("piece", "out and the state must not overlap")
        job = kernels.Job(
            np.ascontiguousarray(current, dtype=dtype),
            np.ascontiguousarray(aggregate, dtype=dtype),
            dict(state),
            out,
        )
        kernels.run(
            SERVER_OPTIMIZERS[self.kind], self.hyper, int(server_round), [job], 1, self._scratch
        )


def server_optimizer(
    kind: ServerOptimizerKind | str, *, workers: int = 1, **hyper: Any
) -> ServerOptimizer:
    """A fresh optimizer of `kind` (a ServerOptimizerKind or its value, e.g. 'fedadam') with
    the given hyper-parameters and Flower 1.42's defaults for the rest; `workers` as in
    ServerOptimizer.

    Raises InvalidServerOptimizer for an unknown kind or option, or a value out of range.
    """
    k = coerce_kind(kind)
    return ServerOptimizer(k, make_hyper(k, hyper), workers=workers)
