"""One explicit registry of remote error types (issue 24): which exception a client raises
for a coordinator's refusal never depends on what else the process imported.

Before, ``rounds.protocol`` filled its table as a side effect of importing other rooms'
``errors`` modules: a process that had not imported ``tensorswap.region`` got a bare
``RemoteError("RegionLoop")``. Now every errors module registers its leaves through
``tensorswap.errors.register_remote`` where they are defined, and they all live under
``tensorswap.errors``, so importing ``tensorswap.rounds`` registers every built-in one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tensorswap
from tensorswap.errors import (
    PrivacyError,
    RoundsError,
    SecAggError,
    TensorSwapError,
    register_remote,
    remote_types,
)
from tensorswap.rounds import Coordinator, FakeClock
from tensorswap.rounds.server import RoundServer
from tensorswap.runs import RunManager, RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.runs.service import RunService
from tensorswap.store import ModelUpdate

KEY = b"remote-errors-key"
SRC = str(Path(tensorswap.__file__).parent.parent)


def _fresh(code: str) -> dict[str, object]:
    """Run ``code`` in a new interpreter that imports only what it names; its JSON output."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


def test_a_fresh_interpreter_importing_only_rounds_raises_every_branch_typed() -> None:
    """RegionLoop (region), NotSelected (runs), PrivacyBudgetExhausted (DP),
    ShareDecryptionFailed (SecAgg+) and SampleHidden (rounds), decoded by rounds alone."""
    got = _fresh(
        """
        import json, sys
        from tensorswap.rounds.protocol import ErrorInfo, raise_remote
        out = {}
        for code in ("RegionLoop", "NotSelected", "PrivacyBudgetExhausted",
                     "ShareDecryptionFailed", "SampleHidden"):
            try:
                raise_remote(ErrorInfo(code, "refused", {}), "peer")
            except Exception as exc:
                out[code] = type(exc).__module__ + "." + type(exc).__name__
        out["region imported"] = "tensorswap.region" in sys.modules
        print(json.dumps(out))
        """
    )
    assert got == {
        "RegionLoop": "tensorswap.errors.region.RegionLoop",
        "NotSelected": "tensorswap.errors.runs.NotSelected",
        "PrivacyBudgetExhausted": "tensorswap.errors.privacy.PrivacyBudgetExhausted",
        "ShareDecryptionFailed": "tensorswap.errors.secagg.ShareDecryptionFailed",
        "SampleHidden": "tensorswap.errors.rounds.SampleHidden",
        "region imported": False,  # region's refusals are known without importing region
    }


async def test_a_round_client_in_a_fresh_interpreter_gets_a_runs_refusal_typed(
    tmp_path: Path,
) -> None:
    """Over the wire: a plain RoundClient process submits to a run's
    round without being sampled and gets NotSelected, not a bare RemoteError."""
    import asyncio

    coord = Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, key=KEY, max_wait=30)
    RunService(runs, server)
    try:
        await server.start("127.0.0.1", 0)
        async with await RunClient.connect("127.0.0.1", server.port, peer="a", key=KEY) as a:
            await a.register({"num_samples": 1})
            model = ModelUpdate({"w": np.zeros(4, np.float32)})
            await a.create_run("r", RunSpec(per_round=1, rounds=1, min_clients=1), model)
            code = f"""
                import asyncio, json, sys
                import numpy as np
                from tensorswap.rounds import RoundClient, RoundId
                from tensorswap.store import ModelUpdate

                async def main():
                    async with await RoundClient.connect(
                        "127.0.0.1", {server.port}, peer="stranger", key={KEY!r}
                    ) as client:
                        try:
                            await client.submit(
                                RoundId(1, "r"), ModelUpdate({{"w": np.ones(4, np.float32)}}), 1
                            )
                        except Exception as exc:
                            return type(exc).__module__ + "." + type(exc).__name__
                    return "accepted"

                got = asyncio.run(main())
                print(json.dumps({{"raised": got, "region": "tensorswap.region" in sys.modules}}))
            """
            got = await asyncio.to_thread(_fresh, code)
        assert got == {"raised": "tensorswap.errors.runs.NotSelected", "region": False}
    finally:
        await server.aclose()
        runs.close()
        coord.close()


def test_every_refusal_class_in_the_tree_is_registered() -> None:
    """Every leaf of the rounds, runs, privacy and region branches crosses the wire typed."""
    import tensorswap.errors as errors

    leaves = {
        name: obj
        for name in errors.__all__
        if isinstance(obj := getattr(errors, name), type)
        and issubclass(obj, RoundsError | PrivacyError)
    }
    assert leaves, "the walk found no leaves"
    missing = sorted(name for name, cls in leaves.items() if remote_types().get(name) is not cls)
    assert not missing, f"not registered as remote refusals: {missing}"


def test_no_refusal_class_anywhere_in_the_package_is_left_unregistered() -> None:
    """The walk above sees ``tensorswap.errors``; this one imports every module and checks
    every subclass of the two refusal branches, wherever it is defined."""
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(tensorswap.__path__, "tensorswap."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # an optional extra (torch, ray, ...) not installed
            if (exc.name or "").partition(".")[0] == "tensorswap":
                raise
    found: set[type] = set()
    todo: list[type] = [RoundsError, PrivacyError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found and sub.__module__.startswith("tensorswap."):
                found.add(sub)
                todo.append(sub)
    assert len(found) > 50, "the walk found too few refusal classes"
    missing = sorted(
        f"{c.__module__}.{c.__qualname__}" for c in found if remote_types().get(c.__name__) is not c
    )
    assert not missing, f"not registered as remote refusals: {missing}"


def test_privacy_is_one_branch_under_the_root() -> None:
    """DP and SecAgg+ errors share the privacy branch: ``except PrivacyError`` catches both,
    and neither is a rounds or runs error any more."""
    from tensorswap.errors import PrivacyBudgetExhausted, ShareDecryptionFailed

    for leaf in (PrivacyBudgetExhausted, ShareDecryptionFailed, SecAggError):
        assert issubclass(leaf, PrivacyError) and not issubclass(leaf, RoundsError)
    assert PrivacyError.__bases__ == (TensorSwapError,)


def test_registering_a_second_class_under_a_taken_name_is_refused() -> None:
    existing = remote_types()["RegionLoop"]
    register_remote(existing)  # the same class again: nothing changes

    class RegionLoop(RoundsError):  # another class of the same name
        pass

    with pytest.raises(ValueError, match="two remote error types are named RegionLoop"):
        register_remote(RegionLoop)
    with pytest.raises(TypeError):
        register_remote(ValueError)  # type: ignore[arg-type]
    assert remote_types()["RegionLoop"] is existing
