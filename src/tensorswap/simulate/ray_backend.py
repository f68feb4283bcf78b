"""The ``ray`` backend: each worker a Ray actor hosting its share of the virtual clients.

Needs ``tensorswap[ray]``. Without ``address`` it starts a local Ray instance (one CPU per
worker at least) and shuts it down at the end; with ``address`` (``ray://HOST:10001`` or
``HOST:6379``, or ``auto``) it joins that cluster and leaves it running. An actor runs the
same ``SimWorker`` as a worker process: Ray carries only the small command and report dicts
between the driver and the actors (its own transport); every model and update travels
between an actor and the coordinator over tensorswap's wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tensorswap.simulate._env import MALLOC_SETTINGS, sim_env
from tensorswap.simulate.backends import READY_TIMEOUT_S, STOP_TIMEOUT_S, gather_or_cancel
from tensorswap.simulate.errors import SimulationError

__all__ = ["RayBackend", "ray_available"]

_ACTOR: Any = None


def ray_available() -> bool:
    """Whether Ray can be imported here (``pip install 'tensorswap[ray]'``)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _actor_class() -> Any:
    global _ACTOR
    if _ACTOR is None:
        import ray

        from tensorswap.simulate.worker import SimWorker

        class SimActor:
            """A ``SimWorker`` in a Ray actor (an async actor: one event loop)."""

            def __init__(self, spec: dict[str, Any]) -> None:
                self.worker = SimWorker(spec)

            async def start(self) -> dict[str, Any]:
                return await self.worker.start()

            async def round(self, cmd: dict[str, Any]) -> dict[str, Any]:
                return await self.worker.round(cmd)

            async def stop(self) -> None:
                await self.worker.aclose()

        _ACTOR = ray.remote(SimActor)
    return _ACTOR


class RayBackend:
    """Workers as Ray actors (one CPU each)."""

    def __init__(self, timeout_s: float, address: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.address = address
        self.actors: list[Any] = []
        self._pids: list[int] = []
        self._owns_ray = False

    async def start(self, specs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        try:
            import ray
        except ImportError:
            raise SimulationError(
                "the ray backend needs Ray: pip install 'tensorswap[ray]'"
            ) from None
        if not ray.is_initialized():
            full = sim_env()
            env = {k: v for k, v in full.items() if k.endswith("THREADS") or k in MALLOC_SETTINGS}
            if self.address is None:
                env["PYTHONPATH"] = full["PYTHONPATH"]
                ray.init(
                    num_cpus=max(len(specs), os.cpu_count() or 1),
                    include_dashboard=False,
                    log_to_driver=False,
                    runtime_env={"env_vars": env},
                )
            else:
                ray.init(address=self.address, log_to_driver=False, runtime_env={"env_vars": env})
            self._owns_ray = True
        actor = _actor_class()
        self.actors = [actor.options(num_cpus=1).remote(dict(s)) for s in specs]
        ready = await gather_or_cancel(
            self._call(i, a.start.remote(), READY_TIMEOUT_S) for i, a in enumerate(self.actors)
        )
        self._pids = [int(r.get("pid", 0)) for r in ready]
        return list(ready)

    async def round(self, worker: int, cmd: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call(worker, self.actors[worker].round.remote(dict(cmd)), self.timeout_s)

    def pids(self) -> list[int]:
        return list(self._pids)

    async def _call(self, index: int, ref: Any, timeout: float) -> dict[str, Any]:
        import ray

        try:
            answer = await asyncio.wait_for(ref, timeout)
        except TimeoutError:
            raise SimulationError(f"ray worker {index} gave no answer in {timeout:g}s") from None
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            raise SimulationError(f"ray worker {index}: {type(cause).__name__}: {cause}") from None
        if not isinstance(answer, dict):
            raise SimulationError(f"ray worker {index} answered {answer!r}")
        return answer

    async def aclose(self) -> None:
        """Stop every actor (closing its connections), kill it; shut down a local Ray."""
        try:
            import ray
        except ImportError:
            return
        if not ray.is_initialized():
            return
        stops = [a.stop.remote() for a in self.actors]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), STOP_TIMEOUT_S)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
