"""BlockingCollective: the Collective API as blocking calls, on a private loop thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, Self, TypeVar

from tensorswap.collective._call import CallStats
from tensorswap.collective.peer import Collective

__all__ = ["BlockingCollective"]

T = TypeVar("T")


class BlockingCollective:
    """``Collective.join`` and ``all_reduce`` for code that is not async.

    It owns an event loop in a daemon thread (the peer's polls, its slice server and its
    calls run there); each call waits for its result and raises what Collective raises.
    ``close`` (or ``with``) leaves the group and stops the thread."""

    def __init__(self, address: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tensorswap-collective", daemon=True
        )
        self._thread.start()
        try:
            self._group: Collective = self._run(Collective.join(address, **options))
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def members(self) -> list[str]:
        return list(self._group.members)

    @property
    def stats(self) -> CallStats:
        return self._group.stats

    def all_reduce(self, tensors: Mapping[str, Any], weight: float = 1.0) -> dict[str, Any]:
        return self._run(self._group.all_reduce(tensors, weight))

    def close(self) -> None:
        try:
            self._run(self._group.aclose())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
