"""BlockingRoundClient: the RoundClient API as blocking calls, on a private loop thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import Any, Self, TypeVar

import numpy as np

from tensorswap.cid import Cid
from tensorswap.rounds.client.client import RoundClient, ServerStatus, SubmitResult
from tensorswap.rounds.core.state import RoundId, RoundSpec, RoundStatus
from tensorswap.store import ModelUpdate

__all__ = ["BlockingRoundClient"]

T = TypeVar("T")


class BlockingRoundClient:
    """The RoundClient API as blocking calls, for code that is not async.

    It owns a private event loop running in a daemon thread; each call runs there and this
    thread waits for it, so the calls are safe from any one thread at a time and raise
    exactly what RoundClient raises. ``close`` (or ``with``) closes the connection and stops
    the loop thread.
    """

    def __init__(self, host: str, port: int, *, peer: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tensorswap-rounds-client", daemon=True
        )
        self._thread.start()
        try:
            self._client: RoundClient = self._run(
                RoundClient.connect(host, port, peer=peer, **options)
            )
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def peer(self) -> str:
        return self._client.peer

    @peer.setter
    def peer(self, name: str) -> None:
        self._client.peer = name

    @property
    def client(self) -> RoundClient:
        """The underlying async client (use it only through this object's loop)."""
        return self._client

    def start_round(self, round_id: RoundId, spec: RoundSpec) -> bool:
        return self._run(self._client.start_round(round_id, spec))

    def submit(
        self,
        round_id: RoundId,
        update: ModelUpdate | Mapping[str, Any] | Cid,
        num_samples: int = 0,
        **options: Any,
    ) -> SubmitResult:
        return self._run(self._client.submit(round_id, update, num_samples, **options))

    def status(self, round_id: RoundId) -> RoundStatus:
        return self._run(self._client.status(round_id))

    def server_status(self) -> ServerStatus:
        return self._run(self._client.server_status())

    def wait(self, round_id: RoundId, timeout: float | None = None) -> RoundStatus:
        return self._run(self._client.wait(round_id, timeout))

    def result(self, round_id: RoundId, timeout: float | None = None) -> Cid:
        return self._run(self._client.result(round_id, timeout))

    def fetch(self, cid: Cid) -> ModelUpdate:
        return self._run(self._client.fetch(cid))

    def fetch_result(
        self, round_id: RoundId, timeout: float | None = None
    ) -> dict[str, np.ndarray]:
        return self._run(self._client.fetch_result(round_id, timeout))

    def close(self) -> None:
        """Close the connection and stop the loop thread; idempotent."""
        if self._loop.is_closed():
            return
        try:
            if self._loop.is_running():
                self._run(self._client.aclose())
        finally:
            self._stop()

    def _stop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
