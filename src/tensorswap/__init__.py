"""tensorswap: move gradients and weight deltas between training peers and aggregate them.

The top level is what a user starts with: content-addressed stores and model updates,
the aggregators and server optimizers, the round coordinator and its clients, federated
runs, the block service, the root error and the few errors a user catches. Everything
else lives one level down: ``tensorswap.errors`` (the whole error tree), ``tensorswap.delta``
(DWE weight-delta fragments), ``tensorswap.flow`` (training messages over ZeroMQ),
``tensorswap.codec.ipfrs`` and ``tensorswap.codec.garw`` (the seeds' formats), and each
room's own front (``tensorswap.rounds``, ``tensorswap.runs``, ``tensorswap.wire``, ...).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorswap.aggregate import (
        AggregateResult,
        AggregatorKind,
        AggregatorSpec,
        Contribution,
        NonFinitePolicy,
        ServerOptimizer,
        ServerOptimizerKind,
        StreamingAccumulator,
        clip_contributions,
        krum,
        mean,
        median,
        multi_krum,
        server_optimizer,
        trimmed_mean,
    )
    from tensorswap.aggregate.registry import (
        fedavg,  # its own line: mypy confuses the name with the submodule aggregate.fedavg
    )
    from tensorswap.cid import Cid, HashFunction, Multicodec
    from tensorswap.codec import (
        DType,
        Encoding,
        TensorBlock,
        as_numpy,
        decode_block,
        encode_block,
        to_torch,
    )
    from tensorswap.errors import (
        BlockNotFound,
        CodecError,
        DuplicateContribution,
        NotSelected,
        PrivacyError,
        RoundNotFound,
        RoundsError,
        RoundTimeout,
        RunsError,
        StoreError,
        TensorSwapError,
        WireError,
    )
    from tensorswap.rounds import (
        BlockingRoundClient,
        Complete,
        Coordinator,
        Failed,
        RoundClient,
        RoundId,
        RoundServer,
        RoundSpec,
        RoundStatus,
        VirtualClients,
    )
    from tensorswap.runs import RunClient, RunManager, RunSpec
    from tensorswap.store import (
        BlockStore,
        DirectoryStore,
        MemoryStore,
        ModelUpdate,
        TensorManifest,
        UpdateManifest,
        collect_garbage,
        get_tensor,
        get_update,
        put_tensor,
        put_update,
    )
    from tensorswap.wire import (
        AuthenticationFailed,
        BlockClient,
        BlockServer,
        ConnectionFailed,
        RemoteError,
        Timeouts,
        WireLimits,
        client_ssl_context,
        server_ssl_context,
    )

# Each name's home module, imported on first use (PEP 562): ``import tensorswap.wire`` (every
# command line tool, every peer process) then loads the wire and what it needs, not the
# coordinator, the runs and the aggregators as well (about 0.3 s of a process's start).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "tensorswap.aggregate": (
        "AggregateResult",
        "AggregatorKind",
        "AggregatorSpec",
        "Contribution",
        "NonFinitePolicy",
        "ServerOptimizer",
        "ServerOptimizerKind",
        "StreamingAccumulator",
        "clip_contributions",
        "fedavg",
        "krum",
        "mean",
        "median",
        "multi_krum",
        "server_optimizer",
        "trimmed_mean",
    ),
    "tensorswap.cid": (
        "Cid",
        "HashFunction",
        "Multicodec",
    ),
    "tensorswap.codec": (
        "DType",
        "Encoding",
        "TensorBlock",
        "as_numpy",
        "decode_block",
        "encode_block",
        "to_torch",
    ),
    "tensorswap.errors": (
        "BlockNotFound",
        "CodecError",
        "DuplicateContribution",
        "NotSelected",
        "PrivacyError",
        "RoundNotFound",
        "RoundsError",
        "RoundTimeout",
        "RunsError",
        "StoreError",
        "TensorSwapError",
        "WireError",
    ),
    "tensorswap.rounds": (
        "BlockingRoundClient",
        "Complete",
        "Coordinator",
        "Failed",
        "RoundClient",
        "RoundId",
        "RoundServer",
        "RoundSpec",
        "RoundStatus",
        "VirtualClients",
    ),
    "tensorswap.runs": (
        "RunClient",
        "RunManager",
        "RunSpec",
    ),
    "tensorswap.store": (
        "BlockStore",
        "DirectoryStore",
        "MemoryStore",
        "ModelUpdate",
        "TensorManifest",
        "UpdateManifest",
        "collect_garbage",
        "get_tensor",
        "get_update",
        "put_tensor",
        "put_update",
    ),
    "tensorswap.wire": (
        "AuthenticationFailed",
        "BlockClient",
        "BlockServer",
        "ConnectionFailed",
        "RemoteError",
        "Timeouts",
        "WireLimits",
        "client_ssl_context",
        "server_ssl_context",
    ),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorswap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AggregateResult",
    "AggregatorKind",
    "AggregatorSpec",
    "AuthenticationFailed",
    "BlockClient",
    "BlockNotFound",
    "BlockServer",
    "BlockStore",
    "BlockingRoundClient",
    "Cid",
    "CodecError",
    "Complete",
    "ConnectionFailed",
    "Contribution",
    "Coordinator",
    "DType",
    "DirectoryStore",
    "DuplicateContribution",
    "Encoding",
    "Failed",
    "HashFunction",
    "MemoryStore",
    "ModelUpdate",
    "Multicodec",
    "NonFinitePolicy",
    "NotSelected",
    "PrivacyError",
    "RemoteError",
    "RoundClient",
    "RoundId",
    "RoundNotFound",
    "RoundServer",
    "RoundSpec",
    "RoundStatus",
    "RoundTimeout",
    "RoundsError",
    "RunClient",
    "RunManager",
    "RunSpec",
    "RunsError",
    "ServerOptimizer",
    "ServerOptimizerKind",
    "StoreError",
    "StreamingAccumulator",
    "TensorBlock",
    "TensorManifest",
    "TensorSwapError",
    "Timeouts",
    "UpdateManifest",
    "VirtualClients",
    "WireError",
    "WireLimits",
    "as_numpy",
    "client_ssl_context",
    "clip_contributions",
    "collect_garbage",
    "decode_block",
    "encode_block",
    "fedavg",
    "get_tensor",
    "get_update",
    "krum",
    "mean",
    "median",
    "multi_krum",
    "put_tensor",
    "put_update",
    "server_optimizer",
    "server_ssl_context",
    "to_torch",
    "trimmed_mean",
]
